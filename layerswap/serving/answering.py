"""The engines that answer for one trio, started only from its `EnginePlan`: one object, arrangements by name.

    ans = Answering(plan, Trio(checkpoints, force=False, device="cpu", merges=workbench.MERGES))
    ans.start(progress, lock=lane, ready=callback)   # transformers first when the plan says so, then the plan's engines
    ans.load_merged(recipe, progress)                # the merge into the engines (in memory, or exported and reloaded:
                                                     # the plan's `refresh`)
    ans.engines["merged"].generate(...)
    ans.now()                                        # the engine line: derived from the engines running now
    ans.release()

`ARRANGEMENTS` registers each arrangement of `planning.ARRANGEMENTS` by name, each with `start`, `load_merged` and
`release`: the transformers pair, and three, two or one vLLM engines (`VLLMEngine`, pooled per process; the
swapped ones through `SwappedEngine`). The plan is binding: `Answering` starts the plan's arrangement and nothing
else; it refuses a plan that does not fit, or that was made for played hardware (`LAYERSWAP_HARDWARE`). The one
departure is a failure: when vLLM does not start and the engine choice allows it, the transformers pair answers,
and `now()` says why.

The merges themselves come from the caller (`Trio.merges`: the workbench passes `merging`'s functions), so that
`engines/` imports nothing above it.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ClassVar

from layerswap.models.adapters import prefix_of
from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.core.hardware import HELD
from layerswap.recipe.recipes import Recipe
from layerswap.core.roles import EXPERTS, ROLE_NAMES
from layerswap.core.runtime import Progress, no_progress
from layerswap.engines.base import load_tokenizer
from layerswap.engines.planning import TITLES, EnginePlan, Releasing
from layerswap.engines.sizing import GPU_ACTIVATIONS, check_memory
from layerswap.engines.transformers_engine import TransformersEngine, load_model, model_from_state_dict
from layerswap.engines.vllm_engine import (EngineStartError, LoRAEngine, SwappedEngine, TensorWeights, TurnEngine,
                                           Turns, VLLMEngine)


@dataclass(frozen=True)
class Merges:
    """The merges the arrangements load into engines (`merging`'s, passed down by the workbench)."""

    in_memory: Callable  # merging.merge_in_memory: from the experts' state dicts
    stream: Callable  # merging.merge_stream: tensor by tensor, for a live vLLM refresh
    export: Callable  # merging.export_merge: a folder vLLM loads
    adapter: Callable  # merging.merged_adapter: a swap on two adapters (a prefix, a LoRA)


@dataclass
class Trio:
    """What the engines are made from: the checkpoints (``math``, ``lang``, optional ``base``) and how merges run."""

    checkpoints: dict[str, Checkpoint]
    force: bool = False  # the shared-base check was waived
    device: str = "cpu"  # the transformers engine's and the merges'
    batch_size: int = 8
    chat_template: bool | None = None
    merges: Merges = field(kw_only=True)


class Arrangement:
    """One way of serving the three models; subclasses are registered in `ARRANGEMENTS` by `name`."""

    name: ClassVar[str]

    def __init__(self, plan: EnginePlan, trio: Trio):
        self.plan, self.trio = plan, trio
        self.engines: dict = {}

    def start(self, tok, progress: Progress) -> None:
        raise NotImplementedError

    def load_merged(self, recipe: Recipe, progress: Progress) -> None:
        raise NotImplementedError

    def release(self) -> None:
        self.engines.clear()

    def held_bytes(self) -> int:
        return 0

    def describe(self) -> str:
        return TITLES[self.name]


ARRANGEMENTS: dict[str, type[Arrangement]] = {}


def register(cls: type[Arrangement]) -> type[Arrangement]:
    ARRANGEMENTS[cls.name] = cls
    return cls


@register
class TransformersPair(Arrangement):
    """Both experts as transformers models on the trio's device; the merge is built in memory, sharing the
    experts' tensors where it copies them (only blended layers take new memory)."""

    name = "transformers"

    def start(self, tok, progress: Progress) -> None:
        cks = self.trio.checkpoints
        check_memory(sum(cks[r].nbytes for r in EXPERTS), self.trio.device, "the two experts")
        for i, role in enumerate(EXPERTS):
            progress(0.1 + 0.4 * i, f"loading the {ROLE_NAMES[role]}")
            self.engines[role] = TransformersEngine(load_model(cks[role], self.trio.device), tok,
                                                    batch_size=self.trio.batch_size,
                                                    use_chat_template=self.trio.chat_template,
                                                    prefix=prefix_of(cks[role]))
        HELD.hold(self, sum(cks[r].nbytes for r in EXPERTS))

    def load_merged(self, recipe: Recipe, progress: Progress) -> None:
        from layerswap.recipe.sources import Sources

        ck = self.trio.checkpoints["math"]
        L = ck.num_layers
        # prefix-tuning experts: the merged prefix, from the adapters (refused, with the reason, before merging)
        prefix = self.trio.merges.adapter(ck, self.trio.checkpoints["lang"], recipe, self.trio.checkpoints.get("base")).prefix \
            if ck.adapter_kind == "prefix" else None
        planner = Sources(recipe, L, ck.arch)  # made once: the memory check and the merge read it
        sources = planner.of(ck.tensors)
        new = sum(t.nbytes for n, t in ck.tensors.items()  # copies of an expert share its tensors
                  if sources[n].kind != "copy" or sources[n].from_base)
        check_memory(new, self.trio.device, f"the merged model ({recipe.method.spec.title})")
        progress(0.1, "merging")
        base = self.trio.checkpoints.get("base")
        merged = self.trio.merges.in_memory(self.engines["math"].state_dict(), self.engines["lang"].state_dict(), L, planner,
                                 base=(lambda n: base.get(n)) if base is not None else None,
                                 progress=lambda f, d: progress(0.1 + 0.6 * f, d), arch=ck.arch)
        progress(0.7, "refreshing the merged model")
        if "merged" in self.engines:
            self.engines["merged"].load_state_dict(merged)
            self.engines["merged"].set_prefix(prefix)
        else:
            m = self.engines["math"].model
            self.engines["merged"] = TransformersEngine(
                model_from_state_dict(m.config, merged, m.generation_config), self.engines["math"].tokenizer,
                batch_size=self.trio.batch_size, use_chat_template=self.trio.chat_template, prefix=prefix)

    def release(self) -> None:
        HELD.release(self)
        super().release()

    def held_bytes(self) -> int:
        return HELD.of(self)


class VLLMArrangement(Arrangement):
    """`plan.vllm_engines` vLLM engines sized by the plan; the merge goes into the engine that serves it (`roles`:
    which engine serves which model) as the plan's `refresh` says: streamed from the experts' files into the model
    (``memory``: nothing written), or exported to a scratch folder (its disk checked by the plan) and reloaded.
    With the plan's `sleep` (GPU), the models an engine would swap each get an engine of their own that takes
    turns (`Turns`): started one after another, each put to sleep before the next starts."""

    roles: ClassVar[tuple[tuple[str, ...], ...]]  # per engine, the models it serves (one: fixed; more: swapped)

    def __init__(self, plan: EnginePlan, trio: Trio):
        super().__init__(plan, trio)
        self.vllm: list[VLLMEngine] = []
        self.turns: dict[int, tuple[Turns, dict[str, VLLMEngine]]] = {}  # sleep mode: slot -> its turns, per model
        self.merge_dir: Path | None = None
        self.builds = 0  # merges loaded (names each in-memory merge)

    def start(self, tok, progress: Progress) -> None:
        cks = self.trio.checkpoints
        VLLMEngine.idle_for(cks["math"].path)  # idle engines of another shape go first (the plan counted them)
        progress(0.1, f"starting vLLM: {self.describe()} (the first start takes about a minute)")
        try:
            for slot, roles in enumerate(self.roles):
                if self.plan.sleep and len(roles) > 1:
                    self._start_turns(slot, roles, tok)
                    continue
                first = roles[0] if roles[0] != "merged" else "math"  # the merge does not exist yet
                eng = VLLMEngine.acquire(cks[first].path, self.plan.settings, tokenizer=tok,
                                         use_chat_template=self.trio.chat_template, held=self.plan.estimate.per_engine)
                self.vllm.append(eng)
                for role in roles:
                    if role in EXPERTS:
                        self.engines[role] = eng if len(roles) == 1 else SwappedEngine(eng, cks[role].path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every engine this arrangement started or took from the pool (a start that failed half-way): their
        memory is free before anything else is planned, instead of idle engines holding it in the pool."""
        for e in self.vllm:
            e.close()
        self.release()

    def _start_turns(self, slot: int, roles: tuple[str, ...], tok) -> None:
        """Sleep mode: an engine per model of the slot (the merge's starts on the math expert), each asleep before
        the next starts; the plan budgeted one awake and the others' CUDA contexts."""
        cks, est, turns, by_role = self.trio.checkpoints, self.plan.estimate, Turns([]), {}
        for role in roles:
            if turns.engines:
                turns.engines[-1].sleep()
            eng = VLLMEngine.acquire(cks["math" if role == "merged" else role].path, self.plan.settings, tokenizer=tok,
                                     use_chat_template=self.trio.chat_template,
                                     held=est.per_engine if not turns.engines else est.overhead_bytes - GPU_ACTIVATIONS)
            self.vllm.append(eng)
            turns.engines.append(eng)
            by_role[role] = eng
            if role in EXPERTS:
                self.engines[role] = TurnEngine(turns, eng)
        self.turns[slot] = (turns, by_role)

    def load_merged(self, recipe: Recipe, progress: Progress) -> None:
        from layerswap.core import scratch

        cks = self.trio.checkpoints
        if self.plan.refresh == "memory":
            self.builds += 1
            progress(0.2, "merging into the engine (in memory)")
            weights = TensorWeights(f"merge-{id(self)}-{self.builds}",
                                    self.trio.merges.stream(cks["math"], cks["lang"], recipe, base=cks.get("base"),
                                                            force=self.trio.force))
        else:
            if self.merge_dir is None:
                self.merge_dir = scratch.make("serving") / "merged"
            progress(0.2, "writing the merged weights for vLLM")
            self.trio.merges.export(cks["math"], cks["lang"], recipe, self.merge_dir, base=cks.get("base"),
                                    device=self.trio.device, overwrite=True, force=self.trio.force, card=False)
            weights = self.merge_dir
        progress(0.7, "loading them into the engine")
        i = next(i for i, roles in enumerate(self.roles) if "merged" in roles)
        if i in self.turns:
            turns, by_role = self.turns[i]
            turns.use(by_role["merged"]).refresh(weights)
            self.engines["merged"] = TurnEngine(turns, by_role["merged"])
        elif len(self.roles[i]) == 1:
            self.vllm[i].refresh(weights)
            self.engines["merged"] = self.vllm[i]
        else:
            self.engines["merged"] = SwappedEngine(self.vllm[i], weights)

    def release(self) -> None:
        for e in self.vllm:
            e.release()
        self.vllm.clear()
        self.turns.clear()
        if self.merge_dir is not None:
            shutil.rmtree(self.merge_dir.parent, ignore_errors=True)
            self.merge_dir = None
        super().release()

    def held_bytes(self) -> int:
        return sum(HELD.of(e) for e in self.vllm)

    def describe(self) -> str:
        """What the engines hold now (a swapped engine: the model loaded into it last)."""
        parts, engines = [], iter(self.vllm)
        for slot, roles in enumerate(self.roles):
            if slot in self.turns:  # sleep mode: the model whose engine is awake
                turns, by_role = self.turns[slot]
                awake = next((r for r, e in by_role.items() if e is turns.awake), None)
                shown = ROLE_NAMES[awake] if awake and (awake != "merged" or awake in self.engines) else "no merge yet"
                parts.append(f"{shown} awake, {len(by_role) - 1} asleep")
                for _ in by_role:
                    next(engines, None)
                continue
            eng = next(engines, None)
            if eng is None:
                break
            holds = next((r for r in roles if r in self.engines and _holds(self.engines[r]) == eng.holding), None)
            parts.append(ROLE_NAMES[holds] if holds else "no merge yet")
        return f"{TITLES[self.name]}; holding now: {', '.join(parts)}" if parts else TITLES[self.name]


def _holds(engine):
    """The weights a model's engine answers with (a swapped model: the weights swapped in before it answers)."""
    w = engine.weights if isinstance(engine, SwappedEngine) else engine.holding
    return Path(w).resolve() if isinstance(w, Path) else w


@register
class ThreeVLLM(VLLMArrangement):
    name = "three_vllm"
    roles = (("math",), ("lang",), ("merged",))


@register
class TwoVLLM(VLLMArrangement):
    name = "two_vllm"
    roles = (("math",), ("lang", "merged"))


@register
class OneVLLMSwapped(VLLMArrangement):
    name = "one_vllm_swapped"
    roles = (("math", "lang", "merged"),)



@register
class LoRAVLLM(VLLMArrangement):
    """One engine on the base with vLLM's LoRA: the experts answer as their adapters, and a layer map's merge is
    written as a LoRA adapter the same engine answers with (nothing reloaded). A merge method has no per-module
    source: its dense merge gets an engine of its own (the plan kept room for it)."""

    name = "lora_vllm"
    roles = (("math", "lang", "merged"),)

    def start(self, tok, progress: Progress) -> None:
        cks = self.trio.checkpoints
        base = cks["base"].path if "base" in cks else cks["math"].adapter_base
        VLLMEngine.idle_for(base)
        progress(0.1, f"starting vLLM: {self.describe()} (the first start takes about a minute)")
        eng = VLLMEngine.acquire(base, self.plan.settings, tokenizer=tok, use_chat_template=self.trio.chat_template,
                                 held=self.plan.estimate.per_engine)
        self.vllm.append(eng)
        for role in EXPERTS:
            self.engines[role] = LoRAEngine(eng, cks[role].adapter)

    def load_merged(self, recipe: Recipe, progress: Progress) -> None:
        if recipe.plan is None:  # a merge method: the dense merge, on an engine of its own
            self._dense(recipe, progress)
            return
        import json

        from layerswap.core import scratch
        from layerswap.merge.adapter_merge import peft_files
        from layerswap.models.adapters import read_adapter
        from layerswap.models.tensorfile import write_tensors

        cks = self.trio.checkpoints
        if self.merge_dir is None:
            self.merge_dir = scratch.make("serving") / "merged"
        progress(0.2, "writing the merged LoRA adapter")
        merged = self.trio.merges.adapter(cks["math"], cks["lang"], recipe, cks.get("base"))
        cfg, tensors = peft_files(merged, read_adapter(cks["math"].adapter).config, str(cks["math"].adapter_base))
        out = self.merge_dir.parent / "adapter"
        out.mkdir(exist_ok=True)
        write_tensors(out / "adapter_model.safetensors", tensors)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
        self.engines["merged"] = LoRAEngine(self.vllm[0], out)

    def _dense(self, recipe: Recipe, progress: Progress) -> None:
        from layerswap.core import scratch

        cks = self.trio.checkpoints
        if self.merge_dir is None:
            self.merge_dir = scratch.make("serving") / "merged"
        progress(0.2, "writing the merged weights for vLLM")
        self.trio.merges.export(cks["math"], cks["lang"], recipe, self.merge_dir, base=cks.get("base"),
                                device=self.trio.device, overwrite=True, force=self.trio.force, card=False)
        if len(self.vllm) > 1:
            progress(0.7, "loading them into the dense merge's engine")
            self.vllm[1].refresh(self.merge_dir)
        else:
            progress(0.7, "starting an engine for the dense merge")
            self.vllm.append(VLLMEngine.acquire(self.merge_dir, replace(self.plan.settings, max_lora_rank=None),
                                                tokenizer=self.vllm[0].tokenizer,
                                                use_chat_template=self.trio.chat_template,
                                                held=self.plan.estimate.per_engine))
        self.engines["merged"] = self.vllm[1]

    def describe(self) -> str:
        held = "the dense merge on an engine of its own" if len(self.vllm) > 1 else ""
        return TITLES[self.name] + (f"; {held}" if held else "")

class Answering:
    """The answering engines of one trio, from its plan (see the module's docstring)."""

    def __init__(self, plan: EnginePlan, trio: Trio, *, fallback: bool = True):
        self.plan, self.trio = plan, trio
        self.fallback = fallback  # vLLM failing to start falls back to transformers (engine choice auto)
        self.current: Arrangement | None = None  # answering now
        self.pending: Arrangement | None = None  # starting beside it (the transformers-first hand-over)
        self.failed = ""  # why the plan's vLLM engines are not the ones answering
        self.recipe: Recipe | None = None  # what the merged model holds

    @property
    def engines(self) -> dict:
        return self.current.engines if self.current is not None else {}

    @property
    def answering(self) -> bool:
        return all(r in self.engines for r in EXPERTS)

    def start(self, progress: Progress = no_progress, *, lock=None, ready: Callable[[], None] | None = None) -> None:
        """Start the plan's arrangement. With `plan.transformers_first` the transformers pair answers first (`ready`
        runs once it does), the plan's vLLM engines start beside it, then take over under `lock`, the merged model
        rebuilt in them. Refused, with the plan's numbers, when the plan does not fit."""
        plan, lock = self.plan, lock or contextlib.nullcontext()
        if not plan.fits:
            raise UserError(plan.describe().replace("**", ""))
        if plan.played:
            raise UserError(f"This plan was made for played hardware ({plan.hardware}: LAYERSWAP_HARDWARE or "
                            "LAYERSWAP_GPU_MEMORY); engines start only on the machine itself.")
        tok = load_tokenizer(self.trio.checkpoints["math"].path)
        if plan.transformers_first and plan.engine == "vllm":
            with lock:
                self.current = self._started("transformers", tok, progress)
            if ready:
                ready()
            try:
                self.pending = ARRANGEMENTS[plan.arrangement](plan, self.trio)  # shown as starting behind it
                _start(self.pending, tok, progress)
            except EngineStartError as e:
                self.pending, self.failed = None, str(e)
                if not self.fallback:
                    raise
                return
            with lock:
                old, self.current, self.pending = self.current, self.pending, None
                old.release()
                if self.recipe is not None:
                    self.current.load_merged(self.recipe, no_progress)
            return
        with lock:
            try:
                self.current = self._started(plan.arrangement, tok, progress)
            except EngineStartError as e:
                if not self.fallback:
                    raise
                self.failed = str(e)
                self.current = self._started("transformers", tok, progress)
        if ready:
            ready()

    def _started(self, name: str, tok, progress: Progress) -> Arrangement:
        arr = ARRANGEMENTS[name](self.plan, self.trio)
        _start(arr, tok, progress)
        return arr

    def load_merged(self, recipe: Recipe, progress: Progress = no_progress) -> None:
        """The merged model of `recipe` into the engines answering now."""
        if not self.answering:
            raise UserError("Load the two experts first.")
        self.current.load_merged(recipe, progress)
        self.recipe = recipe

    def release(self) -> None:
        """Engines back to the pool (vLLM) or freed (transformers), scratch merges removed."""
        for arr in (self.pending, self.current):
            if arr is not None:
                arr.release()
        self.current = self.pending = None
        self.recipe = None

    def held_bytes(self) -> int:
        """Memory the engines answering now hold on their device (what releasing them frees)."""
        return sum(a.held_bytes() for a in (self.current, self.pending) if a is not None)

    def engine_count(self) -> int:
        return sum(max(1, len(getattr(a, "vllm", ()))) for a in (self.current, self.pending) if a is not None)

    def drop_scratch(self) -> None:
        for a in (self.current, self.pending):
            d = getattr(a, "merge_dir", None)
            if d is not None:
                shutil.rmtree(d.parent, ignore_errors=True)

    def now(self) -> str:
        """The engine line: what the engines running now are, derived from them (never from a start-up message)."""
        if self.current is None:
            return ""
        s = self.current.describe()
        if self.pending is not None:  # what answers comes first: the plan's engines only start behind it
            s += f" (answering until the plan's engines have started: {self.pending.describe()})"
        elif self.failed and self.current.name != self.plan.arrangement:
            s += f" (the plan's {TITLES[self.plan.arrangement]} did not start: {self.failed})"
        return s


def _start(arr: Arrangement, tok, progress: Progress) -> None:
    """Start `arr`; one that fails closes every engine it started first (its memory free for the fallback)."""
    try:
        arr.start(tok, progress)
    except BaseException:
        getattr(arr, "close", arr.release)()
        raise


def releasing(answerings: list[Answering]) -> Releasing:
    """What starting new engines may count on: the engines of `answerings` (released first) and every idle pooled
    vLLM engine (stopped, or reused for a model of its shape)."""
    theirs = {id(e) for a in answerings for arr in (a.current, a.pending) for e in getattr(arr, "vllm", ())}
    idle = [e for e in VLLMEngine.pooled() if not e.in_use and id(e) not in theirs]
    return Releasing(sum(a.engine_count() for a in answerings if a.current is not None) + len(idle),
                     sum(a.held_bytes() for a in answerings) + sum(HELD.of(e) for e in idle))
