"""Before any engine starts: what answering with the three models needs, whether it fits, and how long a question takes.

Everything else (compatibility report, analysis, export, mergekit YAML, card, push) streams from the checkpoint
files and needs no engine; answers do. `plan_engines` decides, from headers only:

- which engine answers: vLLM (three engines side by side, or one with swapped weights; `serving.plan_serving`)
  when chosen and installed, else transformers (both experts in memory, the merge built in memory);
- the memory that needs against what is available, and for vLLM the scratch disk its merged model is written to
  (the model's size) against the free disk there;
- on the CPU, about how long one question to the three models takes: generating is bound by reading the weights
  once per token, so ``tokens × weight bytes / CPU_DECODE_BYTES_PER_S`` (measured: docs/benchmarks.md), plus, with
  one swapped vLLM engine, loading each model's weights again per switch (``SWAP_BYTES_PER_S``, measured too);
- whether to start them at once in the background (`quick`: they fit, and on the CPU a question takes under
  `QUICK_SECONDS`), or only when the visitor asks for answers; when they cannot fit, what would serve them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..checkpoints import Checkpoint
from ..errors import UserError
from .serving import DTYPE_BYTES, GiB, ServingPlan, estimate, plan_serving
from .vllm_engine import VLLMSettings, vllm_device, vllm_status

# Measured on the 8B trio with the app's own plan on a 2-core, 24 GB CPU machine (docs/benchmarks.md, "The page at
# 8B"): 16 new tokens of one 8B bf16 model in 35.5 s with the prompt's prefill (7.2e9 weight bytes per token-second),
# and a weight swap of one vLLM engine (reload_weights of 16 GB, cold) in about 52 s.
CPU_DECODE_BYTES_PER_S = 7.0e9
SWAP_BYTES_PER_S = 0.3e9
ANSWER_TOKENS = 256  # tokens per answer the estimate assumes (MGSM's default cap)
QUICK_SECONDS = 90.0  # on the CPU, engines whose question takes longer start only when answers are asked for
TRANSFORMERS_FIRST_BYTES = 2 * 10**9  # experts this small answer with transformers while vLLM starts


@dataclass(frozen=True)
class EnginePlan:
    engine: str  # "vllm" or "transformers"
    mode: str  # "three", "one" (vLLM) or "transformers"
    device: str
    need_memory: int
    available_memory: int
    scratch_bytes: int  # disk for vLLM's merged model
    free_disk: int
    problem: str  # why it does not fit ("" when it does)
    question_seconds: float | None  # three answers of ANSWER_TOKENS tokens (CPU estimate)
    serving: ServingPlan | None = None
    transformers_first: bool = False  # small experts: answer with transformers at once while vLLM starts
    why: str = ""  # why this engine (for transformers: why not vLLM)

    @property
    def fits(self) -> bool:
        return not self.problem

    @property
    def quick(self) -> bool:
        """Start the engines at once, in the background (else when answers are asked for)."""
        return self.fits and (self.question_seconds is None or self.question_seconds <= QUICK_SECONDS)

    def describe(self) -> str:
        """One paragraph for the page: what answers, with the numbers, and what it costs or what would serve."""
        what = {"three": "three vLLM engines side by side", "one": "one vLLM engine, weights swapped per model",
                "transformers": "transformers, both experts in memory"}[self.mode]
        where = "GPU memory" if self.device != "cpu" else "RAM"
        s = (f"{what}: {_gib(self.need_memory)} of {_gib(self.available_memory)} available {where}"
             + (f", {self.scratch_bytes / 1e9:.1f} GB scratch disk of {self.free_disk / 1e9:.1f} GB free"
                if self.scratch_bytes else ""))
        if self.problem:
            return f"**Answers are off:** {self.problem} The compatibility report, heatmaps, Export, mergekit YAML, " \
                   "card and Push work without them."
        if self.question_seconds is not None:
            s += f"; one question to the three models takes about {_duration(self.question_seconds)} on this CPU"
        return "**Answers:** " + s + ("." if self.quick else ". They start when you press Start engines (Ask, "
                                      "Evaluate and Build need them).")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _duration(s: float) -> str:
    return "under a second" if s < 1 else f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} minutes"


def weight_bytes(ck: Checkpoint, dtype: str | None = None) -> int:
    """One model's weights, in `dtype` (default: as stored)."""
    if dtype is None:
        return ck.nbytes
    return sum(t.numel for t in ck.tensors.values()) * DTYPE_BYTES.get(dtype, 2)


def question_seconds(bytes_per_model: int, mode: str, device: str) -> float | None:
    """About how long three answers of ANSWER_TOKENS tokens take on the CPU (None on a GPU: seconds)."""
    if device != "cpu":
        return None
    generate = 3 * ANSWER_TOKENS * bytes_per_model / CPU_DECODE_BYTES_PER_S
    swaps = 3 * bytes_per_model / SWAP_BYTES_PER_S if mode == "one" else 0.0
    return generate + swaps


def would_serve(ck: Checkpoint) -> str:
    """What serves the three models comfortably: three copies of the weights in bf16, plus cache."""
    need = 3 * weight_bytes(ck, "bfloat16") * 1.15
    return (f"the three models need about {need / 1e9:.0f} GB of GPU memory in bf16 as three vLLM engines "
            f"(e.g. a GPU Space with that much), or {need / 3 / 1e9:.0f} GB as one engine with swapped weights")


def plan_engines(cks: dict[str, Checkpoint], *, engine: str, serving: str, settings: VLLMSettings, device: str,
                 scratch_dir) -> EnginePlan:
    """The engine plan for checkpoints ``math``/``lang`` (see the module's docstring); never starts anything."""
    from ..scratch import free_bytes
    from .serving import available_memory

    math = cks["math"]
    vllm_problem = ""
    installed, why_not = vllm_status()
    if engine != "transformers" and installed:
        vdev = vllm_device()
        try:
            sp = plan_serving(math, serving, settings, vdev)
            scratch, free = math.nbytes, free_bytes(scratch_dir)
            problem = "" if scratch <= free else (
                f"vLLM loads the merged model from disk: {scratch / 1e9:.1f} GB, more than the {free / 1e9:.1f} GB free "
                "in the scratch folder (LAYERSWAP_SCRATCH).")
            per_model = weight_bytes(math, settings.engine_dtype(math.config, vdev))
            plan = EnginePlan("vllm", sp.mode, vdev, sp.estimate.need_bytes, sp.estimate.available_bytes, scratch, free,
                              problem, question_seconds(per_model, sp.mode, vdev), sp)
            if plan.fits and engine == "auto":  # small experts: transformers answers while vLLM starts
                need = cks["lang"].nbytes + math.nbytes
                plan = replace(plan, transformers_first=need <= min(TRANSFORMERS_FIRST_BYTES, available_memory("cpu") / 4))
            if plan.fits or engine == "vllm":
                return plan if plan.fits else _off(plan, math)
            vllm_problem = problem
        except UserError:  # not even one engine fits
            one = estimate(math, 1, settings, vdev)
            vllm_problem = f"one vLLM engine needs {_gib(one.need_bytes)} ({one.describe().split(' = ')[0]})"
            if engine == "vllm":
                return _off(EnginePlan("vllm", "one", vdev, one.need_bytes, one.available_bytes, 0, 0,
                                       f"{vllm_problem}, more than the {_gib(one.available_bytes)} available.", None), math)
    need = cks["lang"].nbytes + math.nbytes
    have = available_memory("cuda" if str(device).startswith("cuda") else "cpu")
    problem = "" if need <= have else (f"{_gib(have)} available; the two experts need {_gib(need)} in memory with "
                                       "transformers" + (f", and {vllm_problem}" if vllm_problem else "") + ".")
    why = "chosen" if engine == "transformers" else vllm_problem or why_not
    plan = EnginePlan("transformers", "transformers", "cpu" if device == "cpu" else str(device), need, have, 0, 0,
                      problem, question_seconds(math.nbytes, "transformers", "cpu" if device == "cpu" else "cuda"),
                      why=why)
    return plan if plan.fits else _off(plan, math)


def _off(plan: EnginePlan, ck: Checkpoint) -> EnginePlan:
    return replace(plan, problem=plan.problem.rstrip(".") + f". What would serve them: {would_serve(ck)}.")
