"""Generation engines behind one small protocol, and the choice of vLLM or transformers.

- `base`: the `Engine` protocol, batching with a per-batch callback, chat formatting, stop strings, the tokenizer.
- `transformers_engine`: `TransformersEngine` (a loaded transformers model, weights swappable in place).
- `vllm_engine`: `VLLMEngine` (pooled per process, live weight refresh from a folder or `TensorWeights`),
  `VLLMSettings`, `SwappedEngine`.
- `sizing`: what one vLLM engine needs (weights, KV cache sized from the model, overhead), `check_memory`.
- `planning`: the engine plan (`plan_engines`, `EnginePlan`): the arrangement, its sizes and costs, on the hardware.
- `family`: a family's engine plan (`family.plan_family`): awake, asleep or reloaded, and the cost of a language switch.
- `choice`: `choose_engines`, the one decision of which engine runs for every caller (a trio's plan, or one
  model's engine), `EngineSettings` (its flags declared once: `ENGINE_FLAGS`) and `open_engine` for one model.
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
from layerswap.engines.choice import (ENGINE_CHOICES, ENGINE_FLAGS, EngineChoice, EngineSettings, choose_engines,
                                     choose_family, open_engine, resolve_engine_choice)

__all__ = [
    "EngineChoice", "EnginePlan", "Releasing", "check_memory", "choose_engines", "choose_family", "plan_engines",
    "ENGINE_CHOICES", "ENGINE_FLAGS", "SERVING_CHOICES", "VLLM_INSTALL_HINT", "Engine", "EngineSettings",
    "EngineStartError", "OnBatch",
    "LoRAEngine", "SwappedEngine", "TensorWeights", "TokenizingEngine", "TransformersEngine", "VLLMEngine", "VLLMSettings",
    "chat_template_choice", "load_model", "load_tokenizer", "model_from_state_dict", "open_engine",
    "preflight", "resolve_engine_choice", "truncate_at_stop", "vllm_device", "vllm_lora_rank", "vllm_status",
]
