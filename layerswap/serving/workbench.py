"""The interactive session behind the app and `layerswap ask`: two experts, their merge, answers.

    wb = Workbench(device="cpu")
    report = wb.load("math/", "lang/", base="base/")
    wb.build(Recipe(plan=Plan(b=2, u=1, tb=1, tu=0)))
    for a in wb.ask_mgsm("sw", 3, source="mgsm/"): print(a.model, a.scored.flexible, a.correct)

The experts are loaded once. A build merges in memory: layers with weight 0 or 1 share the
experts' tensors, only blended layers take new memory, and the merged engine's weights are
swapped in place, so re-merging with another plan is cheap.

How the three models answer is decided once, before anything loads, by the one engine decision
(`engines.choice.choose_engines`, which makes the engine plan of `engines.planning`: three, two or one vLLM engines,
or transformers, sized on the hardware of `layerswap.core.hardware`), and served by
the one object built from it (`serving.answering.Answering`): `check` reads headers only (seconds at any size)
and makes `engine_plan`; `start` starts what it says; `build` loads the merge into those engines; `engine_note`
is derived from the engines running. The analysis, export and card need no engine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from layerswap.evaluation import mgsm
from layerswap.models.adapters import open_expert
from layerswap.analysis import Analysis, MergedStats, analyze, analyze_family
from layerswap.models.checkpoints import Checkpoint, CompatReport
from layerswap.models.pairing import Pairing, check_mergeable
from layerswap.serving import switching
from layerswap.serving.answering import Answering, Merges, Trio
from layerswap.engines import EngineSettings, Releasing, VLLMSettings, resolve_engine_choice
from layerswap.engines import choice  # `choice.choose_engines`: the one engine decision
from layerswap.engines.planning import EnginePlan
from layerswap.core.errors import UserError
from layerswap.merge.merging import (MergeSummary, adapter_pair, export_adapter_merge, export_merge,
                                     exports_as_adapter, merge_in_memory, merge_stream, merged_adapter)
from layerswap.merge.family_export import export_family
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe, as_recipe
from layerswap.core.roles import ANSWERING, EXPERTS, ROLE_NAMES
from layerswap.core.runtime import Progress, no_progress, resolve_device

MERGES = Merges(merge_in_memory, merge_stream, export_merge, merged_adapter)  # what the answering engines merge with


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
    def __init__(self, device: str = "cpu", batch_size: int = 8, *, engine: str | None = None,
                 serving: str = "auto", vllm: VLLMSettings | None = None, chat_template: bool | None = None):
        """`engine`: auto (vLLM when installed, else transformers), vllm or transformers; None reads
        ``$LAYERSWAP_ENGINE``. `serving` (vLLM only): auto, three, two (engines) or one (swapped weights)."""
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.engine_choice = resolve_engine_choice(engine)
        self.serving = serving
        self.vllm_settings = vllm or VLLMSettings()
        self.chat_template = chat_template  # True: the chat template (bounded); None or False: plain prompts
        self.settings = EngineSettings(engine, self.device, serving, batch_size, chat_template,  # what it asks with
                                       self.vllm_settings.max_model_len, self.vllm_settings.tensor_parallel_size)
        self.checkpoints: dict[str, Checkpoint] = {}
        self.answering_engines: Answering | None = None  # started by `start`, from `engine_plan`
        self.report: CompatReport | None = None
        self.pairing: Pairing | None = None
        self.layer_weights: list[float] | None = None
        self._analysis: Analysis | None = None
        self.engine_plan: EnginePlan | None = None  # made by `check`: what answering needs, whether it fits

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "Workbench":
        """The one way the CLI (`ask`, `eval`), the app, `search` and sweeps make a workbench: from their engine
        settings; `check` asks the one engine decision (`engines.choice.choose_engines`) with them."""
        s = settings
        return cls(device=s.device, batch_size=s.batch_size, engine=s.engine, serving=s.serving, vllm=s.vllm(),
                   chat_template=s.chat_template)

    # ---- loading ----------------------------------------------------------------------
    def load(self, math: str, lang: str, base: str | None = None, progress: Progress | None = None,
             force: bool = False) -> CompatReport:
        """Open and check the checkpoints (`check`), then load both experts for generation (`start`)."""
        report = self.check(math, lang, base, force=force, progress=progress)
        self.start(progress)
        return report

    def check(self, math: str, lang: str, base: str | None = None, *, force: bool = False,
              progress: Progress | None = None, releasing: Releasing = Releasing(),
              plan: EnginePlan | None = None) -> CompatReport:
        """Open the checkpoints and check them; nothing is loaded and the models held so far stay (`releasing`: the
        engines the caller releases before starting these, which the engine plan counts as freed).

        Checks headers (architecture, layers, names, shapes, dtypes), sampled distances from the
        base and, for the transformers engine, that both experts fit in memory; raises UserError
        if they cannot be merged (the distance check is waived with `force`). PEFT adapters are
        merged into their base first (the base given here, or the adapter's own). `plan`: the engine plan already
        asked for these models (a family's trio, `engines.choice.choose_family`) instead of asking again.
        """
        p = progress or no_progress
        p(0.0, "reading checkpoint headers")
        cks = {"math": open_expert(math, base or None), "lang": open_expert(lang, base or None)}
        if base:
            cks["base"] = Checkpoint.open(base)
        adapter_pair(cks["math"], cks["lang"])  # a prefix expert only beside another
        check = check_mergeable(cks["math"], cks["lang"], cks.get("base"), force=force)
        self.report = report = check.report
        check.raise_if_bad()
        pairing = check.pairing
        plan = plan or choice.choose_engines(self.settings, cks, vllm=self.vllm_settings, releasing=releasing).plan
        self.close()
        self.checkpoints, self.report, self.pairing, self.engine_plan = cks, report, pairing, plan
        return report

    @property
    def answering(self) -> bool:
        """Are the experts loaded into engines (answers possible)?"""
        return self.answering_engines is not None and self.answering_engines.answering

    @property
    def engines(self) -> dict:
        """The engines answering now, by role (``math``, ``lang``, and ``merged`` once built)."""
        return self.answering_engines.engines if self.answering_engines is not None else {}

    @property
    def recipe(self) -> Recipe | None:
        """The recipe the merged model holds."""
        return self.answering_engines.recipe if self.answering_engines is not None else None

    def holds(self, recipe: Recipe | Plan) -> bool:
        """Does the merged model hold `recipe` (built and answering)? The one answer: the page, the lens and the
        search ask it before they build or read the merged model."""
        held = self.recipe
        return held is not None and "merged" in self.engines and held.to_dict() == as_recipe(recipe).to_dict()

    def ensure_built(self, recipe: Recipe | Plan, progress: Progress | None = None) -> bool:
        """Build `recipe` unless the merged model holds it already; True when a build ran."""
        if self.holds(recipe):
            return False
        self.build(recipe, progress)
        return True

    @property
    def engine_note(self) -> str:
        """Which engines answer now, derived from the running engines (`Answering.now`)."""
        return self.answering_engines.now() if self.answering_engines is not None else ""

    def start(self, progress: Progress | None = None, *, lock=None, ready=None) -> None:
        """Start the engines `engine_plan` says (`serving.answering.Answering.start`: the transformers-first
        hand-over, under `lock`, with `ready` called once answers are possible); refused, with the plan's
        numbers, when they do not fit."""
        if self.engine_plan is None:
            raise UserError("Load the two experts first.")
        if self.answering_engines is None:
            self.answering_engines = Answering(
                self.engine_plan, Trio(self.checkpoints, bool(self.pairing and self.pairing.suspicious), self.device,
                                       self.batch_size, self.chat_template, merges=MERGES),
                fallback=self.engine_choice == "auto")
        self.answering_engines.start(progress or no_progress, lock=lock, ready=ready)
        (progress or no_progress)(1.0, "loaded")

    def switch_lang(self, lang: str, *, keep: bool = False, force: bool = False,
                    progress: Progress | None = None) -> CompatReport:
        """A family's language switch: another language expert, checked against the math expert and the base as
        `check` checks it, loaded into the running engines in place of the current one (`switching.switch_lang`);
        the math expert and its engine stay. `keep`: the previous expert stays in memory (``resident``)."""
        self._need(*EXPERTS)
        cks, old = self.checkpoints, self.checkpoints["lang"]
        ck = open_expert(lang, str(cks["base"].path) if "base" in cks else None)
        try:
            adapter_pair(cks["math"], ck)
            check = check_mergeable(cks["math"], ck, cks.get("base"), force=force)
            check.raise_if_bad()
            switching.switch_lang(self.answering_engines, ck, progress or no_progress, keep)
        except BaseException:
            ck.close()
            raise
        cks["lang"] = ck  # (the trio's checkpoints are these)
        old.close()
        self.report, self.pairing, self.layer_weights, self._analysis = check.report, check.pairing, None, None
        return check.report

    def switch_problem(self, lang: str) -> str:
        """Why the running engines cannot take `lang` by `switch_lang` ('' when they can, or when none runs yet:
        `switching.switch_problem`); a runner that gets a reason loads the experts again instead."""
        if not self.answering or not switching.can_refuse(self.answering_engines.current):
            return ""  # nothing to open: these engines take any expert of the math expert's shape
        ck = open_expert(lang, str(self.checkpoints["base"].path) if "base" in self.checkpoints else None)
        try:
            return switching.switch_problem(self.answering_engines.current, ck)
        finally:
            ck.close()

    def drop_scratch(self) -> None:
        """Remove the scratch merge from disk now (on exit: even while a job still holds the models)."""
        if self.answering_engines is not None:
            self.answering_engines.drop_scratch()

    def close(self) -> None:
        """Release engines, scratch merges and open checkpoint files (when the models are replaced)."""
        if self.answering_engines is not None:
            self.answering_engines.release()
            self.answering_engines = None
        for ck in self.checkpoints.values():
            ck.close()
        self.checkpoints.clear()
        self.layer_weights = self.pairing = None
        self._analysis = None

    def _need(self, *roles: str) -> None:
        for r in roles:
            if r in EXPERTS and r not in self.engines:
                raise UserError("Load the two experts first.")
            if r == "merged" and "merged" not in self.engines:
                raise UserError("Build the merge first.")
            if r == "base" and "base" not in self.checkpoints:
                raise UserError("This needs a base model: give the base the experts were fine-tuned from.")

    @property
    def num_layers(self) -> int:
        if "math" not in self.checkpoints:
            raise UserError("Load the two experts first.")
        return self.checkpoints["math"].num_layers

    # ---- merging ----------------------------------------------------------------------
    def build(self, recipe: Recipe | Plan, progress: Progress | None = None) -> list[float] | None:
        """Merge in memory and (re)point the merged engine at the result.

        Layer swapping uses the recipe's plan (a bare `Plan` means layer swapping); tensors taken
        whole from an expert (or the base) are shared with it, so only blended layers take memory.
        Returns the per-layer weights (None for methods without a plan).
        """
        self._need(*EXPERTS)
        p = progress or no_progress
        recipe = as_recipe(recipe)
        L = self.num_layers
        lw = recipe.layer_weights(L)  # validates
        recipe.require_base("base" in self.checkpoints, "load the base model the experts were fine-tuned from")
        self.answering_engines.load_merged(recipe, p)
        self.layer_weights = lw
        p(1.0, "built")
        return lw

    def export(self, out: str | Path, *, recipe: Recipe | None = None, overwrite: bool = False,
               progress: Progress | None = None, shard_bytes: int | None = None, protect: tuple = (),
               languages: list[str] | None = None, adapter: bool = False) -> MergeSummary | Path:
        """Write a merge (`recipe`, default: the built one) to an HF folder, streamed from disk; the
        output may not touch the inputs nor the folders in `protect` (`layerswap.merge.outputs`);
        `languages` (ISO codes) go into the model card's front matter. With `adapter` (two PEFT adapters of one
        kind as experts) the swap is written as a PEFT adapter folder instead (`merging.export_adapter_merge`)."""
        self.num_layers  # the checkpoints (no engine needed: the export streams from disk)
        recipe = recipe or self.recipe
        if recipe is None:
            raise UserError("Build the merge first, then export it.")
        if exports_as_adapter(self.checkpoints["math"], self.checkpoints["lang"], adapter):
            return export_adapter_merge(self.checkpoints["math"], self.checkpoints["lang"], recipe, out,
                                        base=self.checkpoints.get("base"), overwrite=overwrite, protect=protect,
                                        force=bool(self.pairing and self.pairing.suspicious), languages=languages)
        kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
        return export_merge(self.checkpoints["math"], self.checkpoints["lang"], recipe, out,
                            base=self.checkpoints.get("base"), device=self.device,
                            overwrite=overwrite, force=bool(self.pairing and self.pairing.suspicious),
                            languages=languages, progress=progress, protect=protect, **kw)

    def export_family(self, out: str | Path, langs: dict[str, Checkpoint], *,
                      plans: Recipe | Plan | dict[str, Recipe | Plan] | None = None, overwrite: bool = False,
                      progress: Progress | None = None, protect: tuple = (), adapter: bool = False) -> dict:
        """One merge per language expert of `langs` (code -> checkpoint) with this session's math expert and
        base, written to ``out/<code>/`` (`family_export.export_family`); `plans`: one for all or one per code
        (default: the built recipe)."""
        self.num_layers  # the checkpoints
        plans = plans if plans is not None else self.recipe
        if plans is None:
            raise UserError("Build the merge first (or give the plans), then export the family.")
        return export_family(self.checkpoints["math"], langs, plans, out, base=self.checkpoints.get("base"),
                             device=self.device, overwrite=overwrite, protect=protect, adapter=adapter,
                             force=bool(self.pairing and self.pairing.suspicious), progress=progress)

    # ---- analysis ---------------------------------------------------------------------
    @property
    def analysis_device(self) -> str:
        """Where the analysis runs: the CPU, or the GPU when the engine plan leaves it the headroom."""
        if not str(self.device).startswith("cuda"):
            return "cpu"
        return self.device if self.engine_plan is None or self.engine_plan.analysis_device != "cpu" else "cpu"

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

    def family_analysis(self, langs: dict[str, Checkpoint], k: float | None = None,
                        progress: Progress | None = None) -> dict[str, Analysis]:
        """Each language expert of `langs` (code -> checkpoint) against this session's math expert and base,
        base and math read once for all (`analyze_family`; each pair cached as `analysis` caches it)."""
        self._need("base")
        ks = sorted({1.0} | ({float(k)} if k is not None else set()))
        return analyze_family(self.checkpoints["base"], self.checkpoints["math"], langs, ks=ks,
                              device=self.analysis_device, progress=progress)

    def merged_stats(self, plan: Plan, progress: Progress | None = None) -> MergedStats:
        """The layer-swapped model of `plan` against base and experts (only blended tensors are read)."""
        cks = self.checkpoints
        return self.analysis().merged(plan, cks["math"], cks["lang"], cks["base"], device=self.analysis_device,
                                      progress=progress)

    # ---- answering --------------------------------------------------------------------
    def ask(self, prompt: str, lang: mgsm.Language, gold: int | None = None,
            roles: tuple[str, ...] = ANSWERING, max_new_tokens: int = mgsm.MAX_NEW_TOKENS,
            progress: Progress | None = None, mode: str = mgsm.TASK.mode) -> list[Answer]:
        """The same prompt to each model; outputs scored with MGSM's strict and flexible rules (of `mode`)."""
        self._need(*roles)
        answers = []
        for i, role in enumerate(roles):
            if progress:
                progress(i / len(roles), f"asking the {ROLE_NAMES[role]}")
            eng = self.engines[role]
            t = time.perf_counter()
            out = eng.generate([prompt], max_new_tokens=max_new_tokens, stop=lang.stop)[0]
            answers.append(Answer(role, prompt, mgsm.score(out, gold, lang, mode), gold, eng.name,
                                  time.perf_counter() - t))
        return answers

    def ask_question(self, question: str, lang_code: str = "en", *, source=None, shots: int = mgsm.TASK.shots,
                     mode: str = mgsm.TASK.mode, gold: int | None = None, **kw) -> list[Answer]:
        """A free-text question in MGSM's prompt format for `lang_code` (`mgsm.prompt_for`), scored against
        `gold` when given."""
        p = mgsm.prompt_for(lang_code, question=question, source=source, shots=shots, mode=mode)
        return self.ask(p.prompt, p.language, gold, mode=p.mode, **kw)

    def ask_mgsm(self, lang_code: str, index: int, *, source=None, shots: int = mgsm.TASK.shots,
                 mode: str = mgsm.TASK.mode, **kw) -> list[Answer]:
        """MGSM question `index` of `lang_code`, prompted as the evaluation prompts it, with its gold answer
        (`mgsm.prompt_for`)."""
        p = mgsm.prompt_for(lang_code, index=index, source=source, shots=shots, mode=mode)
        return self.ask(p.prompt, p.language, p.gold, mode=p.mode, **kw)

    # ---- evaluation -------------------------------------------------------------------
    def evaluate(self, config, roles: tuple[str, ...] = ANSWERING, progress: Progress | None = None,
                 cancel: threading.Event | None = None):
        """MGSM evaluation (`layerswap.evaluation.run`) of the chosen models on the same prompts."""
        from layerswap.evaluation.run import evaluate

        self._need(*roles)
        return evaluate({ROLE_NAMES[r]: self.engines[r] for r in roles}, config, progress=progress, cancel=cancel)
