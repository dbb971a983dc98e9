"""The interactive session behind the app and `layerswap ask`: two experts, their merge, answers.

    wb = Workbench(device="cpu")
    report = wb.load("math/", "lang/", base="base/")
    wb.build(Recipe(plan=Plan(b=2, u=1, tb=1, tu=0)))
    for a in wb.ask_mgsm("sw", 3, source="mgsm/"): print(a.model, a.scored.flexible, a.correct)

The experts are loaded once. A build merges in memory: layers with weight 0 or 1 share the
experts' tensors, only blended layers take new memory, and the merged engine's weights are
swapped in place, so re-merging with another plan is cheap.

With vLLM (``engine="auto"`` when it is installed, or ``"vllm"``) the experts are served by vLLM
engines sized from the available memory (`layerswap.engines.serving`): three engines side by side, or
one engine whose weights are swapped per model when three do not fit. A build then streams the
merge to a scratch folder and reloads the merged engine's weights in place (no new engine).
`engine_note` says which engine answers, and why when vLLM was not used.

`check` reads headers only (seconds at any size) and makes `engine_plan` (`engines.planning`): what
answering needs and whether it fits. The analysis, export and card need no engine; `start` loads the
engines when answers are wanted. `start(engine="transformers")` then `prepare_vllm`/`switch` answer at
once with transformers while vLLM starts, then move to vLLM.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import mgsm
from .adapters import open_expert
from .analysis import Analysis, MergedStats, analyze
from .checkpoints import Checkpoint, CompatReport
from .pairing import Pairing, check_mergeable
from .engines import (EngineSettings, EngineStartError, SwappedEngine, TransformersEngine, VLLMEngine, VLLMSettings,
                      check_memory, load_model, load_tokenizer, model_from_state_dict, plan_serving,
                      resolve_engine_choice, try_vllm, vllm_device)
from .engines.planning import EnginePlan, plan_engines
from .errors import UserError
from .merging import MergeSummary, export_merge, merge_in_memory
from .plans import Plan
from .recipes import Recipe, as_recipe
from .roles import ANSWERING, EXPERTS, ROLE_NAMES
from .runtime import Progress, no_progress, resolve_device
from .sources import Sources


@dataclass
class Served:
    """vLLM engines started for the experts (`Workbench.prepare_vllm`), not yet answering."""

    plan: object  # engines.ServingPlan
    engines: dict = field(default_factory=dict)
    vllm: list = field(default_factory=list)
    note: str = ""


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
        ``$LAYERSWAP_ENGINE``. `serving` (vLLM only): auto, three (engines) or one (swapped weights)."""
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.engine_choice = resolve_engine_choice(engine)
        self.serving = serving
        self.vllm_settings = vllm or VLLMSettings()
        self.engine_note = ""
        self.chat_template = chat_template  # None: the tokenizer's template when it has one
        self.serving_mode = "transformers"
        self._vllm: list[VLLMEngine] = []
        self._merge_dir: Path | None = None
        self.checkpoints: dict[str, Checkpoint] = {}
        self.engines: dict = {}
        self.report: CompatReport | None = None
        self.pairing: Pairing | None = None
        self.recipe: Recipe | None = None  # the built merge's recipe
        self.layer_weights: list[float] | None = None
        self._analysis: Analysis | None = None
        self.engine_plan: EnginePlan | None = None  # made by `check`: what answering needs, whether it fits

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "Workbench":
        """The one way the CLI, the app and sweeps make a workbench: from their engine settings."""
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
              progress: Progress | None = None) -> CompatReport:
        """Open the checkpoints and check them; nothing is loaded and the models held so far stay.

        Checks headers (architecture, layers, names, shapes, dtypes), sampled distances from the
        base and, for the transformers engine, that both experts fit in memory; raises UserError
        if they cannot be merged (the distance check is waived with `force`). PEFT adapters are
        merged into their base first (the base given here, or the adapter's own).
        """
        p = progress or no_progress
        p(0.0, "reading checkpoint headers")
        cks = {"math": open_expert(math, base or None), "lang": open_expert(lang, base or None)}
        if base:
            cks["base"] = Checkpoint.open(base)
        check = check_mergeable(cks["math"], cks["lang"], cks.get("base"), force=force)
        self.report = report = check.report
        check.raise_if_bad()
        pairing = check.pairing
        from .scratch import root

        plan = plan_engines(cks, engine=self.engine_choice, serving=self.serving, settings=self.vllm_settings,
                            device=self.device, scratch_dir=root())
        self.close()
        self.checkpoints, self.report, self.pairing, self.engine_plan = cks, report, pairing, plan
        return report

    @property
    def answering(self) -> bool:
        """Are the experts loaded into engines (answers possible)?"""
        return all(r in self.engines for r in EXPERTS)

    def start(self, progress: Progress | None = None, engine: str | None = None) -> None:
        """Load the checked experts into engines as `engine_plan` says (vLLM when chosen and it fits, else
        transformers); `engine="transformers"` loads transformers whatever the plan. Refused, with the plan's
        numbers, when they do not fit."""
        p = progress or no_progress
        plan = self.engine_plan
        if plan is not None and not plan.fits:
            raise UserError(plan.describe().replace("**", ""))
        cks = self.checkpoints
        tok = load_tokenizer(cks["math"].path)
        served = self._start_vllm(tok, p) if engine != "transformers" and (plan is None or plan.engine == "vllm") \
            else None
        if served is not None:
            self.switch(served)
            p(1.0, "loaded")
            return
        self.serving_mode = "transformers"
        if plan is not None and plan.engine == "transformers":
            self.engine_note = f"transformers engine ({plan.why})"
        check_memory(sum(cks[r].nbytes for r in EXPERTS), self.device, "the two experts")
        for i, role in enumerate(EXPERTS):
            p(0.1 + 0.4 * i, f"loading the {ROLE_NAMES[role]}")
            self.engines[role] = TransformersEngine(load_model(cks[role].path, self.device), tok,
                                                    batch_size=self.batch_size, use_chat_template=self.chat_template)
        if engine == "transformers":
            self.engine_note = "transformers engine (answering while vLLM starts)"
        p(1.0, "loaded")

    def prepare_vllm(self, progress: Progress | None = None) -> "Served | None":
        """vLLM engines for the experts, started beside the engines answering now (nothing is switched yet);
        None, with `engine_note` saying why, when vLLM cannot serve them. Hand the result to `switch`."""
        return self._start_vllm(load_tokenizer(self.checkpoints["math"].path), progress or no_progress)

    def switch(self, served: "Served") -> None:
        """Answer with vLLM engines from `prepare_vllm` (the caller holds the lane); the transformers engines
        go, and the merge is rebuilt in the new engines by the next build."""
        self.engines = dict(served.engines)
        self._vllm = list(served.vllm)
        self.engine_note, self.serving_mode, self._serving_plan = served.note, served.plan.mode, served.plan
        self.recipe = self.layer_weights = None

    def _start_vllm(self, tok, p: Progress) -> "Served | None":
        """vLLM engines for the experts if chosen/available (`engines.try_vllm`), not yet in use; None (with
        `engine_note` saying why) means use transformers."""
        served, why = try_vllm(self.engine_choice, lambda: self._serve_vllm(tok, p))
        if served is None:
            self.engine_note = "transformers engine (chosen)" if why == "chosen" else f"transformers engine: {why}"
            return None
        served.note = f"vLLM: {served.plan.note} ({why})"
        return served

    def _serve_vllm(self, tok, p: Progress) -> "Served":
        """The experts in vLLM engines: three, or one whose weights are swapped (`engines.plan_serving`)."""
        math_ck = self.checkpoints["math"]
        reusable = VLLMEngine.idle_for(math_ck.path)  # stops idle engines of another shape
        plan = plan_serving(math_ck, self.serving, self.vllm_settings, vllm_device(), running=reusable)
        p(0.1, f"starting vLLM: {plan.note} (the first start takes about a minute)")
        served = Served(plan)
        try:
            if plan.mode == "three":
                for role in EXPERTS:
                    eng = VLLMEngine.acquire(self.checkpoints[role].path, plan.settings, tokenizer=tok,
                                              use_chat_template=self.chat_template)
                    served.vllm.append(eng)
                    served.engines[role] = eng
            else:
                shared = VLLMEngine.acquire(math_ck.path, plan.settings, tokenizer=tok,
                                            use_chat_template=self.chat_template)
                served.vllm.append(shared)
                for role in EXPERTS:
                    served.engines[role] = SwappedEngine(shared, self.checkpoints[role].path)
        except EngineStartError:
            for e in served.vllm:
                e.release()
            raise
        return served

    def _release_vllm(self) -> None:
        for e in self._vllm:
            e.release()
        self._vllm.clear()
        if self._merge_dir is not None:
            shutil.rmtree(self._merge_dir.parent, ignore_errors=True)
            self._merge_dir = None

    def _build_vllm(self, recipe: Recipe, p: Progress) -> None:
        """Stream the merge to a scratch folder (its disk checked first) and load it into the serving engine."""
        from . import scratch

        if self._merge_dir is None:
            d = scratch.make("serving")
            try:
                scratch.check_disk(self.checkpoints["math"].nbytes, d, "the merged model for vLLM")
            except UserError:
                shutil.rmtree(d, ignore_errors=True)
                raise
            self._merge_dir = d / "merged"
        p(0.2, "writing the merged weights for vLLM")
        export_merge(self.checkpoints["math"], self.checkpoints["lang"], recipe, self._merge_dir,
                     base=self.checkpoints.get("base"), device=self.device, overwrite=True,
                     force=bool(self.pairing and self.pairing.suspicious), card=False)
        p(0.7, "loading them into the engine")
        if self.serving_mode == "one":
            self.engines["merged"] = SwappedEngine(self._vllm[0], self._merge_dir)
        elif "merged" in self.engines:
            self.engines["merged"].refresh(self._merge_dir)
        else:
            eng = VLLMEngine.acquire(self._merge_dir, self._serving_plan.settings, tokenizer=self._vllm[0].tokenizer,
                                     use_chat_template=self.chat_template)
            self._vllm.append(eng)
            self.engines["merged"] = eng

    def drop_scratch(self) -> None:
        """Remove the scratch merge from disk now (on exit: even while a job still holds the models)."""
        if self._merge_dir is not None:
            shutil.rmtree(self._merge_dir.parent, ignore_errors=True)

    def close(self) -> None:
        """Release engines, scratch merges and open checkpoint files (when the models are replaced)."""
        self._release_vllm()
        self.engines.clear()
        for ck in self.checkpoints.values():
            ck.close()
        self.checkpoints.clear()
        self.recipe = self.layer_weights = self.pairing = None
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
        if recipe.needs_base and "base" not in self.checkpoints:
            raise UserError(f"{recipe.base_reason()}: load the base model the experts were fine-tuned from.")
        if self._vllm:
            self._build_vllm(recipe, p)
            self.recipe, self.layer_weights = recipe, lw
            p(1.0, "built")
            return lw
        ck = self.checkpoints["math"]
        sources = Sources(recipe, L, ck.arch).of(ck.tensors)
        new = sum(t.nbytes for n, t in ck.tensors.items()  # copies of an expert share its tensors
                  if sources[n].kind != "copy" or sources[n].from_base)
        check_memory(new, self.device, f"the merged model ({recipe.method.spec.title})")
        p(0.1, "merging")
        math_sd, lang_sd = self.engines["math"].state_dict(), self.engines["lang"].state_dict()
        base = self.checkpoints.get("base")
        merged = merge_in_memory(math_sd, lang_sd, L, recipe,
                                 base=(lambda n: base.get(n)) if base is not None else None,
                                 progress=lambda f, d: p(0.1 + 0.6 * f, d), arch=ck.arch)
        p(0.7, "refreshing the merged model")
        if "merged" in self.engines:
            self.engines["merged"].load_state_dict(merged)
        else:
            m = self.engines["math"].model
            model = model_from_state_dict(m.config, merged, m.generation_config)
            self.engines["merged"] = TransformersEngine(model, self.engines["math"].tokenizer, batch_size=self.batch_size,
                                                        use_chat_template=self.chat_template)
        self.recipe, self.layer_weights = recipe, lw
        p(1.0, "built")
        return lw

    def export(self, out: str | Path, *, recipe: Recipe | None = None, overwrite: bool = False,
               progress: Progress | None = None, shard_bytes: int | None = None, protect: tuple = (),
               languages: list[str] | None = None) -> MergeSummary:
        """Write a merge (`recipe`, default: the built one) to an HF folder, streamed from disk; the
        output may not touch the inputs nor the folders in `protect` (`layerswap.outputs`);
        `languages` (ISO codes) go into the model card's front matter."""
        self.num_layers  # the checkpoints (no engine needed: the export streams from disk)
        recipe = recipe or self.recipe
        if recipe is None:
            raise UserError("Build the merge first, then export it.")
        kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
        return export_merge(self.checkpoints["math"], self.checkpoints["lang"], recipe, out,
                            base=self.checkpoints.get("base"), device=self.device,
                            overwrite=overwrite, force=bool(self.pairing and self.pairing.suspicious),
                            languages=languages, progress=progress, protect=protect, **kw)

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

    # ---- answering --------------------------------------------------------------------
    def ask(self, prompt: str, lang: mgsm.Language, gold: int | None = None,
            roles: tuple[str, ...] = ANSWERING, max_new_tokens: int = mgsm.MAX_NEW_TOKENS,
            progress: Progress | None = None, mode: str = "native_cot") -> list[Answer]:
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

    def ask_question(self, question: str, lang_code: str = "en", *, source=None, shots: int = 0,
                     mode: str = "native_cot", gold: int | None = None, **kw) -> list[Answer]:
        """A free-text question in MGSM's prompt format for `lang_code` (`mgsm.prompt_for`), scored against
        `gold` when given."""
        p = mgsm.prompt_for(lang_code, question=question, source=source, shots=shots, mode=mode)
        return self.ask(p.prompt, p.language, gold, mode=p.mode, **kw)

    def ask_mgsm(self, lang_code: str, index: int, *, source=None, shots: int = 0, mode: str = "native_cot",
                 **kw) -> list[Answer]:
        """MGSM question `index` of `lang_code`, prompted as the evaluation prompts it, with its gold answer
        (`mgsm.prompt_for`)."""
        p = mgsm.prompt_for(lang_code, index=index, source=source, shots=shots, mode=mode)
        return self.ask(p.prompt, p.language, p.gold, mode=p.mode, **kw)

    # ---- evaluation -------------------------------------------------------------------
    def evaluate(self, config, roles: tuple[str, ...] = ANSWERING, progress: Progress | None = None,
                 cancel: threading.Event | None = None):
        """MGSM evaluation (`layerswap.evaluation`) of the chosen models on the same prompts."""
        from .evaluation import evaluate

        self._need(*roles)
        return evaluate({ROLE_NAMES[r]: self.engines[r] for r in roles}, config, progress=progress, cancel=cancel)
