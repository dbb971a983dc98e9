"""Serving the three models with vLLM: three engines or one, sized from the memory there is before starting.

The workbench serves three models (math expert, language expert, merged). With vLLM that is
either **three engines** side by side, or **one engine** whose weights are swapped to whichever
model is asked (`VLLMEngine.refresh`: same answers, a weight reload per switch). `plan_serving`
estimates what each engine needs (weights in the engine's dtype, KV cache, process overhead),
compares it with what is available (free GPU memory, or available RAM on the CPU backend), and
either returns per-engine settings or raises a `UserError` that says what to change.

- GPU: each engine gets an equal share of 90% of the free memory as ``gpu_memory_utilization``
  (a fraction of *total* memory, which is how vLLM reads it).
- CPU: the KV cache per engine is ``VLLM_CPU_KVCACHE_SPACE`` GiB when set, else 1 GiB (at least
  one full-length sequence), passed as ``kv_cache_memory_bytes``.
- ``tensor_parallel_size`` N > 1 (GPU only): each engine spans N GPUs, each holding 1/N of its weights
  and cache; the least free of those GPUs is what is compared.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..checkpoints import Checkpoint, text_config
from ..errors import UserError
from ..runtime import ram_available
from .vllm_engine import VLLMSettings

GiB = 2**30
SERVING_CHOICES = ("auto", "three", "one")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}
OVERHEAD = {"cpu": 1.5 * GiB, "cuda": 1.5 * GiB}  # per engine: processes, runtime, activations
USABLE_FRACTION = 0.9  # of what is free/available


@dataclass
class MemoryEstimate:
    device: str
    engines: int
    weights_bytes: int  # per engine
    kv_bytes: int  # per engine
    overhead_bytes: int  # per engine
    available_bytes: int

    @property
    def per_engine(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def need_bytes(self) -> int:
        return self.engines * self.per_engine

    @property
    def fits(self) -> bool:
        return self.need_bytes <= USABLE_FRACTION * self.available_bytes

    def describe(self) -> str:
        where = "free GPU memory" if self.device != "cpu" else "available RAM"
        return (f"{self.engines} engine{'s' if self.engines > 1 else ''} × ({_gib(self.weights_bytes)} weights + "
                f"{_gib(self.kv_bytes)} KV cache + {_gib(self.overhead_bytes)} overhead) = {_gib(self.need_bytes)}; "
                f"{_gib(self.available_bytes)} {where}")


@dataclass
class ServingPlan:
    mode: str  # "three" or "one"
    settings: VLLMSettings  # per engine
    estimate: MemoryEstimate
    note: str


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def available_memory(device: str, gpus: int = 1) -> int:
    """Free GPU memory (CUDA; the least free of the first `gpus` GPUs) or available RAM (CPU backend), in bytes;
    ``$LAYERSWAP_AVAILABLE_MEMORY`` (bytes) caps it, so a test can play a small machine."""
    cap = os.environ.get("LAYERSWAP_AVAILABLE_MEMORY")
    have = _available(device, gpus)
    return min(have, int(float(cap))) if cap else have


def _available(device: str, gpus: int) -> int:
    if device != "cpu":
        import torch

        return int(min(torch.cuda.mem_get_info(i)[0] for i in range(max(1, gpus))))
    ram = ram_available()
    if ram is None:
        raise UserError("Cannot tell how much memory this machine has available (no /proc/meminfo, no psutil): "
                        "pip install psutil.")
    return ram


def check_memory(need: int, device: str, what: str) -> None:
    """Refuse, with the numbers, to load `need` bytes for `what` when the device has less free."""
    have = available_memory("cuda" if str(device).startswith("cuda") else "cpu")
    if need > have:
        where = "free GPU memory" if str(device).startswith("cuda") else "available RAM"
        raise UserError(f"Loading {what} needs {_gib(need)}, more than the {where} ({_gib(have)}); nothing was "
                        "loaded and the models held so far stay. Use smaller models or free memory first.")


def kv_bytes_per_token(ck: Checkpoint, dtype: str) -> int:
    tc = text_config(ck.config)
    heads = int(tc["num_attention_heads"])
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = int(tc.get("head_dim") or int(tc["hidden_size"]) // heads)
    return 2 * ck.num_layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)


def estimate(ck: Checkpoint, engines: int, settings: VLLMSettings, device: str,
             available: int | None = None) -> MemoryEstimate:
    """Memory per device: with tensor parallelism each of the engine's GPUs holds 1/tp of weights and cache."""
    dtype = settings.engine_dtype(ck.config, device)
    tp = max(1, settings.tensor_parallel_size) if device != "cpu" else 1
    params = sum(t.numel for t in ck.tensors.values())
    weights = params * DTYPE_BYTES.get(dtype, 2) / tp
    max_len = settings.context_length(ck.config)
    min_kv = kv_bytes_per_token(ck, dtype) * max_len / tp  # vLLM refuses to start without one full sequence
    if device == "cpu":
        kv = max(int(settings.cpu_kv_cache_gib() * GiB), min_kv)
    else:
        kv = min_kv
    avail = available_memory(device, tp) if available is None else available
    return MemoryEstimate(device, engines, int(weights), int(kv), int(OVERHEAD.get(device, OVERHEAD["cuda"])), avail)


def plan_serving(ck: Checkpoint, serving: str = "auto", settings: VLLMSettings | None = None,
                 device: str = "cpu", available: int | None = None, running: int = 0) -> ServingPlan:
    """Choose three engines or one, and size them; raise UserError (before starting) when it cannot fit.

    `running`: idle engines of this model's shape already running (they are reused, and the memory
    they hold counts as available to them).
    """
    if serving not in SERVING_CHOICES:
        raise UserError(f"Unknown serving mode {serving!r}; use one of: {', '.join(SERVING_CHOICES)}.")
    settings = settings or VLLMSettings()
    three = estimate(ck, 3, settings, device, available)
    if running:
        three = dataclasses.replace(three, available_bytes=three.available_bytes
                                    + int(min(running, 3) * three.per_engine / USABLE_FRACTION))
    one = dataclasses.replace(three, engines=1)
    if serving in ("auto", "three") and three.fits:
        est, mode = three, "three"
        note = "three vLLM engines side by side"
    elif serving == "three":
        raise UserError(
            f"The three models do not fit as three vLLM engines: {three.describe()}. Serve them one at a time "
            "with one engine whose weights are swapped per model (serving 'one': --serving one, or 'One engine' "
            "in the app), lower max_model_len, or use a machine with more memory.")
    elif one.fits:
        est, mode = one, "one"
        note = "one vLLM engine, weights swapped per model"
        if serving == "auto":
            note += f" (three engines would not fit: {three.describe()})"
    else:
        raise UserError(f"Even one vLLM engine does not fit: {one.describe()}. Lower max_model_len, free memory, "
                        "or use the transformers engine (--engine transformers).")
    if device == "cpu":
        settings = dataclasses.replace(settings, kv_cache_gib=est.kv_bytes / GiB)
    else:
        import torch

        total = torch.cuda.mem_get_info(0)[1]
        share = USABLE_FRACTION * est.available_bytes / est.engines / total
        settings = dataclasses.replace(settings, gpu_memory_utilization=round(min(share, 0.92), 3))
    return ServingPlan(mode, settings, est, note)
