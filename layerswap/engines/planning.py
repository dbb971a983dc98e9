"""Before any engine starts: how the three models will answer on this hardware, and what it costs. The plan is binding:
`serving.answering.Answering` starts exactly what it says, and the page shows it.

`plan_engines` decides, from headers and the hardware (`layerswap.core.hardware`, fakeable) only, once:

- the **arrangement** (`ARRANGEMENTS`): three vLLM engines side by side; two (the math expert on one, the language
  expert and the merge swapped on the other); one vLLM engine with weights swapped per model; one vLLM engine on
  the base serving LoRA experts and each merge as adapters (`serving.vllm_lora_rank`; room is kept for a merge
  method's dense engine); transformers (both experts in memory, the merge built in memory); or none (nothing fits:
  answers are off, everything else works);
- each vLLM engine's settings: its share of the GPU (``gpu_memory_utilization``) or its KV cache on the CPU, and
  CUDA graphs on a GPU (a refresh loads weights in place, so captured graphs stay valid);
- the memory that needs against what is available, counting the engines it would release first (another trio's,
  idle ones) as available; per-engine overhead and the app's own headroom are budgeted (`serving.estimate`);
- how a Build reaches the engine serving the merge (`refresh`): ``memory`` (the merge streamed from the experts'
  files into the model, nothing written) where the engine runs in this process (vLLM on the CPU, and transformers);
  ``disk`` (exported to a scratch folder, reloaded from it) where vLLM's engine core is a process of its own (GPU):
  its RPC serializes the arguments, so an iterator cannot cross and a list of tensors is a second copy of the
  model on its socket; and for LoRA serving, whose merges are adapter folders vLLM reads;
- the scratch disk vLLM's merged model is written to (refresh ``disk`` only), against the free disk;
- on a GPU, whether models that take turns (two engines, one engine) each get an engine of their own in vLLM's
  **sleep mode** (`sleep_mode`): one awake per turn, the others asleep with their weights parked in host RAM, so
  a swap is a sleep and a wake instead of a reload from disk; only when host RAM holds what the engines pin
  (`PINNED_PER_WEIGHT` × the weights of every engine that can sleep: vLLM's level-1 sleep copies them to pinned
  memory and keeps it after waking) and the GPU the sleeping engines' CUDA contexts;
- on the smallest cards, a short context (`SHORT_CONTEXT` tokens) rather than no answers;
- about how long one question to the three models takes, and one weight swap: decoding reads every weight once per
  token, so ``tokens × weight bytes / rate`` (CPU: measured, docs/benchmarks.md; GPU: the card's bandwidth times an
  efficiency), plus the swaps the arrangement makes per question;
- whether the engines start at once behind the page (`quick`), whether small experts answer with transformers while
  vLLM starts, where the analysis runs (the CPU when the GPU's headroom is short);
- when nothing serves, which hardware would (`would_serve`: the same plan over the Hub's flavours).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.hardware import FLAVOURS, GiB, Hardware, current
from layerswap.engines.sizing import (DTYPE_BYTES, GPU_ACTIVATIONS, USABLE_FRACTION, MemoryEstimate, estimate,
                                      vllm_lora_rank)
from layerswap.engines.transformers_engine import size_problem
from layerswap.engines.vllm_engine import VLLMSettings, vllm_device, vllm_status

ARRANGEMENTS = ("lora_vllm", "three_vllm", "two_vllm", "one_vllm_swapped", "transformers", "none")
VLLM_ENGINES = {"lora_vllm": 1, "three_vllm": 3, "two_vllm": 2, "one_vllm_swapped": 1}
SERVING_CHOICES = ("auto", "three", "two", "one")
SERVING_ARRANGEMENT = {"three": "three_vllm", "two": "two_vllm", "one": "one_vllm_swapped"}
SWAPS_PER_QUESTION = {"lora_vllm": 0, "three_vllm": 0, "two_vllm": 2, "one_vllm_swapped": 3, "transformers": 0, "none": 0}
TITLES = {"lora_vllm": "one vLLM engine on the base, each model a LoRA adapter on it",
          "three_vllm": "three vLLM engines side by side",
          "two_vllm": "two vLLM engines (the math expert on one; the language expert and the merge swapped on the other)",
          "one_vllm_swapped": "one vLLM engine, weights swapped per model",
          "transformers": "transformers, both experts in memory", "none": "nothing (answers are off)"}

# Measured on the 8B trio with the app's own plan on a 2-core, 24 GB CPU machine (docs/benchmarks.md, "The page at
# 8B"): 16 new tokens of one 8B bf16 model in 35.5 s with the prompt's prefill (7.2e9 weight bytes per token-second),
# and a weight swap of one vLLM engine (reload_weights of 16 GB, cold) in about 52 s. On a GPU: the card's memory
# bandwidth times an efficiency, and a swap from the page cache (estimates until `scripts/gpu_check.py --vllm`).
CPU_DECODE_BYTES_PER_S = 7.0e9
SWAP_BYTES_PER_S = {"cpu": 0.3e9, "cuda": 2.0e9}
GPU_DECODE_EFFICIENCY = {"vllm": 0.7, "transformers": 0.35}
ANSWER_TOKENS = 256  # tokens per answer the estimate assumes (MGSM's default cap)
QUICK_SECONDS = 90.0  # engines whose question takes longer start only when answers are asked for
TRANSFORMERS_FIRST_BYTES = 2 * 10**9  # experts this small answer with transformers while vLLM starts
APP_HEADROOM = {"cpu": 1 * GiB, "cuda": 1 * GiB}  # the app's own process (its CUDA context on a GPU)
ANALYSIS_GPU_BYTES = 2 * GiB  # GPU memory the analysis and lens want beside the engines, else they run on the CPU
ASLEEP = {"two_vllm": 1, "one_vllm_swapped": 2}  # engines asleep at any time when these arrangements use sleep mode
SLEEPERS = {"two_vllm": 2, "one_vllm_swapped": 3}  # engines that take turns, each pinning host memory once it slept
# vLLM's own measurement of a level-1 sleep (an 8B bf16 model, 15.3 GiB of weights, on an A100; vllm-project/vllm
# PR 48337): ~22 GiB of host RAM (torch's pinned allocator rounds up, and vLLM issue 16663: kept after wake-up),
# 10.57 s to sleep, 2.19 s to wake. Per GiB of weights:
PINNED_PER_WEIGHT = 1.4
SLEEP_S_PER_GIB = 10.57 / 15.3
WAKE_S_PER_GIB = 2.19 / 15.3
SHORT_CONTEXT = 2048  # tokens: an 8-shot MGSM prompt and a 256-token answer; the smallest cards' engines get this


@dataclass(frozen=True)
class Releasing:
    """Engines a plan releases before it starts its own (another trio's, idle ones) and the memory they hold."""

    engines: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class EnginePlan:
    arrangement: str  # one of ARRANGEMENTS
    device: str  # where the answering engines run
    hardware: str  # the hardware planned for (`Hardware.name`)
    need_memory: int
    available_memory: int  # free now plus what the released engines hold
    scratch_bytes: int  # disk for vLLM's merged model
    free_disk: int
    problem: str  # why it does not fit ("" when it does)
    question_seconds: float | None  # three answers of ANSWER_TOKENS tokens (None: nothing serves)
    swap_seconds: float | None = None  # one weight swap (arrangements that swap)
    settings: VLLMSettings | None = None  # per vLLM engine
    estimate: MemoryEstimate | None = None
    releases: int = 0
    released_bytes: int = 0
    transformers_first: bool = False  # small experts: answer with transformers at once while vLLM starts
    cuda_graphs: bool = False
    analysis_device: str = "cpu"
    played: bool = False  # planned for played hardware (`LAYERSWAP_HARDWARE`, inspect --hardware): nothing starts
    why: str = ""  # why this arrangement (for transformers: why not vLLM)
    refresh: str = "memory"  # a Build into the merge's engine: "memory" (no file written) or "disk" (REFRESH_MODES)
    refresh_why: str = ""
    sleep: bool = False  # the models that take turns each on an engine of their own, in vLLM's sleep mode
    sleep_why: str = ""
    dense_why: str = ""  # LoRA experts served as full models: why not as adapters (`vllm_lora_rank`)
    host_pinned: int = 0  # host RAM the engines taking turns pin in sleep mode
    short_context: bool = False  # the engines' context cut to SHORT_CONTEXT tokens so that they fit

    @property
    def engine(self) -> str:
        """``vllm``, ``transformers`` or ``none``."""
        return "vllm" if self.arrangement in VLLM_ENGINES else self.arrangement

    @property
    def vllm_engines(self) -> int:
        return VLLM_ENGINES.get(self.arrangement, 0)

    @property
    def fits(self) -> bool:
        return not self.problem

    @property
    def quick(self) -> bool:
        """Start the engines at once, in the background (else when answers are asked for)."""
        return self.fits and (self.question_seconds is None or self.question_seconds <= QUICK_SECONDS)

    @property
    def title(self) -> str:
        return TITLES[self.arrangement]

    def describe(self) -> str:
        """One paragraph for the page: what answers, with the numbers, and what it costs or what would serve."""
        if self.problem:
            return f"**Answers are off:** {self.problem} The compatibility report, heatmaps, Export, mergekit YAML, " \
                   "card and Push work without them."
        where = "GPU memory" if self.device != "cpu" else "RAM"
        s = (f"**Answers:** {self.title}: {_gib(self.need_memory)} of {_gib(self.available_memory)} available {where}"
             + (f" (counting {self.releases} engine{'s' if self.releases != 1 else ''} released first)"
                if self.releases else "")
             + (f", {self.scratch_bytes / 1e9:.1f} GB scratch disk of {self.free_disk / 1e9:.1f} GB free"
                if self.scratch_bytes else ""))
        if self.question_seconds is not None:
            s += (f"; one question to the three models takes about {_duration(self.question_seconds)} on "
                  f"{'this CPU' if self.device == 'cpu' else 'this GPU'}")
            if self.swap_seconds and SWAPS_PER_QUESTION[self.arrangement]:
                s += (f", {SWAPS_PER_QUESTION[self.arrangement]} weight swaps of about "
                      f"{_duration(self.swap_seconds)} each included")
        if self.sleep:
            s += f"; models take turns in vLLM's sleep mode ({self.sleep_why})"
        if self.short_context:
            s += f"; a short context of {SHORT_CONTEXT} tokens per question, so that the engines fit"
        if self.dense_why:
            s += f"; the LoRA experts are served as full models, not as adapters ({self.dense_why.rstrip('.')})"
        if self.engine == "vllm":
            s += f"; a Build refreshes the merge's engine {'in memory' if self.refresh == 'memory' else 'through disk'}"
        return s + ("." if self.quick else ". They start when you press Start engines (Ask, Evaluate and Build "
                                           "need them).")

    def row(self, hw: Hardware) -> dict:
        """This plan as one row of `layerswap inspect --hardware` and the page's hardware table."""
        arrangement = self.arrangement if self.fits else "none"
        note = self.problem or self.title + ("; taking turns in vLLM's sleep mode" if self.sleep else "") \
            + (f"; {SHORT_CONTEXT}-token context" if self.short_context else "") + (f"; {hw.note}" if hw.note else "")
        gpu = self.fits and self.device != "cpu"
        return {"hardware": hw.name, "gpu_memory_gib": round(hw.gpu_total() / GiB, 1), "gpus": len(hw.gpus),
                "ram_gib": round(hw.ram_total / GiB, 1), "arrangement": arrangement, "fits": self.fits,
                "seconds_per_question": None if not self.fits or self.question_seconds is None
                else _round(self.question_seconds),
                "seconds_per_swap": _round(self.swap_seconds) if self.fits and self.swap_seconds else None,
                "refresh": self.refresh if self.fits and self.arrangement != "none" else None,
                "sleep": self.fits and self.sleep,
                "gpu_usable_gib": round(hw.gpu_free() / GiB, 2) if hw.gpus else None,
                "gpu_planned_gib": round(self.need_memory / GiB, 2) if gpu else None,
                "host_pinned_gib": round(self.host_pinned / GiB, 2) if self.fits and self.sleep else 0.0,
                "note": note}


REFRESH_MODES = {"memory": "the merge streamed from the experts' files into the engine, nothing written",
                 "disk": "the merge written to a scratch folder and reloaded from it"}


def refresh_mode(arrangement: str, device: str) -> tuple[str, str]:
    """How a Build reaches the engine serving the merge, and why (see the module's docstring)."""
    if arrangement == "lora_vllm":
        return "disk", "vLLM reads each merge as a LoRA adapter folder"
    if arrangement in VLLM_ENGINES and device != "cpu":
        return "disk", ("vLLM's engine core runs in a process of its own on a GPU: its RPC would serialize the "
                        "model's tensors (a second copy on its socket)")
    return "memory", ("the engine runs in this process" if arrangement in VLLM_ENGINES
                      else "the transformers engine holds the merge in memory")


def host_pinned(arrangement: str, per_model: int) -> int:
    """Host memory the engines that take turns pin in sleep mode (see the module's docstring)."""
    return int(SLEEPERS.get(arrangement, 0) * PINNED_PER_WEIGHT * per_model)


def sleep_mode(arrangement: str, dev: str, hw: Hardware, est: MemoryEstimate, per_model: int) -> tuple[int, str]:
    """Whether models that take turns use vLLM's sleep mode (see the module's docstring): the GPU memory the
    sleeping engines add (0: not used), and why."""
    asleep = ASLEEP.get(arrangement, 0)
    if not asleep:
        return 0, "no models take turns"
    if dev == "cpu":
        return 0, "vLLM's sleep mode is for GPUs"
    pinned = host_pinned(arrangement, per_model)
    parked, ram = pinned + APP_HEADROOM["cpu"], int(USABLE_FRACTION * hw.ram_available)
    if parked > ram:
        return 0, (f"{SLEEPERS[arrangement]} engines taking turns would pin {_gib(pinned)} of host RAM "
                   f"({PINNED_PER_WEIGHT:g}× their weights), {_gib(ram)} usable: weights are reloaded from disk")
    # a sleeping engine keeps its CUDA context and captured graphs; its weights leave, its KV cache and activations
    # are freed (vLLM empties the allocator's cache when it sleeps)
    extra = asleep * (est.overhead_bytes - GPU_ACTIVATIONS)
    if est.need_bytes + extra > USABLE_FRACTION * est.available_bytes:
        return 0, (f"{asleep} sleeping engines would add {_gib(extra)} of GPU memory that is not there: weights are "
                   "reloaded from disk")
    return extra, (f"{asleep} asleep at a time; {SLEEPERS[arrangement]} engines pin {_gib(pinned)} of host RAM "
                   f"({PINNED_PER_WEIGHT:g}× their weights)")


def sleep_swap_seconds(nbytes: int) -> float:
    """A swap in sleep mode: the awake model's engine sleeps, the next one's wakes (vLLM's measured rates)."""
    return nbytes / GiB * (SLEEP_S_PER_GIB + WAKE_S_PER_GIB)


def _round(s: float) -> float:
    return round(s, 1) if s >= 1 else float(f"{s:.2g}")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _duration(s: float) -> str:
    return "under a second" if s < 1 else f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} minutes"


def weight_bytes(ck: Checkpoint, dtype: str | None = None) -> int:
    """One model's weights, in `dtype` (default: as stored)."""
    if dtype is None:
        return ck.nbytes
    return sum(t.numel for t in ck.tensors.values()) * DTYPE_BYTES.get(dtype, 2)


def swap_seconds(nbytes: int, device: str) -> float:
    """About how long loading one model's weights into a running engine takes."""
    return nbytes / SWAP_BYTES_PER_S["cpu" if device == "cpu" else "cuda"]


def question_seconds(arrangement: str, nbytes: int, hw: Hardware, device: str,
                     swap: float | None = None) -> float | None:
    """About how long three answers of ANSWER_TOKENS tokens take (`nbytes`: one model's weights as served; `swap`:
    one weight swap's seconds, default a reload)."""
    if arrangement == "none":
        return None
    if device == "cpu":
        rate = CPU_DECODE_BYTES_PER_S
    else:
        rate = hw.bandwidth() * GPU_DECODE_EFFICIENCY["transformers" if arrangement == "transformers" else "vllm"]
    swap = swap_seconds(nbytes, device) if swap is None else swap
    return 3 * ANSWER_TOKENS * nbytes / rate + SWAPS_PER_QUESTION[arrangement] * swap


def plan_engines(cks: dict[str, Checkpoint], *, engine: str = "auto", serving: str = "auto",
                 settings: VLLMSettings | None = None, device: str | None = None, hardware: Hardware | None = None,
                 releasing: Releasing = Releasing(), alternatives: bool = True) -> EnginePlan:
    """The engine plan for checkpoints ``math``/``lang`` (see the module's docstring); never starts anything.

    `engine`: auto, vllm or transformers; `serving`: auto or a forced vLLM arrangement (three, two, one); `device`:
    the transformers engine's (default: the hardware's); `releasing`: engines released before starting."""
    from layerswap.core.errors import UserError

    if serving not in SERVING_CHOICES:
        raise UserError(f"Unknown serving mode {serving!r}; use one of: {', '.join(SERVING_CHOICES)}.")
    hw = hardware or current()
    settings = settings or VLLMSettings()
    math = cks["math"]
    base = dict(hardware=hw.name, releases=releasing.engines, released_bytes=releasing.nbytes, played=hw.played)
    for role, ck in (("math", cks["math"]), ("language", cks["lang"])):
        bad = size_problem(ck.config, ck.numel)
        if bad:  # an engine would allocate what the config asks for before finding out
            return EnginePlan("none", hw.device, need_memory=0, available_memory=hw.memory_available(hw.device),
                              scratch_bytes=0, free_disk=hw.disk_free, problem=f"the {role} expert: {bad}",
                              question_seconds=None, why="the config does not match the weights", **base)
    if hw.zero_gpu:
        return _zero_gpu(cks, hw, base, alternatives)
    vllm_ok, why_not, vdev = vllm_availability(cks, hw)
    vllm_problem = ""
    if engine != "transformers" and vllm_ok:
        plan = _plan_vllm(cks, serving, settings, vdev, hw, releasing, base, engine == "auto")
        if plan.fits or engine == "vllm":
            return plan if plan.fits or not alternatives else _with_alternatives(plan, cks, engine, settings)
        vllm_problem = plan.problem
    tdev = hw.device if (hw.played or device is None) else ("cuda" if str(device).startswith("cuda") else "cpu")
    need = cks["lang"].nbytes + math.nbytes + APP_HEADROOM[tdev]
    have = hw.memory_available(tdev) + releasing.nbytes
    problem = "" if need <= have else (f"{_gib(have)} available; the two experts need {_gib(need)} in "
                                       f"{'GPU memory' if tdev != 'cpu' else 'RAM'} with transformers (the app's "
                                       "headroom included)" + (f", and {_lower(vllm_problem)}" if vllm_problem else "")
                                       + ".")
    why = "chosen" if engine == "transformers" else vllm_problem or why_not
    plan = EnginePlan("transformers" if not problem else "none", tdev, need_memory=need, available_memory=have,
                      scratch_bytes=0, free_disk=hw.disk_free, problem=problem,
                      question_seconds=question_seconds("transformers" if not problem else "none", math.nbytes, hw,
                                                        tdev),
                      analysis_device=_analysis_device(tdev, have - need), why=why,
                      refresh_why=refresh_mode("transformers", tdev)[1], **base)
    return plan if plan.fits or not alternatives else _with_alternatives(plan, cks, engine, settings)


def vllm_availability(cks: dict[str, Checkpoint], hw: Hardware) -> tuple[bool, str, str]:
    """Whether vLLM can serve these models on `hw` (installed there, no prefix adapters), why (or why not), and
    the device it runs on."""
    ok, why = (vllm_status() if hw.vllm is None else
               (hw.vllm, "" if hw.vllm else f"vLLM does not run on {hw.name} (not installed there)"))
    if any(ck.adapter_kind == "prefix" for ck in cks.values()):
        ok, why = False, "vLLM serves no prefix-tuning adapters; transformers runs the prefixes (peft)"
    return ok, why, (vllm_device() if hw.vllm is None else hw.device) if ok else hw.device


def _plan_vllm(cks: dict[str, Checkpoint], serving: str, settings: VLLMSettings, dev: str, hw: Hardware,
               releasing: Releasing, base: dict, auto: bool) -> EnginePlan:
    """The first vLLM arrangement that fits (three, two, one), or the last tried with its problem."""
    math = cks["math"]
    graphs = dev != "cpu" and settings.enforce_eager is not True
    settings = replace(settings, enforce_eager=not graphs)
    tp = max(1, settings.tensor_parallel_size) if dev != "cpu" else 1
    available = hw.memory_available(dev, tp) + releasing.nbytes
    free = hw.disk_free
    tried = [SERVING_ARRANGEMENT[serving]] if serving != "auto" else [a for a in VLLM_ENGINES if a != "lora_vllm"]
    rank, dense_why = vllm_lora_rank(cks) if serving == "auto" else (None, "")
    if rank or not (cks["math"].adapter_kind == cks["lang"].adapter_kind == "lora"):
        dense_why = ""
    if rank:  # LoRA experts: one engine on the base, every model an adapter (room kept for a dense merge's engine)
        tried.insert(0, "lora_vllm")
    per_model = weight_bytes(math, settings.engine_dtype(math.config, dev))
    plan = None
    short = dev != "cpu" and not settings.max_model_len and settings.context_length(math.config) > SHORT_CONTEXT
    if short:  # the smallest cards: the last arrangement again with a short context, rather than no answers
        tried = tried + [tried[-1]]
    for i, arrangement in enumerate(tried):
        if short and i == len(tried) - 1:
            settings = replace(settings, max_model_len=SHORT_CONTEXT)
        lora = arrangement == "lora_vllm"
        refresh, refresh_why = refresh_mode(arrangement, dev)
        scratch = math.nbytes if refresh == "disk" else 0
        disk_problem = "" if scratch <= free else (
            f"vLLM loads the merged model from disk: {scratch / 1e9:.1f} GB, more than the {free / 1e9:.1f} GB free "
            "in the scratch folder (LAYERSWAP_SCRATCH).")
        est = estimate(math, 2 if lora else VLLM_ENGINES[arrangement], settings, dev, available, APP_HEADROOM[dev])
        problem = disk_problem or ("" if est.fits else (
            f"{TITLES[arrangement]} need {est.describe()} (of which {USABLE_FRACTION:.0%} is usable)."))
        spare = int(USABLE_FRACTION * available) - est.need_bytes
        plan = EnginePlan(arrangement, dev, need_memory=est.need_bytes, available_memory=available,
                          scratch_bytes=scratch, free_disk=free, problem=problem,
                          question_seconds=question_seconds(arrangement, per_model, hw, dev),
                          swap_seconds=swap_seconds(per_model, dev) if SWAPS_PER_QUESTION[arrangement] else None,
                          settings=replace(_sized(settings, est, hw, dev), max_lora_rank=rank if lora else None),
                          estimate=est, cuda_graphs=graphs,
                          analysis_device=_analysis_device(dev, spare), why=_why(arrangement, serving),
                          refresh=refresh, refresh_why=refresh_why, dense_why="" if lora else dense_why,
                          short_context=short and i == len(tried) - 1, **base)
        if plan.fits:
            break
    if plan.fits and dev != "cpu":
        extra, why = sleep_mode(plan.arrangement, dev, hw, plan.estimate, per_model)
        plan = replace(plan, sleep_why=why)
        if extra:
            swap = sleep_swap_seconds(per_model)
            est = replace(plan.estimate, fixed_bytes=plan.estimate.fixed_bytes + extra)
            plan = replace(plan, sleep=True, need_memory=est.need_bytes, estimate=est, swap_seconds=swap,
                           host_pinned=host_pinned(plan.arrangement, per_model),
                           settings=replace(_sized(settings, est, hw, dev), sleep_mode=True),
                           question_seconds=question_seconds(plan.arrangement, per_model, hw, dev, swap),
                           analysis_device=_analysis_device(dev, int(USABLE_FRACTION * available) - est.need_bytes))
    if plan.fits and auto and dev == "cpu":
        experts = cks["lang"].nbytes + math.nbytes
        plan = replace(plan, transformers_first=experts <= min(TRANSFORMERS_FIRST_BYTES, hw.ram_available / 4))
    return plan


def _sized(settings: VLLMSettings, est: MemoryEstimate, hw: Hardware, dev: str) -> VLLMSettings:
    """Per-engine settings: the KV cache on the CPU; on a GPU an equal share of what is usable, as a fraction of
    the GPU's total (how vLLM reads ``gpu_memory_utilization``)."""
    if dev == "cpu":
        return replace(settings, kv_cache_gib=est.kv_bytes / GiB)
    share = (USABLE_FRACTION * est.available_bytes - est.fixed_bytes) / est.engines
    return replace(settings, gpu_memory_utilization=round(min(max(share, 0) / max(hw.gpu_total(), 1), 0.92), 3))


def _why(arrangement: str, serving: str) -> str:
    if serving != "auto":
        return f"serving {serving!r} chosen"
    bigger = [a for a in VLLM_ENGINES if VLLM_ENGINES[a] > VLLM_ENGINES[arrangement]]
    return "it fits" if not bigger else f"{TITLES[bigger[-1]]} would not fit"


def _analysis_device(dev: str, spare: int) -> str:
    return "cuda" if dev != "cpu" and spare >= ANALYSIS_GPU_BYTES else "cpu"


def _lower(s: str) -> str:
    return s[:1].lower() + s[1:].rstrip(".")


def zero_gpu_problem() -> str:
    return ("ZeroGPU attaches its GPU only inside each event, under a daily quota of 2 minutes (anonymous) or 5 "
            "(free accounts), and keeps nothing on it between events; layerswap's engines hold the three models "
            "across questions and builds, so it does not serve on ZeroGPU.")


def _zero_gpu(cks: dict[str, Checkpoint], hw: Hardware, base: dict, alternatives: bool) -> EnginePlan:
    problem = zero_gpu_problem()
    plan = EnginePlan("none", "cuda", need_memory=0, available_memory=hw.gpu_free(), scratch_bytes=0,
                      free_disk=hw.disk_free, problem=problem, question_seconds=None, **base)
    return _with_alternatives(plan, cks, "auto", VLLMSettings()) if alternatives else plan


def would_serve(cks: dict[str, Checkpoint], engine: str = "auto",
                settings: VLLMSettings | None = None) -> list[tuple[Hardware, EnginePlan]]:
    """Which Spaces flavours serve these models: the cheapest (by the Hub's price) on which they answer, and the
    cheapest on which they answer with the fewest weight swaps, when that is another."""
    rows = []
    for hw in sorted((h for h in FLAVOURS.values() if h.price is not None and not h.zero_gpu),
                     key=lambda h: h.price):
        p = plan_engines(cks, engine=engine, settings=settings, hardware=dataclasses.replace(hw, played=True),
                         alternatives=False)
        if p.fits and p.quick:
            rows.append((hw, p))
    if not rows:
        return []
    best = min(rows, key=lambda r: (SWAPS_PER_QUESTION[r[1].arrangement], r[1].engine != "vllm", r[0].price))
    return [rows[0]] + ([best] if best is not rows[0] else [])


def would_serve_text(cks: dict[str, Checkpoint], engine: str = "auto", settings: VLLMSettings | None = None) -> str:
    rows = would_serve(cks, engine, settings)
    if not rows:
        return "none of the Hub's Spaces flavours (use a machine with more memory, or smaller models)"
    def each(s: float) -> str:
        return "under a second a question" if s < 1 else f"about {_duration(s)} a question"

    return "; ".join(f"`{hw.name}` ({hw.label}: {p.title}, {each(p.question_seconds or 0)})" for hw, p in rows)


def _with_alternatives(plan: EnginePlan, cks: dict[str, Checkpoint], engine: str, settings: VLLMSettings) -> EnginePlan:
    return replace(plan, problem=plan.problem.rstrip(".") + f". What would serve them: "
                   f"{would_serve_text(cks, engine, settings)}.")


def hardware_table(cks: dict[str, Checkpoint], names: list[str], engine: str = "auto", serving: str = "auto",
                   settings: VLLMSettings | None = None) -> list[dict]:
    """One `EnginePlan.row` per hardware name (a Spaces flavour, or ``this``): what would serve these models where."""
    from layerswap.core.hardware import flavour

    rows = []
    for name in names:
        hw = flavour(name)
        rows.append(plan_engines(cks, engine=engine, serving=serving, settings=settings, hardware=hw,
                                 alternatives=False).row(hw))
    return rows


def table_markdown(rows: list[dict]) -> str:
    """The hardware table as Markdown (the page, docs/hosting.md)."""
    lines = ["| hardware | GPU memory (usable) | RAM | arrangement | GPU planned | host pinned | s per question | "
             "s per swap | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gpu = f"{r['gpus']} × {r['gpu_memory_gib']:g} GiB" if r["gpus"] > 1 else \
            f"{r['gpu_memory_gib']:g} GiB" if r["gpus"] else "none"
        if r["gpus"]:
            gpu += f" ({r['gpu_usable_gib']:g})"
        planned = "" if r["gpu_planned_gib"] is None else f"{r['gpu_planned_gib']:g} GiB"
        pinned = f"{r['host_pinned_gib']:g} GiB" if r["host_pinned_gib"] else ""
        sec = "" if r["seconds_per_question"] is None else f"{r['seconds_per_question']:g}"
        swap = "" if r["seconds_per_swap"] is None else f"{r['seconds_per_swap']:g}"
        note = r["note"] if r["fits"] else r["note"].split(". What would serve")[0]
        lines.append(f"| `{r['hardware']}` | {gpu} | {r['ram_gib']:g} GiB | `{r['arrangement']}` | {planned} | "
                     f"{pinned} | {sec} | {swap} | "
                     f"{note.replace('|', '/')} |")
    return "\n".join(lines)
