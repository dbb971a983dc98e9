"""The lens figures draw the plan through `Sources`: a reverted layer inside the language expert's range is drawn as
the base's, never outlined as the language expert's (they classified layers from the raw layer weights)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from layerswap.analysis.lens.figures import LANG_COLOR, BASE_COLOR, _plan_overlay
from layerswap.analysis.lens.run import LensResult
from layerswap.recipe.methods import MethodConfig
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe


def _result(recipe: Recipe | None, layers: int = 6) -> LensResult:
    return LensResult(prompt="p", language="xx", language_name="Kovani", twin=None, index=None, batch_indices=[],
                      num_layers=layers, rule="r", recipe=recipe, models={}, last_token="")


def _outlined(recipe: Recipe | None, layers: int = 6) -> dict[str, set[int]]:
    fig = make_subplots(rows=2, cols=1)
    for row in (1, 2):  # plotly draws row="all" shapes only on subplots that hold data
        fig.add_trace(go.Scatter(x=list(range(layers)), y=[0.0] * layers), row=row, col=1)
    _plan_overlay(fig, _result(recipe, layers))
    drawn: dict[str, set[int]] = {"lang": set(), "blend": set(), "base": set()}
    for s in fig.layout.shapes:
        span = set(range(round(s.x0 + 0.5), round(s.x1 - 0.5) + 1))
        colour = s.line.color if s.line is not None else None
        kind = "lang" if colour == LANG_COLOR else "base" if colour == BASE_COLOR else "blend"
        drawn[kind] |= span
    return drawn


def test_a_reverted_layer_in_the_language_range_is_drawn_as_the_bases():
    drawn = _outlined(Recipe(plan=Plan(b=3, u=1, tb=1, tu=0, revert=(1,))))
    assert drawn == {"lang": {0, 2, 5}, "blend": {3}, "base": {1}}


def test_plans_without_reverts_and_methods():
    assert _outlined(Recipe(plan=Plan(b=2, u=0, tb=0, tu=0))) == {"lang": {0, 1}, "blend": set(), "base": set()}
    assert _outlined(Recipe(MethodConfig("ties", density=0.3))) == {"lang": set(), "blend": set(), "base": set()}
    assert _outlined(None) == {"lang": set(), "blend": set(), "base": set()}
