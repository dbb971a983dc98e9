"""The interactive session behind the app and `layerswap ask`: two experts, their merge, answers.

    wb = Workbench(device="cpu")
    report = wb.load("math/", "lang/", base="base/")
    wb.build(Plan(b=2, u=1, tb=1, tu=0))
    for a in wb.ask_mgsm("sw", 3, source="mgsm/"): print(a.model, a.scored.flexible, a.correct)

The experts are loaded once. A build merges in memory: layers with weight 0 or 1 share the
experts' tensors, only blended layers take new memory, and the merged engine's weights are
swapped in place, so re-merging with another plan is cheap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import mgsm
from .analysis import Analysis, DiffResult, MergedStats, analyze, diff_result
from .checkpoints import Checkpoint, CompatReport, check_compatible
from .engines import TransformersEngine, load_tokenizer, model_from_state_dict, resolve_device
from .errors import UserError
from .merging import MergeSummary, export_merge, merge_state_dicts, weights_for_names
from .plans import Plan

Progress = Callable[[float, str], None]
ROLES = ("math", "lang", "merged")
ROLE_NAMES = {"math": "math expert", "lang": "language expert", "merged": "merged model", "base": "base model"}


@dataclass
class Answer:
    role: str
    prompt: str
    scored: mgsm.Scored
    gold: int | None
    engine: str
    seconds: float

    @property
    def model(self) -> str:
        return ROLE_NAMES[self.role]


class Workbench:
    def __init__(self, device: str = "cpu", batch_size: int = 8):
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.checkpoints: dict[str, Checkpoint] = {}
        self.engines: dict[str, TransformersEngine] = {}
        self.report: CompatReport | None = None
        self.plan: Plan | None = None
        self.layer_weights: list[float] | None = None
        self._analysis: Analysis | None = None

    # ---- loading ----------------------------------------------------------------------
    def load(self, math: str, lang: str, base: str | None = None, progress: Progress | None = None) -> CompatReport:
        """Open and check the checkpoints (headers only), then load both experts for generation.

        Returns the compatibility report; raises UserError (with the report's first problem) if
        the models cannot be merged, before any weights are read.
        """
        p = progress or (lambda f, d: None)
        p(0.0, "reading checkpoint headers")
        cks = {"math": Checkpoint.open(math), "lang": Checkpoint.open(lang)}
        if base:
            cks["base"] = Checkpoint.open(base)
        report = check_compatible(cks["math"], cks["lang"], cks.get("base"))
        if not report.ok:
            self.report = report
            raise UserError(report.summary().replace("\n", " | "))
        self.close()
        self.checkpoints, self.report = cks, report
        tok = load_tokenizer(cks["math"].path)
        for i, role in enumerate(("math", "lang")):
            p(0.1 + 0.4 * i, f"loading the {ROLE_NAMES[role]}")
            from .engines import load_model

            self.engines[role] = TransformersEngine(load_model(cks[role].path, self.device), tok,
                                                    batch_size=self.batch_size)
        p(1.0, "loaded")
        return report

    def close(self) -> None:
        self.engines.clear()
        self.checkpoints.clear()
        self.plan = self.layer_weights = None
        self._analysis = None

    def _need(self, *roles: str) -> None:
        for r in roles:
            if r in ("math", "lang") and r not in self.engines:
                raise UserError("Load the two experts first.")
            if r == "merged" and "merged" not in self.engines:
                raise UserError("Build the merge first.")
            if r == "base" and "base" not in self.checkpoints:
                raise UserError("This needs a base model: give the base the experts were fine-tuned from.")

    @property
    def num_layers(self) -> int:
        self._need("math")
        return self.checkpoints["math"].num_layers

    # ---- merging ----------------------------------------------------------------------
    def build(self, plan: Plan, progress: Progress | None = None) -> list[float]:
        """Merge in memory with `plan` and (re)point the merged engine at the result."""
        self._need("math", "lang")
        p = progress or (lambda f, d: None)
        L = self.num_layers
        lw = plan.layer_weights(L)  # validates
        p(0.1, "merging")
        math_sd, lang_sd = self.engines["math"].state_dict(), self.engines["lang"].state_dict()
        weights = weights_for_names(list(math_sd), L, plan)
        merged = merge_state_dicts(math_sd, lang_sd, weights)
        p(0.7, "refreshing the merged model")
        if "merged" in self.engines:
            self.engines["merged"].load_state_dict(merged)
        else:
            m = self.engines["math"].model
            model = model_from_state_dict(m.config, merged, m.generation_config)
            self.engines["merged"] = TransformersEngine(model, self.engines["math"].tokenizer, batch_size=self.batch_size)
        self.plan, self.layer_weights = plan, lw
        p(1.0, "built")
        return lw

    def export(self, out: str | Path, *, overwrite: bool = False, progress: Progress | None = None,
               shard_bytes: int | None = None) -> MergeSummary:
        """Write the current plan's merge to an HF folder (streamed from the checkpoints on disk)."""
        self._need("math", "lang")
        if self.plan is None:
            raise UserError("Build the merge first, then export it.")
        kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
        return export_merge(self.checkpoints["math"], self.checkpoints["lang"], self.plan, out,
                            base=self.checkpoints.get("base"), device=self.device, overwrite=overwrite,
                            progress=progress, **kw)

    # ---- analysis ---------------------------------------------------------------------
    @property
    def analysis_device(self) -> str:
        return self.device if str(self.device).startswith("cuda") else "cpu"

    def analysis(self, k: float | None = None, progress: Progress | None = None) -> Analysis:
        """Both experts against the base (streamed once, cached on disk and here); `k` adds a top-k%."""
        self._need("base")
        an = self._analysis
        if an is None or (k is not None and not any(abs(x - float(k)) < 1e-9 for x in an.ks)):
            ks = set(an.ks if an is not None else [1.0]) | ({float(k)} if k is not None else set())
            cks = self.checkpoints
            an = analyze(cks["base"], cks["math"], cks["lang"], ks=sorted(ks), device=self.analysis_device,
                         progress=progress)
            self._analysis = an
        return an

    def merged_stats(self, plan: Plan, progress: Progress | None = None) -> MergedStats:
        """The layer-swapped model of `plan` against base and experts (only blended tensors are read)."""
        cks = self.checkpoints
        return self.analysis().merged(plan, cks["math"], cks["lang"], cks["base"], device=self.analysis_device,
                                      progress=progress)

    def diff(self, role: str, progress: Progress | None = None) -> DiffResult:
        """Relative change of the math or language expert against the base (from the analysis)."""
        if role not in ("math", "lang"):
            raise UserError(f"diff compares an expert with the base: role must be math or lang, not {role!r}.")
        return diff_result(self.analysis(progress=progress), role)

    # ---- answering --------------------------------------------------------------------
    def ask(self, prompt: str, lang: mgsm.Language, gold: int | None = None,
            roles: tuple[str, ...] = ROLES, max_new_tokens: int = mgsm.MAX_NEW_TOKENS,
            progress: Progress | None = None) -> list[Answer]:
        """The same prompt to each model; outputs scored with MGSM's strict and flexible rules."""
        self._need(*roles)
        answers = []
        for i, role in enumerate(roles):
            if progress:
                progress(i / len(roles), f"asking the {ROLE_NAMES[role]}")
            eng = self.engines[role]
            t = time.perf_counter()
            out = eng.generate([prompt], max_new_tokens=max_new_tokens, stop=lang.stop)[0]
            answers.append(Answer(role, prompt, mgsm.score(out, gold, lang), gold, eng.name, time.perf_counter() - t))
        return answers

    def ask_question(self, question: str, lang_code: str = "en", *, source=None, shots: int = 0,
                     mode: str = "native_cot", gold: int | None = None, **kw) -> list[Answer]:
        """A free-text question in MGSM's prompt format for `lang_code`."""
        lang = mgsm.get_language(lang_code, source)
        ex = mgsm.load_exemplars(lang_code, source) if shots else None
        prompt = mgsm.build_prompt(question.strip(), lang, mode=mode, exemplars=ex, shots=shots)
        return self.ask(prompt, lang, gold, **kw)

    def ask_mgsm(self, lang_code: str, index: int, *, source=None, shots: int = 0, mode: str = "native_cot",
                 **kw) -> list[Answer]:
        """MGSM question `index` of `lang_code`, with its gold answer."""
        items = mgsm.load(lang_code, source)
        if not 0 <= index < len(items):
            raise UserError(f"MGSM {lang_code} has questions 0..{len(items) - 1}; {index} is out of range.")
        item = items[index]
        return self.ask_question(item.question, lang_code, source=source, shots=shots, mode=mode, gold=item.answer, **kw)
