"""The transformers engine: a loaded model answering in length-sorted greedy batches, weights swappable in place.

Its weights can be replaced without reloading anything (`TransformersEngine.load_state_dict`),
which is how the merged model is refreshed after a re-merge.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Mapping

from layerswap.models.checkpoints import Checkpoint, text_config
from layerswap.core.errors import UserError
from layerswap.core.runtime import resolve_device
from layerswap.engines.base import OnBatch, TokenizingEngine, chat_template_choice, generate_in_batches, load_tokenizer

if TYPE_CHECKING:  # imported where used, so the CLI starts (and merges copy) without loading torch
    import torch


def size_problem(config: dict, tensor_numel: int) -> str:
    """'' when the model a config describes holds no more numbers than its tensors do; else why it is refused.

    Engines build the model from the config and then load the tensors into it: a config asking for more (a wider
    MLP, a vocabulary its tensors lack) is allocated and initialised first, so a 2 MB repo could ask for 60 GB.
    Counted on the meta device (nothing allocated), for the families of the architecture table (dense models,
    whose module count the bounded layer count caps); other configs, and those transformers cannot build, are left
    to the engines."""
    import json

    from layerswap.models.architectures import ARCHITECTURES

    if text_config(config).get("model_type") not in ARCHITECTURES:
        return ""
    key = json.dumps(config, sort_keys=True, default=str)
    want = _config_numel(key)
    if want is None or want <= 1.05 * tensor_numel + 2**20:
        return ""
    return (f"its config.json describes a model of {want / 1e9:.3g} billion numbers, its weights hold "
            f"{tensor_numel / 1e9:.3g} billion: the config does not match the weights; re-download or re-export it.")


@functools.lru_cache(maxsize=32)
def _config_numel(config_json: str) -> int | None:
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        d = json.loads(config_json)
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:  # an architecture transformers does not build: the engines say so themselves
        return None
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def load_model(model: Checkpoint | str | os.PathLike, device: str = "cpu"):
    """Load a causal LM (an opened `Checkpoint`, or its folder) in its checkpoint dtype, in eval mode, on `device`;
    refused first when its config asks for more than its weights hold (`size_problem`)."""
    from transformers import AutoModelForCausalLM

    ck = model if isinstance(model, Checkpoint) else Checkpoint.open(model)
    problem = size_problem(ck.config, ck.numel)
    if problem:
        raise UserError(f"{ck.ref}: {problem}")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(ck.path), dtype="auto", use_safetensors=True)
    except RuntimeError as e:  # transformers reports each mismatched shape, then raises
        if "ignore_mismatched_sizes" not in str(e):
            raise
        raise UserError(MISMATCH) from None
    return model.to(device).eval()


MISMATCH = ("The model's config.json does not match its tensors' shapes (its sizes say one model, its weights hold "
            "another); re-download or re-export the model.")


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
    try:
        missing, unexpected = model.load_state_dict(dict(state), strict=False, assign=True)
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise
        raise UserError(MISMATCH) from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise UserError(f"Merged weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


class TransformersEngine(TokenizingEngine):
    """Greedy batched generation with a transformers model (`batch_size` prompts of similar length at a time)."""

    name = "transformers"

    def __init__(self, model, tokenizer, *, batch_size: int = 8, use_chat_template: bool | None = None,
                 prefix: "torch.Tensor | None" = None):
        super().__init__(tokenizer, use_chat_template)
        self.model = model
        self.batch_size = batch_size
        self._runner = model  # what generates: the model, or peft's prefix-tuning wrapper around it
        self.set_prefix(prefix)

    def set_prefix(self, table: "torch.Tensor | None") -> None:
        """Answer with a prefix-tuning prefix (``(virtual tokens, layers * 2 * width)``, as peft saves it; peft
        runs it), or without one (None). The model's weights stay where they are (`load_state_dict` still works)."""
        if table is None:
            self._runner = self.model
            return
        try:
            from peft import PeftModelForCausalLM, PrefixTuningConfig
        except ImportError:
            raise UserError("Prefix-tuning experts need peft: pip install peft.") from None
        run = self._runner
        if run is self.model or run.peft_config["default"].num_virtual_tokens != table.shape[0]:
            run = PeftModelForCausalLM(self.model, PrefixTuningConfig(task_type="CAUSAL_LM", inference_mode=True,
                                                                       num_virtual_tokens=int(table.shape[0])))
        emb = run.prompt_encoder["default"].embedding.weight
        if tuple(emb.shape) != tuple(table.shape):
            raise UserError(f"The prefix has shape {tuple(table.shape)}; this model takes {tuple(emb.shape)}.")
        emb.data = table.to(emb.device, self.model.dtype)
        self._runner = run.eval()

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

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: OnBatch | None = None) -> list[str]:
        stop = list(stop or [])
        tok = self.tokenizer
        texts = [self.format(p) for p in prompts]

        def run(idx: list[int]) -> list[str]:
            enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True,
                      add_special_tokens=self.add_special_tokens).to(self.device)
            prompt_len = enc["input_ids"].shape[1]
            gen = self._runner.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                stopping_criteria=[StopOnText(tok, stop, prompt_len)] if stop else None,
            )
            rows = gen[:, prompt_len:].tolist()
            self.tokens_generated += sum(_generated_length(row, tok) for row in rows)
            return [self.decode(row, stop) for row in rows]

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths batch together
        return generate_in_batches(order, self.batch_size, run, on_batch)


class StopOnText:
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


def _generated_length(ids: list[int], tok) -> int:
    """Tokens a row really generated: up to and including EOS, not the padding after it."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for i, t in enumerate(ids):
        if t == eos:
            return i + 1
        if t == pad:
            return i
    return len(ids)
