"""The planner: where each tensor of a merge comes from. Every view of a merge asks this module.

    src = Sources(recipe, num_layers, arch)
    src.source(3, "q_proj")          # TensorSource(kind="copy", role="lang") ...
    src.of(names)                    # name -> TensorSource, for every tensor of a checkpoint
    src.layers()                     # one TensorSource per layer (the layer strip)

A tensor is a **copy** (of the math expert, the language expert or the base model), a **blend**
``(1-w)*math + w*lang`` (`methods.linear`), or computed by the recipe's **method** (soup, task
arithmetic, TIES, DARE: every tensor). For a layer map (`Plan`), the weight ``w`` of a tensor is
the plan's (`Plan.tensor_weight`: its layer's weight, 0 for the part a per-module plan leaves to
the math expert, the non-layer rule outside the layers); ``w == 0`` or ``1`` is a copy. A layer
the plan reverts takes every tensor from the base model, whatever the map says.

Consumers: the in-memory merge and the export (`merging`), the merged-model statistics
(`analysis`: a base copy is the base, so its numbers are known exactly), the layer strip and the
heatmap overlay (`plots`), the mergekit config (`interop`), the model card (`card`) and the
workbench's memory check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from layerswap.models.architectures import Architecture, classify
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe, as_recipe

if TYPE_CHECKING:
    from layerswap.models.checkpoints import Checkpoint

BASE_LABEL = "base model (fine-tuning reverted)"


def source_label(w: float) -> str:
    """A language-expert weight in words: math expert, language expert, or the blend."""
    if w == 1.0:
        return "language expert"
    if w == 0.0:
        return "math expert"
    return f"blend {w:.2f} lang / {1 - w:.2f} math"


@dataclass(frozen=True)
class TensorSource:
    """How one output tensor is made: ``copy`` (from `role`: math, lang or base), ``blend`` (language
    weight `w`) or ``method`` (the recipe's method, on every tensor)."""

    kind: str
    role: str | None = None
    w: float | None = None

    @property
    def from_base(self) -> bool:
        return self.kind == "copy" and self.role == "base"

    @property
    def w_lang(self) -> float | None:
        """The language expert's weight (0 for a math copy, 1 for a language copy); None for a base copy or a method."""
        if self.kind == "blend":
            return self.w
        if self.kind == "copy" and self.role != "base":
            return float(self.role == "lang")
        return None

    def label(self, method_title: str = "merge method") -> str:
        if self.from_base:
            return BASE_LABEL
        if self.kind == "method":
            return method_title
        return source_label(self.w_lang)


FROM_BASE = TensorSource("copy", "base")
METHOD = TensorSource("method")


def from_weight(w: float) -> TensorSource:
    """The source of a tensor with language weight `w`: a copy at 0 or 1, a blend between."""
    if w == 0.0:
        return TensorSource("copy", "math")
    if w == 1.0:
        return TensorSource("copy", "lang")
    return TensorSource("blend", w=float(w))


class Sources:
    """Where every tensor of `recipe`'s merge comes from, for a model of `num_layers` layers (`arch` says
    which parameter types are attention or MLP; default Llama's). The recipe is validated against the model."""

    def __init__(self, recipe: Recipe | Plan, num_layers: int, arch: Architecture | None = None):
        self.recipe = as_recipe(recipe)
        self.recipe.validate(num_layers)
        self.num_layers = num_layers
        self.arch = arch
        self.plan: Plan | None = self.recipe.plan
        self.layer_weights: list[float] | None = self.plan.layer_weights(num_layers) if self.plan else None
        self.reverted: frozenset[int] = self.plan.reverted() if self.plan else frozenset()

    def source(self, layer: int | None, ptype: str) -> TensorSource:
        """The source of the tensor of parameter type `ptype` in `layer` (None: outside the layers)."""
        if self.plan is None:
            return METHOD
        if layer is not None and layer in self.reverted:
            return FROM_BASE
        return from_weight(self.plan.tensor_weight(layer, ptype, self.layer_weights, self.arch))

    def of(self, names: Iterable[str]) -> dict[str, TensorSource]:
        """The source of every named tensor (names are classified with `architectures.classify`)."""
        return {n: self.source(*classify(n, self.num_layers)) for n in names}

    def layers(self) -> list[TensorSource]:
        """Per layer, the source of the tensors the map applies to (a per-module plan leaves the rest to
        the math expert): what the layer strip shows."""
        if self.plan is None:
            return [METHOD] * self.num_layers
        return [FROM_BASE if i in self.reverted else from_weight(w) for i, w in enumerate(self.layer_weights)]

    def non_layer_weights(self, names: Iterable[str]) -> dict[str, float]:
        """The language weight of every tensor outside the layers (empty for methods without a map)."""
        return {n: s.w_lang for n, s in self.of(names).items()
                if classify(n, self.num_layers)[0] is None and s.w_lang is not None}

    @property
    def method_title(self) -> str:
        return f"{self.recipe.method.spec.title} on every tensor"

    def describe(self) -> str:
        """One line per run of layers with the same source, e.g. ``layers 0-4: language expert``."""
        if self.plan is None:
            m = self.recipe.method
            return f"{m.describe()} on every tensor: {m.spec.description}"
        part = "" if self.plan.modules == "all" else f" ({self.plan.modules} only; the rest from the math expert)"
        layers, runs, start = self.layers(), [], 0
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or layers[i] != layers[start]:
                runs.append((start, i - 1, layers[start]))
                start = i
        return "\n".join((f"layers {a}-{b}: " if a != b else f"layer {a}: ") + s.label()
                         + (part if s.w_lang else "") for a, b, s in runs)


def tensor_sources(names: Iterable[str], num_layers: int, recipe: Recipe | Plan,
                   arch: Architecture | None = None) -> dict[str, TensorSource]:
    """The source of every tensor name (`Sources.of`)."""
    return Sources(recipe, num_layers, arch).of(names)


def tensor_weights(ck: "Checkpoint", recipe: Recipe | Plan) -> dict[str, float | None]:
    """The language expert's weight of every tensor of `ck` (None where the tensor is the base's, or a method's)."""
    return {n: s.w_lang for n, s in tensor_sources(ck.tensors, ck.num_layers, recipe, ck.arch).items()}
