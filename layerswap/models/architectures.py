"""What layerswap knows about each model architecture, in one table (like mergekit's templates).

Every supported decoder keeps its transformer blocks under ``...layers.N.<module>`` with the
embeddings before and the final norm and lm_head after. An entry says which per-layer parameter
types belong to the attention block and which to the MLP (for ``--modules attention|mlp``, the
heatmap rows and mergekit's filters), in display order, with short labels. Adding an
architecture is one `Architecture(...)` line in `ARCHITECTURES` plus a test that opens a tiny
checkpoint of it (tests/test_architectures.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
NON_LAYER_GROUPS = ("embed", "final_norm", "lm_head")
_BLOCK_PREFIXES = ("self_attn.", "mlp.", "attention.", "feed_forward.")
_LABELS = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "qkv_proj": "qkv",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up",
    "input_layernorm": "attn_norm", "q_norm": "q_norm", "k_norm": "k_norm",
}
_LLAMA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Architecture:
    """One model family: its attention and MLP parameter types (projections first, then norms)."""

    model_type: str
    attention: tuple[str, ...] = _LLAMA_ATTN
    mlp: tuple[str, ...] = _LLAMA_MLP
    attention_norms: tuple[str, ...] = ("input_layernorm",)
    mlp_norms: tuple[str, ...] = ("post_attention_layernorm",)
    labels: dict[str, str] = field(default_factory=dict)  # overrides of the shared short labels
    tested: bool = True

    @property
    def order(self) -> tuple[str, ...]:
        """Display order of the per-layer parameter types (heatmap rows, top to bottom)."""
        return self.attention + self.mlp + self.attention_norms + self.mlp_norms

    def group(self, ptype: str) -> str | None:
        """``attention`` or ``mlp`` for a per-layer parameter type (``q_proj.bias`` goes with q_proj)."""
        base = ptype.split(".")[0]
        if base in self.attention or base in self.attention_norms:
            return "attention"
        if base in self.mlp or base in self.mlp_norms:
            return "mlp"
        return None

    def label(self, ptype: str) -> str:
        base, _, rest = ptype.partition(".")
        short = self.labels.get(base) or _LABELS.get(base) or ("mlp_norm" if base in self.mlp_norms else base)
        return f"{short}.{rest}" if rest else short

    def sort_key(self, ptype: str) -> tuple[int, str]:
        order = self.order
        return (order.index(ptype) if ptype in order else len(order), ptype)

    def mergekit_filters(self, group: str) -> tuple[str, ...]:
        """Substrings of tensor names that select a group in a mergekit parameter list."""
        if group == "attention":
            return ("self_attn", *self.attention_norms)
        return ("mlp", *self.mlp_norms)


_GEMMA_NORMS = dict(attention_norms=("input_layernorm", "post_attention_layernorm"),
                    mlp_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
                    labels={"post_attention_layernorm": "attn_post_norm", "pre_feedforward_layernorm": "mlp_norm",
                            "post_feedforward_layernorm": "mlp_post_norm"})
_OLMO2_NORMS = dict(attention=_LLAMA_ATTN + ("q_norm", "k_norm"), attention_norms=("post_attention_layernorm",),
                    mlp_norms=("post_feedforward_layernorm",),
                    labels={"post_attention_layernorm": "attn_post_norm", "post_feedforward_layernorm": "mlp_post_norm"})

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama"),
    Architecture("mistral"),
    Architecture("qwen2"),  # q/k/v biases are types of their own (q_proj.bias), grouped with their projection
    Architecture("qwen3", attention=_LLAMA_ATTN + ("q_norm", "k_norm")),
    Architecture("gemma"),
    Architecture("gemma2", **_GEMMA_NORMS),
    Architecture("gemma3_text", attention=_LLAMA_ATTN + ("q_norm", "k_norm"), **_GEMMA_NORMS),
    Architecture("olmo2", **_OLMO2_NORMS),
    Architecture("phi3", attention=("qkv_proj", "o_proj"), mlp=("gate_up_proj", "down_proj")),
)}
# Anything else is read with the Llama layout and reported as untested.
FALLBACK = Architecture("unknown", tested=False)


def architecture(model_type: str) -> Architecture:
    """The table entry for a config's ``model_type`` (the Llama layout, marked untested, if unknown)."""
    return ARCHITECTURES.get(model_type, FALLBACK)


def classify(name: str, num_layers: int) -> tuple[int | None, str]:
    """Map a tensor name to ``(layer index or None, parameter type)``.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``(3, "q_proj")``; biases keep a suffix
    (``q_proj.bias``). Tensors outside the blocks get ``None`` and one of ``embed``,
    ``final_norm``, ``lm_head`` or ``other``.
    """
    m = LAYER_RE.search(name)
    if m and int(m.group(1)) < num_layers:
        rest = m.group(2)
        for prefix in _BLOCK_PREFIXES:
            if rest.startswith(prefix):
                rest = rest[len(prefix):]
                break
        if rest.endswith(".weight"):
            rest = rest[: -len(".weight")]
        return int(m.group(1)), rest
    if "embed" in name or name.endswith("wte.weight"):
        return None, "embed"
    if name.startswith("lm_head") or name.endswith("lm_head.weight"):
        return None, "lm_head"
    if "norm" in name:
        return None, "final_norm"
    return None, "other"
