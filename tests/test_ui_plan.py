"""A typed plan through the page: each event reads the plan controls into one `Recipe`, once, and that Recipe (with
its one `Sources` for the page) is what every handler and the merge get; no handler parses the controls' values.

The events run in process on the demo models (transformers), through the same `Context.job` wrappers the page wires.
"""

from __future__ import annotations

import ast
import inspect
from collections import Counter

import gradio as gr
import pytest

from layerswap.recipe.fields import LINK_KEYS
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.recipe.sources import Sources
from tests.helpers import REPO

CONTROLS = dict(b=2, u=1, tb=1, tu=1, transition="ramp", tw=0.5, non_layer="neighbour", kind="swap", weights="", k=4,
                seed=0, offset=0, modules="all", method="layer_swap", weight=0.5, lam=1.0, density=0.2, drop_rate=0.9,
                expert_weights="1,1", revert="")


def values(**changed) -> list:
    """The plan controls' values as the page sends them (`LINK_KEYS` order)."""
    return [{**CONTROLS, **changed}[k] for k in LINK_KEYS]


def no_bar(fraction, desc=""):
    pass


@pytest.fixture(scope="module")
def ctx():
    from layerswap.engines.choice import EngineSettings
    from layerswap.ui.context import AppDefaults, Context

    c = Context(AppDefaults(math="assets:demo/math", lang="assets:demo/lang", base="assets:demo/base",
                            engine=EngineSettings(engine="transformers", device="cpu")))
    c.start_loading()  # as the served page does: the models load (and the opening plan is built) behind it
    c.shared.wait_ready()
    yield c
    c.shared.close()


@pytest.fixture
def seen(monkeypatch):
    """What one event does with the plan: each `Recipe.from_values` call and its result, each `Recipe` made, and the
    recipe object each `Sources` is made from."""
    seen = {"read": [], "made": Counter(), "sources": []}
    from_values = Recipe.from_values.__func__

    def counted_read(cls, **kw):
        r = from_values(cls, **kw)
        seen["read"].append(r)
        return r

    post_init, sources_init = Recipe.__post_init__, Sources.__init__

    def counted_recipe(self):
        seen["made"]["Recipe"] += 1
        post_init(self)

    def counted_sources(self, recipe, *a, **kw):
        seen["sources"].append(recipe)
        sources_init(self, recipe, *a, **kw)

    monkeypatch.setattr(Recipe, "from_values", classmethod(counted_read))
    monkeypatch.setattr(Recipe, "__post_init__", counted_recipe)
    monkeypatch.setattr(Sources, "__init__", counted_sources)
    return seen


def test_a_build_reads_the_controls_once_and_merges_that_recipe(ctx, seen):
    from layerswap.ui.tabs.build import build

    handler = ctx.job(build, plan=True, models=True)
    handler(None, no_bar, *values(b=1), "")  # the engines start and a first plan is built
    wb = ctx.shared.loaded(ctx.key)
    for v in ("read", "sources"):
        seen[v].clear()
    seen["made"].clear()

    strip, md, share = handler(None, no_bar, *values(b=3, tb=2, revert="5"), "")
    (read,) = seen["read"]  # the controls read once
    assert seen["made"]["Recipe"] == 1  # and no other Recipe made in the event
    # the plan controls reached the merge as that very Recipe
    assert wb.recipe is read
    assert wb.recipe == Recipe(plan=Plan(b=3, u=1, tb=2, tu=1, transition="ramp", k=4, revert=(5,)))
    assert "merged" in wb.engines
    # one Sources for the page (check, strip and text), one for the merge: each made from the controls' Recipe
    assert len(seen["sources"]) == 2 and all(r is read for r in seen["sources"])
    assert "**Built" in md and "swap b=3 u=1 tb=2 tu=1 (ramp)" in md and "layer 5: base model" in md
    assert "b=3" in share and "tb=2" in share and "revert=5" in share and "tab=build" in share


def test_every_plan_event_reads_the_controls_once(ctx, seen):
    from layerswap.ui.tabs import analysis, ask, build, evaluate, models

    events = {  # name: (handler, its other inputs before the plan, does it take the page's models)
        "preview": (build.preview, [], False),
        "export_yaml": (build.export_yaml, [], True),
        "yaml_written": (build.yaml_written, [], False),
        "first_view": (models.first_view, [], True),
        "share_link": (models.share_link, ["analysis", ""], False),
        "heatmap": (analysis.view, [["math", "lang", "merged"], "relative", "cosine", 1.0, "raw", ""], True),
        "evaluate": (evaluate.evaluate, [["xx"], ["merged"], 1, 0, "native_cot", 16], True),
        "ask": (ask.ask, ["xx", 0, "", 16], True),
    }
    done = {}
    for name, (fn, before, takes_models) in events.items():
        seen["read"].clear()
        seen["sources"].clear()
        out = ctx.job(fn, plan=True, models=takes_models)(None, no_bar, *before, *values(u=2),
                                                           *([""] if takes_models else []))
        if inspect.isgenerator(out):
            out = list(out)[-1]
        assert len(seen["read"]) == 1, name
        if name != "heatmap":  # the analysis is given the recipe's plan (its statistics and overlay are of a Plan)
            assert all(r is seen["read"][0] for r in seen["sources"]), name
        if name in ("preview", "first_view", "share_link", "yaml_written"):  # nothing merged: at most the page's
            assert len(seen["sources"]) <= 1, name
        done[name] = out
    assert done["evaluate"][0].startswith("**Done:** 1 answers") and "u=2" in done["heatmap"][1]
    assert "u=2" in done["share_link"] and "tab=analysis" in done["share_link"]
    assert "swap b=2 u=2 tb=1 tu=1 (ramp)" in ctx.shared.loaded(ctx.key).recipe.title()  # Ask built the plan


def test_a_refused_plan_is_said_where_the_recipe_is_asked_for(ctx):
    from layerswap.ui.tabs.build import build, preview

    strip, md = ctx.job(preview, plan=True, clear_stop=False)(None, no_bar, *values(transition="zigzag"))
    assert strip is None and md.startswith("**Invalid plan:** transition must be one of flat, ramp")
    with pytest.raises(gr.Error, match="transition must be one of flat, ramp"):
        ctx.job(build, plan=True, models=True)(None, no_bar, *values(transition="zigzag"), "")


def test_the_api_still_names_every_plan_control(ctx):
    from layerswap.ui.tabs.analysis import view
    from layerswap.ui.tabs.build import build

    names = list(inspect.signature(ctx.job(build, plan=True, models=True)).parameters)
    assert names == ["request", "progress", *LINK_KEYS, "page_models"]
    names = list(inspect.signature(ctx.job(view, plan=True, models=True)).parameters)
    assert names[2:7] == ["panels", "metric", "overlap_metric", "k", "norm"] and "plan_k" in names  # no clash


def test_no_handler_parses_the_controls_values():
    """Only `ui.controls.read_plan` turns the controls' values into a recipe; the handlers get it made."""
    offenders = []
    for path in sorted((REPO / "layerswap" / "ui").rglob("*.py")):
        if path.name == "controls.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("recipe", "from_values", "read_plan"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}()")
        for node in ast.walk(ast.parse(path.read_text())):  # and no tab's handler takes them as *values
            vararg = node.args.vararg if isinstance(node, ast.FunctionDef) else None
            if path.parent.name == "tabs" and vararg is not None and "values" in vararg.arg:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}(*{vararg.arg})")
    assert offenders == [], offenders
