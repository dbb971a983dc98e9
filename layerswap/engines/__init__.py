"""Generation engines behind one small protocol, and the choice of vLLM or transformers.

- `base`: the `Engine` protocol, batching with a per-batch callback, chat formatting, stop strings, the tokenizer.
- `transformers_engine`: `TransformersEngine` (a loaded transformers model, weights swappable in place).
- `vllm_engine`: `VLLMEngine` (pooled per process, live weight refresh), `VLLMSettings`, `SwappedEngine`.
- `serving`: three vLLM engines or one, sized from the available memory (`plan_serving`).
- `choice`: `EngineSettings`, and `try_vllm`, the one place that tries vLLM and falls back to transformers
  (`open_engine` for one model folder, the workbench for three models).
"""

from __future__ import annotations

from .base import Engine, OnBatch, TokenizingEngine, chat_template_choice, load_tokenizer, truncate_at_stop
from .serving import SERVING_CHOICES, ServingPlan, check_memory, plan_serving
from .transformers_engine import TransformersEngine, load_model, model_from_state_dict
from .vllm_engine import (VLLM_INSTALL_HINT, EngineStartError, SwappedEngine, VLLMEngine, VLLMSettings, preflight,
                          vllm_device, vllm_status)
from .choice import ENGINE_CHOICES, EngineSettings, open_engine, resolve_engine_choice, try_vllm

__all__ = [
    "check_memory",
    "ENGINE_CHOICES", "SERVING_CHOICES", "VLLM_INSTALL_HINT", "Engine", "EngineSettings", "EngineStartError", "OnBatch",
    "ServingPlan", "SwappedEngine", "TokenizingEngine", "TransformersEngine", "VLLMEngine", "VLLMSettings",
    "chat_template_choice", "load_model", "load_tokenizer", "model_from_state_dict", "open_engine", "plan_serving",
    "preflight", "resolve_engine_choice", "truncate_at_stop", "try_vllm", "vllm_device", "vllm_status",
]
