"""Layer-swap plans: which layer comes from which expert.

A plan compiles to one weight per transformer layer, ``w_lang[i]`` in [0, 1]
(1 = language expert, 0 = math expert). For L layers and a plan (b, u, tb, tu):

    layers 0 .. b-1 and L-u .. L-1          1.0   (swapped in from the language expert)
    layers b+tb .. L-u-tu-1                  0.0   (kept from the math expert)
    bottom transition b .. b+tb-1, k=1..tb   ramp: 1 - k/(tb+1)   flat: transition_weight
    top transition L-u-tu .. L-u-1, k=1..tu  ramp: k/(tu+1)       flat: transition_weight

Tensors outside the blocks follow ``non_layer``:
    neighbour (default)  embeddings take layer 0's weight; final norm, lm_head (and any other
                         non-layer tensor) take layer L-1's
    math / lang / avg    0.0 / 1.0 / 0.5

The paper (Bandarkar et al., 2025) leaves the treatment of embeddings, lm_head and the
transition weights unverified in the public text; these options make the choice explicit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from .errors import UserError

Transition = Literal["flat", "ramp"]
NonLayer = Literal["neighbour", "math", "lang", "avg"]
TRANSITIONS = ("flat", "ramp")
NON_LAYER_OPTIONS = ("neighbour", "math", "lang", "avg")
_FIXED = {"math": 0.0, "lang": 1.0, "avg": 0.5}


@dataclass(frozen=True)
class Plan:
    """A layer-swap recipe. Defaults are the literature's 32-layer setting: b=5, u=2, tb=1, tu=1."""

    b: int = 5
    u: int = 2
    tb: int = 1
    tu: int = 1
    transition: Transition = "flat"
    transition_weight: float = 0.5
    non_layer: NonLayer = "neighbour"

    def validate(self, num_layers: int) -> None:
        """Raise UserError with the limit when the plan cannot apply to `num_layers` layers."""
        for k in ("b", "u", "tb", "tu"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"{k} must be a whole number >= 0 (got {v!r}).")
        total = self.b + self.tb + self.tu + self.u
        if total > num_layers:
            raise UserError(
                f"b + tb + tu + u = {self.b}+{self.tb}+{self.tu}+{self.u} = {total} exceeds the model's "
                f"{num_layers} layers; reduce them so the sum is at most {num_layers}."
            )
        if self.transition not in TRANSITIONS:
            raise UserError(f"transition must be one of {', '.join(TRANSITIONS)} (got {self.transition!r}).")
        if not (0.0 <= float(self.transition_weight) <= 1.0):
            raise UserError(f"transition_weight must lie in [0, 1] (got {self.transition_weight}).")
        if self.non_layer not in NON_LAYER_OPTIONS:
            raise UserError(f"non_layer must be one of {', '.join(NON_LAYER_OPTIONS)} (got {self.non_layer!r}).")

    def layer_weights(self, num_layers: int) -> list[float]:
        """``w_lang`` for every layer (1 = language expert, 0 = math expert)."""
        self.validate(num_layers)
        L, b, u, tb, tu = num_layers, self.b, self.u, self.tb, self.tu
        w = [0.0] * L
        for i in range(b):
            w[i] = 1.0
        for i in range(L - u, L):
            w[i] = 1.0
        for k in range(1, tb + 1):
            w[b + k - 1] = 1 - k / (tb + 1) if self.transition == "ramp" else float(self.transition_weight)
        for k in range(1, tu + 1):
            w[L - u - tu + k - 1] = k / (tu + 1) if self.transition == "ramp" else float(self.transition_weight)
        return w

    def non_layer_weight(self, group: str, layer_weights: list[float]) -> float:
        """Weight of a tensor outside the blocks; `group` is embed, final_norm, lm_head or other."""
        if self.non_layer == "neighbour":
            return layer_weights[0] if group == "embed" else layer_weights[-1]
        return _FIXED[self.non_layer]

    def tensor_weight(self, layer: int | None, ptype: str, layer_weights: list[float]) -> float:
        return layer_weights[layer] if layer is not None else self.non_layer_weight(ptype, layer_weights)

    def describe(self, num_layers: int) -> str:
        """One line per contiguous run of equal weights, e.g. ``layers 0-4: language expert``."""
        w = self.layer_weights(num_layers)
        runs, start = [], 0
        for i in range(1, num_layers + 1):
            if i == num_layers or w[i] != w[start]:
                runs.append((start, i - 1, w[start]))
                start = i
        return "\n".join(
            f"layers {a}-{b}: {source_label(x)}" if a != b else f"layer {a}: {source_label(x)}" for a, b, x in runs
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def with_(self, **changes) -> "Plan":
        return replace(self, **changes)


def source_label(w: float) -> str:
    if w == 1.0:
        return "language expert"
    if w == 0.0:
        return "math expert"
    return f"blend {w:.2f} lang / {1 - w:.2f} math"


def default_plan(num_layers: int) -> Plan:
    """The literature's b=5, u=2, tb=tu=1 for 32 layers, scaled to `num_layers` (at least 1 each)."""
    if num_layers >= 32:
        return Plan()
    scale = num_layers / 32
    b = max(1, round(5 * scale))
    u = max(1, round(2 * scale))
    tb = tu = 1 if num_layers >= b + u + 3 else 0
    if b + u + tb + tu > num_layers:
        b, u, tb, tu = min(1, num_layers), 0, 0, 0
    return Plan(b=b, u=u, tb=tb, tu=tu)
