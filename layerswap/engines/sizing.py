"""What one vLLM engine needs, from a model's headers: weights, KV cache and overhead, on a GPU or the CPU.

`estimate` is the memory model the planner (`engines.planning`) budgets with; it starts nothing.

- **Weights**: parameters × the engine's dtype (``/ tensor_parallel_size`` on each GPU of an engine).
- **KV cache**, sized from the model served, not a fixed size: `KV_SEQUENCES` full-length sequences of its
  context (2 × layers × KV heads × head size × dtype bytes per token), at least one sequence (vLLM refuses to
  start without it); on the CPU at most ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 when unset) unless `kv_cache_gib` says.
  The demo's models need 2 MB per sequence; the 8B's 512 MiB.
- **Overhead** per engine: on the CPU the engine runs inside the app's process (one import of vLLM for all,
  `CPU_PROCESS_OVERHEAD`, then `CPU_ENGINE_OVERHEAD` each: measured, docs/benchmarks.md); on a GPU each engine
  is a process with its own CUDA context, activations and, with CUDA graphs, their memory pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from layerswap.models.checkpoints import Checkpoint, text_config
from layerswap.core.errors import UserError
from layerswap.core.hardware import Hardware, current
from layerswap.engines.vllm_engine import VLLMSettings

GiB = 2**30
MiB = 2**20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}
KV_SEQUENCES = {"cpu": 16, "cuda": 4}  # full-length sequences the KV cache holds at least (a batch of questions;
# on a GPU vLLM gives the cache whatever its share leaves, so this is the least it must leave)
CPU_PROCESS_OVERHEAD = 384 * MiB  # vLLM imported into the app's process, once (measured: docs/benchmarks.md)
CPU_ENGINE_OVERHEAD = 64 * MiB  # one more in-process CPU engine, beyond weights and KV (measured: 25 MiB)
CUDA_CONTEXT = 640 * MiB  # one engine process's CUDA context on its GPU
GPU_ACTIVATIONS = 1 * GiB  # activations, sampler and allocator slack of one engine
CUDA_GRAPHS = 512 * MiB  # captured CUDA graphs' memory pool
USABLE_FRACTION = 0.9  # of what is free/available


@dataclass(frozen=True)
class MemoryEstimate:
    device: str
    engines: int
    weights_bytes: int  # per engine
    kv_bytes: int  # per engine
    overhead_bytes: int  # per engine
    available_bytes: int
    fixed_bytes: int = 0  # once for all engines (vLLM in the app's process on the CPU; the app's own headroom)

    @property
    def per_engine(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def need_bytes(self) -> int:
        return self.engines * self.per_engine + self.fixed_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= USABLE_FRACTION * self.available_bytes

    def describe(self) -> str:
        where = "free GPU memory" if self.device != "cpu" else "available RAM"
        fixed = f" + {_gib(self.fixed_bytes)} for the app" if self.fixed_bytes else ""
        return (f"{self.engines} engine{'s' if self.engines > 1 else ''} × ({_gib(self.weights_bytes)} weights + "
                f"{_gib(self.kv_bytes)} KV cache + {_gib(self.overhead_bytes)} overhead){fixed} = "
                f"{_gib(self.need_bytes)}; {_gib(self.available_bytes)} {where}")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB or n == 0 else f"{n / MiB:.0f} MiB"


def available_memory(device: str, gpus: int = 1, hardware: Hardware | None = None) -> int:
    """Free GPU memory (the least free of the first `gpus` GPUs) or available RAM, in bytes (`hardware.current`)."""
    return (hardware or current()).memory_available("cuda" if str(device).startswith("cuda") else "cpu", gpus)


def check_memory(need: int, device: str, what: str) -> None:
    """Refuse, with the numbers, to load `need` bytes for `what` when the device has less free."""
    have = available_memory(device)
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


def kv_cache_bytes(ck: Checkpoint, settings: VLLMSettings, device: str) -> int:
    """KV cache per engine (per GPU of an engine), sized from the model (see the module's docstring)."""
    dtype = settings.engine_dtype(ck.config, device)
    tp = max(1, settings.tensor_parallel_size) if device != "cpu" else 1
    seq = kv_bytes_per_token(ck, dtype) * settings.context_length(ck.config) // tp
    if device == "cpu" and settings.kv_cache_gib:
        return max(int(settings.kv_cache_gib * GiB), seq)
    sized = seq * KV_SEQUENCES["cpu" if device == "cpu" else "cuda"]
    if device == "cpu":
        sized = min(sized, int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1) * GiB))
    return max(seq, sized)


def estimate(ck: Checkpoint, engines: int, settings: VLLMSettings, device: str, available: int,
             fixed: int = 0) -> MemoryEstimate:
    """Memory per device for `engines` engines of `ck`'s shape (see the module's docstring); `fixed`: the app's
    own headroom, counted once."""
    dtype = settings.engine_dtype(ck.config, device)
    tp = max(1, settings.tensor_parallel_size) if device != "cpu" else 1
    params = sum(t.numel for t in ck.tensors.values())
    weights = params * DTYPE_BYTES.get(dtype, 2) // tp
    kv = kv_cache_bytes(ck, settings, device)
    if device == "cpu":
        overhead, fixed = CPU_ENGINE_OVERHEAD, fixed + CPU_PROCESS_OVERHEAD
    else:
        overhead = CUDA_CONTEXT + GPU_ACTIVATIONS + (0 if settings.enforce_eager else CUDA_GRAPHS)
    return MemoryEstimate(device, engines, int(weights), int(kv), int(overhead), int(available), int(fixed))


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(cks: dict[str, Checkpoint]) -> tuple[int | None, str]:
    """Whether vLLM can serve the experts as LoRA adapters on their base (arrangement ``lora_vllm``): the
    `max_lora_rank` the engine needs (the merged adapter's rank: the two ranks side by side), or None and why not."""
    from layerswap.models.adapters import read_adapter

    math, lang = cks["math"], cks["lang"]
    if math.adapter_kind != "lora" or lang.adapter_kind != "lora":
        return None, "the experts are not both LoRA adapters"
    ranks = []
    for role, ck in (("math", math), ("language", lang)):
        w = read_adapter(ck.adapter).weights()
        if w.full or any(e["embedding"] for e in w.modules.values()):
            return None, (f"the {role} expert brings full copies of modules (modules_to_save) or embedding LoRA; "
                          "vLLM's LoRA serves the layers' linear modules only")
        ranks.append(max((e["A"].shape[0] for e in w.modules.values()), default=1))
    need = sum(ranks)
    rank = next((r for r in LORA_RANKS if r >= need), None)
    return (rank, "") if rank else (None, f"the merged adapter's rank {need} is over vLLM's {LORA_RANKS[-1]}")
