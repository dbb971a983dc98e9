"""Generation engines behind one small protocol, and `open_engine`, which picks vLLM or transformers.

- `base`: the `Engine` protocol, batching with a per-batch callback, chat formatting, stop strings, the tokenizer.
- `transformers_engine`: `TransformersEngine` (a loaded transformers model, weights swappable in place).
- `vllm_engine`: `VLLMEngine` (pooled per process, live weight refresh), `VLLMSettings`, `SwappedEngine`.
- `serving`: three vLLM engines or one, sized from the available memory (`plan_serving`).
"""

from __future__ import annotations

import os

from ..errors import UserError
from .base import Engine, OnBatch, TokenizingEngine, chat_template_choice, load_tokenizer, truncate_at_stop
from .serving import SERVING_CHOICES, ServingPlan, check_memory, plan_serving
from .transformers_engine import TransformersEngine, load_model, model_from_state_dict
from .vllm_engine import (VLLM_INSTALL_HINT, EngineStartError, SwappedEngine, VLLMEngine, VLLMSettings, preflight,
                          vllm_device, vllm_status)

ENGINE_CHOICES = ("auto", "vllm", "transformers")

__all__ = [
    "check_memory",
    "ENGINE_CHOICES", "SERVING_CHOICES", "VLLM_INSTALL_HINT", "Engine", "EngineStartError", "OnBatch", "ServingPlan",
    "SwappedEngine", "TokenizingEngine", "TransformersEngine", "VLLMEngine", "VLLMSettings", "chat_template_choice",
    "load_model", "load_tokenizer", "model_from_state_dict", "open_engine", "plan_serving", "preflight",
    "resolve_engine_choice", "truncate_at_stop", "vllm_device", "vllm_status",
]


def resolve_engine_choice(engine: str | None) -> str:
    """``auto`` / ``vllm`` / ``transformers``; None means ``$LAYERSWAP_ENGINE`` or auto."""
    choice = (engine or os.environ.get("LAYERSWAP_ENGINE") or "auto").lower()
    if choice not in ENGINE_CHOICES:
        raise UserError(f"Unknown engine {choice!r}; use one of: {', '.join(ENGINE_CHOICES)}.")
    return choice


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
