"""The plan controls: their values as a recipe, as a shareable query string, and back.

The page sends the same 20 plan values with every event (`PLAN_KEYS` order), so each visitor's
events use that visitor's plan. `query_string` writes them (with the models and tab) for a link;
`restore` reads such a link back into control updates.
"""

from __future__ import annotations

from urllib.parse import urlencode

import gradio as gr

from ..methods import METHODS
from ..plans import KINDS, MODULES, NON_LAYER_OPTIONS
from ..recipes import Recipe
from ..plots import layer_strip
from ..sources import Sources

PLAN_KEYS = ("b", "u", "tb", "tu", "transition", "tw", "non_layer", "kind", "weights", "k", "seed", "offset",
             "modules", "method", "weight", "lam", "density", "drop_rate", "expert_weights", "revert")
_INTS = {"b", "u", "tb", "tu", "k", "seed", "offset"}
_FLOATS = {"tw", "weight", "lam", "density", "drop_rate"}
_CHOICES = {"transition": ("flat", "ramp"), "non_layer": tuple(NON_LAYER_OPTIONS), "kind": tuple(KINDS),
            "modules": tuple(MODULES), "method": tuple(METHODS)}
TABS = ("build", "analysis", "evaluate")


def recipe(b, u, tb, tu, transition, tw, non_layer, kind="swap", layer_weights="", k=0, seed=0, offset=0,
           modules="all", method="layer_swap", weight=0.5, lam=1.0, density=0.2, drop_rate=0.9,
           expert_weights="1,1", revert="") -> Recipe:
    """The recipe of the controls' values (`Recipe.from_values`, validated where it does not need the model)."""
    return Recipe.from_values(method=method, b=b, u=u, tb=tb, tu=tu, transition=transition, transition_weight=tw,
                              non_layer=non_layer, kind=kind, layer_weights=layer_weights, k=k, seed=seed,
                              offset=offset, modules=modules, weight=weight, expert_weights=expert_weights, lam=lam,
                              density=density, drop_rate=drop_rate, revert=revert)


def strip_figure(r: Recipe, num_layers: int):
    """The layer-source strip of the recipe (reverted layers marked)."""
    return layer_strip(r, num_layers)


def plan_md(r: Recipe, num_layers: int, built: bool, short: bool = False) -> str:
    title = r.title() if r.plan is not None else f"{r.method.describe()} on every tensor"
    if short:
        return f"{title}, {num_layers} layers"
    state = "**Built: the merged model answers with this plan.**" if built else \
        "*Preview: built automatically when you ask, evaluate or analyse.*"
    if r.plan is None:
        return f"{state} {title} ({num_layers} layers). {r.method.spec.description}"
    lines = Sources(r, num_layers).describe().replace("\n", "  \n")
    return f"{state} {title} ({num_layers} layers)  \n{lines}"


def query_string(refs: tuple[str, str, str], values, tab: str = "build") -> str:
    """`?base=..&math=..&lang=..&b=..` for the page address: opening it restores this view."""
    q = dict(zip(("base", "math", "lang"), refs))
    q.update({k: v for k, v in zip(PLAN_KEYS, values)})
    q["tab"] = tab
    return "?" + urlencode({k: v for k, v in q.items() if v not in (None, "")})


def restore(params: dict) -> tuple[list, str | None]:
    """Control updates (PLAN_KEYS order) and the tab from a link's query parameters; bad values are ignored."""
    out = []
    for key in PLAN_KEYS:
        raw = params.get(key)
        try:
            if raw is None:
                raise ValueError
            val = int(float(raw)) if key in _INTS else float(raw) if key in _FLOATS else str(raw)[:2000]
            if key in _CHOICES and val not in _CHOICES[key]:
                raise ValueError
            out.append(gr.update(value=val))
        except ValueError:
            out.append(gr.update())
    tab = params.get("tab")
    return out, tab if tab in TABS else None
