"""Generation engines: one interface, ``generate(prompts, max_new_tokens, stop) -> texts``.

`TransformersEngine` runs a loaded ``transformers`` model: batched, greedy, left-padded, with the
tokenizer's chat template when it has one (switchable). Its weights can be swapped in place
(`load_state_dict`), which is how the merged model is refreshed after a re-merge without
reloading anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping, Protocol, runtime_checkable

import torch

from .errors import UserError
from .mgsm import truncate_at_stop


@runtime_checkable
class Engine(Protocol):
    name: str  # which backend answered, shown next to answers

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None) -> list[str]:
        ...


def resolve_device(device: str) -> str:
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
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat_template = has_template if use_chat_template is None else use_chat_template
        if self.use_chat_template and not has_template:
            raise UserError("This tokenizer has no chat template; run without --chat-template (plain prompts).")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str = "cpu", **kw) -> "TransformersEngine":
        return cls(load_model(path, resolve_device(device)), load_tokenizer(path), **kw)

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

    @torch.inference_mode()
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
                stop_strings=stop or None,
                tokenizer=tok if stop else None,
            )
            new = gen[:, enc["input_ids"].shape[1]:]
            for j, i in enumerate(idx):
                outputs[i] = truncate_at_stop(tok.decode(new[j], skip_special_tokens=True), stop)
            if on_batch:
                on_batch(min(start + self.batch_size, len(order)), len(order))
        return outputs


def engine_for(path: str | Path, device: str = "cpu") -> Engine:
    """The engine used to answer with a model folder (the vLLM engine joins here when available)."""
    return TransformersEngine.from_pretrained(path, device)
