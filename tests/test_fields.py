"""The recipe-field table: every way of giving a recipe (CLI flags, share links, loose values, files) is
read from it, and each value is bounded before it is expanded."""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qsl

import pytest

from layerswap import MethodConfig, Plan, Recipe, UserError
from layerswap.cli import build_parser
from layerswap.recipe.fields import FIELDS, LINK_KEYS, METHOD_PARAMS, PLAN_FILE_KEYS
from layerswap.ui import controls


def test_the_table_covers_every_plan_and_method_field():
    assert set(PLAN_FILE_KEYS) == {f.name for f in dataclasses.fields(Plan)}
    assert set(METHOD_PARAMS) == {f.name for f in dataclasses.fields(MethodConfig)} - {"name"}
    assert len(set(LINK_KEYS)) == len(LINK_KEYS) == len(FIELDS)
    # the share links (and the app's inputs) keep their order: API clients and shared links must not break
    assert LINK_KEYS == ("b", "u", "tb", "tu", "transition", "tw", "non_layer", "kind", "weights", "k", "seed",
                         "offset", "modules", "method", "weight", "lam", "density", "drop_rate", "expert_weights",
                         "revert")


def test_cli_flags_come_from_the_table():
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    merge = {o: a.dest for a in sub["merge"]._actions for o in a.option_strings}
    for f in FIELDS:
        assert merge[f.flag] == f.dest, f.flag
    diff = {o for a in sub["diff"]._actions for o in a.option_strings}  # the plan flags only
    assert {f.flag for f in FIELDS if f.group != "method"} <= diff and "--method" not in diff
    ns = build_parser().parse_args(["merge", "--math", "m", "--lang", "l", "-o", "o", "--lambda", "0.5",
                                    "--map-k", "3", "--revert", "1-2"])
    assert (ns.lam, ns.map_k, ns.revert) == (0.5, 3, "1-2")


@pytest.mark.parametrize("values, message", [
    ({"revert": "0-2000000000"}, "Layer 2000000000 is outside 4096 layers"),
    ({"revert": "0-10**12"}, "Layers are written like"),
    ({"revert": "1," * 70000}, "revert is at most 131,072 characters"),
    ({"b": 10**9}, "b must be a whole number from 0 to 4,096"),
    ({"b": 2.5}, "b must be a whole number"),
    ({"transition_weight": float("nan")}, "finite number"),
    ({"transition_weight": 1.5}, "transition weight must lie in"),
    ({"layer_weights": ",".join(["0.5"] * 5000)}, "at most"),
    ({"seed": 2**70}, "seed must be a whole number"),
    ({"kind": "zigzag"}, "layer map must be one of"),
    ({"method": "slerp"}, "merge method must be one of"),
    ({"method": "task_arithmetic", "expert_weights": "1,2,3"}, "expert weights take two numbers"),
    ({"method": "ties", "lam": 1e9}, "lambda must lie in"),
    ({"bottom": 2}, "Unknown recipe value bottom"),
])
def test_loose_values_are_bounded_before_use(values, message):
    with pytest.raises(UserError, match=message):
        Recipe.from_values(**values)


def test_share_links_read_through_the_table():
    values = [2, 1, 1, 0, "ramp", 0.25, "avg", "swap", "", 4, 7, 0, "mlp", "layer_swap", 0.5, 1.0, 0.2, 0.9, "1,1", "3-4"]
    q = controls.query_string(("b/", "m/", "l/"), values)
    updates, tab = controls.restore(dict(parse_qsl(q.lstrip("?"))))
    assert tab == "build" and [u.get("value", v) for u, v in zip(updates, values)] == values
    assert controls.recipe(*values).plan == Plan(b=2, u=1, tb=1, tu=0, transition="ramp", transition_weight=0.25,
                                                 non_layer="avg", k=4, seed=7, modules="mlp", revert=(3, 4))
    hostile = {"revert": "0-2000000000", "b": "1e300", "tw": "nan", "kind": "x" * 10**6, "seed": "2" * 40,
               "weights": "0.5," * 10**5, "method": "../etc", "tab": "nowhere"}
    updates, tab = controls.restore(hostile)
    assert tab is None and all("value" not in u for u in updates)  # each refused by its field, none applied
