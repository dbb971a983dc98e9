"""Which engine answers: the settings a workbench (or one engine) is made with, and the one place that
tries vLLM and falls back to transformers.

``engine`` is ``auto`` (vLLM when it is installed and starts, else transformers, saying why), ``vllm``
(fail with the reason instead of falling back) or ``transformers`` (never try vLLM); None reads
``$LAYERSWAP_ENGINE``. `EngineSettings` is what the CLI's engine options, a sweep file's ``engine:``
mapping and the app's start-up flags become; `Workbench.from_settings` makes the workbench from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, TypeVar

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.engines.base import Engine
from layerswap.engines.transformers_engine import TransformersEngine
from layerswap.engines.vllm_engine import EngineStartError, VLLMEngine, VLLMSettings, vllm_status

ENGINE_CHOICES = ("auto", "vllm", "transformers")
T = TypeVar("T")


def resolve_engine_choice(engine: str | None) -> str:
    """``auto`` / ``vllm`` / ``transformers``; None means ``$LAYERSWAP_ENGINE`` or auto."""
    choice = (engine or os.environ.get("LAYERSWAP_ENGINE") or "auto").lower()
    if choice not in ENGINE_CHOICES:
        raise UserError(f"Unknown engine {choice!r}; use one of: {', '.join(ENGINE_CHOICES)}.")
    return choice


def try_vllm(choice: str, start: Callable[[], T]) -> tuple[T | None, str]:
    """Call `start` (which starts vLLM engines, raising `EngineStartError` when it cannot) if `choice` allows
    vLLM. Returns what it returned and why vLLM answers, or (None, why not) to fall back to transformers
    (``"chosen"`` when transformers was chosen); with choice ``vllm`` the EngineStartError propagates."""
    if choice == "transformers":
        return None, "chosen"
    ok, why = vllm_status()
    try:
        if not ok:
            raise EngineStartError(why)
        return start(), why
    except EngineStartError as e:
        if choice == "vllm":
            raise
        return None, str(e)


@dataclass(frozen=True)
class EngineSettings:
    """How a workbench answers: engine choice, device, vLLM serving mode and sizes, batch size, chat template."""

    engine: str | None = None  # auto, vllm, transformers; None: $LAYERSWAP_ENGINE
    device: str = "auto"  # transformers engine and merges
    serving: str = "auto"  # vLLM: three engines, or one with weights swapped (auto: by memory)
    batch_size: int = 8
    chat_template: bool | None = None  # True: the chat template (bounded); None or False: plain prompts
    max_model_len: int | None = None  # vLLM context length (None: the model's, at most 4096)
    tensor_parallel_size: int = 1  # vLLM on GPUs: GPUs per engine

    def vllm(self) -> VLLMSettings:
        return VLLMSettings(max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineSettings":
        """From a sweep file's ``engine:`` mapping (absent keys take the defaults; plain prompts, as lm-eval)."""
        return cls(engine=d.get("engine"), device=d.get("device") or "auto", serving=d.get("serving") or "auto",
                   batch_size=int(d.get("batch_size") or 8), chat_template=bool(d.get("chat_template", False)),
                   max_model_len=d.get("max_model_len"), tensor_parallel_size=int(d.get("tensor_parallel_size") or 1))


def open_engine(path: str | os.PathLike, *, engine: str = "auto", device: str = "auto",
                settings: VLLMSettings | None = None, use_chat_template: bool | None = None,
                batch_size: int = 8) -> tuple[Engine, str]:
    """An engine for one model (a folder, an ``assets:`` reference or a Hub id) and a note saying which engine answers
    and why (`try_vllm`)."""
    engine = resolve_engine_choice(engine)
    path = Checkpoint.open(path).path  # the folder it names, checked as a model (a one-line refusal if not)
    eng, why = try_vllm(engine, lambda: VLLMEngine.acquire(path, settings, use_chat_template=use_chat_template))
    if eng is not None:
        return eng, f"answered by vLLM ({why})"
    note = "answered by transformers (chosen)" if why == "chosen" else f"answered by transformers: {why}"
    return TransformersEngine.from_pretrained(path, device, batch_size=batch_size,
                                              use_chat_template=use_chat_template), note
