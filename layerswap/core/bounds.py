"""Bounds on the values a recipe takes: number ranges, and the caps that keep layer indices, per-layer lists
and text small enough to check before anything is expanded or allocated.

`Range` is what `plans` and `methods` check their parameters against and what the recipe-field table
(`layerswap.recipe.fields`) reads loose values with, so a range is written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from layerswap.core.errors import UserError

MAX_LAYERS = 4096  # no model has more layers: layer indices, counts and per-layer lists stay below it
MAX_CONFIG_INT = 2**27  # a config's sizes (hidden, heads, vocabulary, positions): far above any model's
MAX_EPS = 1.0  # a config's norm epsilon (rms_norm_eps): finite, positive, at most this
MAX_TOKENIZER_BYTES = 64 * 2**20  # one tokenizer file (tokenizer.json, tokenizer_config.json, vocab.json, ...)
TOKENIZER_BYTES_PER_TOKEN = 1024  # ... and at most this per token of the config's vocab_size (1 MiB at least)
CONFIG_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings")  # what layerswap reads from a config and computes with


@dataclass(frozen=True)
class Range:
    """``lo <= x <= hi`` (an end marked open excludes it); NaN is never inside."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        x = float(x)
        if math.isnan(x):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def text(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def check(self, x: float, what: str) -> None:
        """UserError ``WHAT must lie in [lo, hi] (got X).`` when `x` is outside."""
        if x not in self:
            raise UserError(f"{what} must lie in {self.text()} (got {x}).")


UNIT = Range(0.0, 1.0)  # weights and shares
LORA_ALPHA = Range(0.0, 65536.0, lo_open=True)  # a LoRA adapter's lora_alpha and alpha_pattern values
# a model's chat template (`engines.chat.render_chat`): its source, one render's output and variables, the lines
# it runs and its wall-clock time; real templates are a few thousand characters and run a few hundred lines
MAX_TEMPLATE_SOURCE = 200_000
MAX_TEMPLATE_CHARS = 1_000_000
MAX_TEMPLATE_STEPS = 100_000
MAX_TEMPLATE_SECONDS = 2.0


def whole(v: object, top: int) -> bool:
    """A whole number from 1 to `top` (a boolean is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= top


def tokenizer_bytes(vocab_size: int | None) -> int:
    """The most bytes one tokenizer file may hold for a model of `vocab_size` tokens (None: not known): real
    tokenizers hold 30 to 130 bytes per token (Llama 3's tokenizer.json 9 MB for 128k, Gemma 3's 33 MB for 262k)."""
    if vocab_size is None:
        return MAX_TOKENIZER_BYTES
    return min(MAX_TOKENIZER_BYTES, max(2**20, TOKENIZER_BYTES_PER_TOKEN * vocab_size))
