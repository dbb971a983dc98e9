"""Layer-swap plans: which layer comes from which expert.

A plan compiles to one weight per transformer layer, ``w_lang[i]`` in [0, 1]
(1 = language expert, 0 = math expert). The default kind, ``swap``, is the paper's recipe.
For L layers and a plan (b, u, tb, tu):

    layers 0 .. b-1 and L-u .. L-1          1.0   (swapped in from the language expert)
    layers b+tb .. L-u-tu-1                  0.0   (kept from the math expert)
    bottom transition b .. b+tb-1, k=1..tb   ramp: 1 - k/(tb+1)   flat: transition_weight
    top transition L-u-tu .. L-u-1, k=1..tu  ramp: k/(tu+1)       flat: transition_weight

Tensors outside the blocks follow ``non_layer``:
    neighbour (default)  embeddings take layer 0's weight; final norm, lm_head (and any other
                         non-layer tensor) take layer L-1's
    math / lang / avg    0.0 / 1.0 / 0.5

Other kinds of map, for ablations (one plan type carries them all, so strip plots, export
and mergekit YAML work for every one):
    weights       explicit ``weights`` (one per layer)
    middle        the middle ``k`` layers from the language expert
    random        ``k`` layers drawn with ``random.Random(seed)``
    alternating   every other layer from the language expert, starting at layer ``offset``

``revert`` names layers whose every tensor comes from the **base** model instead: the layer's
fine-tuning update is reverted (Bandarkar & Peng 2025, arXiv 2505.18356: reverting less useful
updates after training beats freezing them). It applies to any kind of map and overrides it for
those layers (the planner, `layerswap.recipe.sources`, applies it for every view); merging it needs the base.

``modules`` applies a map to part of each layer only: ``attention`` (q, k, v, o and the
attention norm) or ``mlp`` (gate, up, down and the MLP norm), as the architecture table
(`layerswap.models.architectures`) groups them; the other part stays with the math expert.

The paper (Bandarkar et al., 2025) leaves the treatment of embeddings, lm_head and the
transition weights unverified in the public text; these options make the choice explicit.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Literal

from layerswap.models.architectures import Architecture, architecture
from layerswap.core.bounds import MAX_LAYERS, UNIT
from layerswap.core.errors import UserError

Transition = Literal["flat", "ramp"]
NonLayer = Literal["neighbour", "math", "lang", "avg"]
Kind = Literal["swap", "weights", "middle", "random", "alternating"]
Modules = Literal["all", "attention", "mlp"]
TRANSITIONS = ("flat", "ramp")
NON_LAYER_OPTIONS = ("neighbour", "math", "lang", "avg")
KINDS = ("swap", "weights", "middle", "random", "alternating")
MODULES = ("all", "attention", "mlp")
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
    kind: Kind = "swap"
    weights: tuple[float, ...] | None = None
    k: int = 0
    seed: int = 0
    offset: int = 0
    modules: Modules = "all"
    revert: tuple[int, ...] = ()

    def validate(self, num_layers: int) -> None:
        """Raise UserError with the limit when the plan cannot apply to `num_layers` layers."""
        if self.kind not in KINDS:
            raise UserError(f"kind must be one of {', '.join(KINDS)} (got {self.kind!r}).")
        if self.modules not in MODULES:
            raise UserError(f"modules must be one of {', '.join(MODULES)} (got {self.modules!r}).")
        if self.non_layer not in NON_LAYER_OPTIONS:
            raise UserError(f"non_layer must be one of {', '.join(NON_LAYER_OPTIONS)} (got {self.non_layer!r}).")
        bad = [i for i in self.revert if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
        if bad:
            raise UserError(f"revert names layers 0 to {num_layers - 1} of this model (got {bad[0]!r}).")
        if self.kind == "weights":
            if self.weights is None or len(self.weights) != num_layers:
                n = "none" if self.weights is None else len(self.weights)
                raise UserError(f"kind 'weights' needs one weight per layer: {num_layers} for this model (got {n}).")
            for w in self.weights:
                UNIT.check(w, "layer weights")
            return
        if self.kind in ("middle", "random"):
            if not isinstance(self.k, int) or not 0 <= self.k <= num_layers:
                raise UserError(f"k must be a whole number from 0 to the model's {num_layers} layers (got {self.k!r}).")
            return
        if self.kind == "alternating":
            if self.offset not in (0, 1):
                raise UserError(f"offset must be 0 or 1 (got {self.offset!r}).")
            return
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
        UNIT.check(self.transition_weight, "transition_weight")

    def layer_weights(self, num_layers: int) -> list[float]:
        """``w_lang`` for every layer (1 = language expert, 0 = math expert)."""
        self.validate(num_layers)
        L = num_layers
        if self.kind == "weights":
            return [float(w) for w in self.weights]
        if self.kind == "middle":
            start = (L - self.k) // 2
            return [1.0 if start <= i < start + self.k else 0.0 for i in range(L)]
        if self.kind == "random":
            chosen = set(random.Random(self.seed).sample(range(L), self.k))
            return [1.0 if i in chosen else 0.0 for i in range(L)]
        if self.kind == "alternating":
            return [1.0 if i % 2 == self.offset else 0.0 for i in range(L)]
        b, u, tb, tu = self.b, self.u, self.tb, self.tu
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

    def tensor_weight(self, layer: int | None, ptype: str, layer_weights: list[float],
                      arch: Architecture | None = None) -> float:
        """The weight of one tensor, from its layer (None outside the blocks) and parameter type.

        `arch` (the model's `Architecture`, default Llama's) says which types are attention or MLP.
        """
        if layer is None:
            return self.non_layer_weight(ptype, layer_weights)
        if self.modules != "all" and (arch or architecture("llama")).group(ptype) != self.modules:
            return 0.0
        return layer_weights[layer]

    def title(self) -> str:
        """Short name of the map, e.g. ``swap b=5 u=2 tb=1 tu=1`` or ``middle k=4``."""
        head = {
            "swap": f"swap b={self.b} u={self.u} tb={self.tb} tu={self.tu}"
                    + (f" ({self.transition}" + (f" {self.transition_weight})" if self.transition == "flat" else ")")
                       if self.tb or self.tu else ""),
            "weights": "explicit per-layer weights",
            "middle": f"middle k={self.k}",
            "random": f"random k={self.k} seed={self.seed}",
            "alternating": f"alternating from layer {self.offset}",
        }[self.kind]
        mods = "" if self.modules == "all" else f", {self.modules} only"
        rev = f", revert {format_layers(self.revert)} to base" if self.revert else ""
        return f"{head}{mods}{rev}, non-layer={self.non_layer}"

    def reverted(self) -> frozenset[int]:
        """The layers taken from the base model."""
        return frozenset(self.revert)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["weights"] is not None:
            d["weights"] = list(d["weights"])
        d["revert"] = list(d["revert"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if known.get("weights") is not None:
            known["weights"] = tuple(float(w) for w in known["weights"])
        if "revert" in known:
            known["revert"] = parse_layers(known["revert"])
        return cls(**known)

    def with_(self, **changes) -> "Plan":
        return replace(self, **changes)


def parse_layers(spec, num_layers: int | None = None) -> tuple[int, ...]:
    """Layer numbers from a list of ints or a string like ``"0-2,7"`` (inclusive ranges), sorted, unique.

    Every number must lie in [0, num_layers) (or [0, MAX_LAYERS) when the model is not known yet); a
    range or list beyond that is refused from its bounds, before anything is built."""
    if spec is None:
        return ()
    limit = num_layers or MAX_LAYERS
    where = f"this model's {num_layers} layers (0 to {num_layers - 1})" if num_layers else f"{MAX_LAYERS} layers"

    def check(i: int) -> int:
        if not 0 <= i < limit:
            raise UserError(f"Layer {i} is outside {where}.")
        return i

    if isinstance(spec, int) and not isinstance(spec, bool):
        return (check(spec),)
    if isinstance(spec, str):
        if len(spec) > 16 * limit:
            raise UserError(f"That layer list has {len(spec):,} characters; {where} need far fewer.")
        out: set[int] = set()
        try:
            for part in spec.replace(" ", "").split(","):
                if "-" in part[1:]:
                    lo, hi = (check(int(x)) for x in part.split("-"))
                    out.update(range(lo, hi + 1))
                elif part:
                    out.add(check(int(part)))
        except ValueError:
            raise UserError(f"Layers are written like 0-2,7 (got {spec[:40]!r}).") from None
        return tuple(sorted(out))
    if isinstance(spec, (list, tuple, set, frozenset)):
        if len(spec) > limit or not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise UserError(f"Layers are whole numbers from {where} (got {str(list(spec))[:60]}).")
        return tuple(sorted({check(i) for i in spec}))
    raise UserError(f"Layers are a list of numbers or a string like 0-2,7 (got {str(spec)[:40]!r}).")


def format_layers(layers) -> str:
    """``(0, 1, 2, 7)`` -> ``"0-2,7"``."""
    xs, runs = sorted(layers), []
    for i in xs:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


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
