"""Generation engines behind one small protocol, and the choice of vLLM or transformers.

- `base`: the `Engine` protocol, batching with a per-batch callback, chat formatting, stop strings, the tokenizer.
- `transformers_engine`: `TransformersEngine` (a loaded transformers model, weights swappable in place).
- `vllm_engine`: `VLLMEngine` (pooled per process, live weight refresh from a folder or `TensorWeights`),
  `VLLMSettings`, `SwappedEngine`.
- `sizing`: what one vLLM engine needs (weights, KV cache sized from the model, overhead), `check_memory`.
- `planning`: the engine plan (`plan_engines`, `EnginePlan`): the arrangement, its sizes and costs, on the hardware.
- `choice`: `EngineSettings`, and `try_vllm`, the one place that tries vLLM and falls back to transformers
  (`open_engine` for one model folder, `serving.answering` for three models).
"""

from __future__ import annotations

from layerswap.engines.base import (Engine, OnBatch, TokenizingEngine, chat_template_choice, load_tokenizer,
                                    truncate_at_stop)
from layerswap.engines.sizing import check_memory, vllm_lora_rank
from layerswap.engines.planning import SERVING_CHOICES, EnginePlan, Releasing, plan_engines
from layerswap.engines.transformers_engine import TransformersEngine, load_model, model_from_state_dict
from layerswap.engines.vllm_engine import (VLLM_INSTALL_HINT, EngineStartError, LoRAEngine, SwappedEngine,
                                           TensorWeights, VLLMEngine, VLLMSettings, preflight, vllm_device,
                                           vllm_status)
from layerswap.engines.choice import ENGINE_CHOICES, EngineSettings, open_engine, resolve_engine_choice, try_vllm

__all__ = [
    "EnginePlan", "Releasing", "check_memory", "plan_engines",
    "ENGINE_CHOICES", "SERVING_CHOICES", "VLLM_INSTALL_HINT", "Engine", "EngineSettings", "EngineStartError", "OnBatch",
    "LoRAEngine", "SwappedEngine", "TensorWeights", "TokenizingEngine", "TransformersEngine", "VLLMEngine", "VLLMSettings",
    "chat_template_choice", "load_model", "load_tokenizer", "model_from_state_dict", "open_engine",
    "preflight", "resolve_engine_choice", "truncate_at_stop", "try_vllm", "vllm_device", "vllm_lora_rank", "vllm_status",
]
