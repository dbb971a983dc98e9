"""Recipes: one type for every merge, read and written as YAML/JSON, built from loose CLI/app values."""

from __future__ import annotations

import json

import pytest
import yaml

from layerswap import MethodConfig, Plan, Recipe, UserError
from layerswap.cli import main as cli
from tests.helpers import read_dir

RECIPES = [
    Recipe(plan=Plan(b=2, u=1, tb=1, tu=1, transition="ramp", revert=(3,))),
    Recipe(plan=Plan(kind="weights", weights=(0.25, 1.0, 0.0, 0.5, 1.0, 0.0), modules="mlp")),
    Recipe(plan=Plan(kind="random", k=3, seed=7, non_layer="math")),
    Recipe(MethodConfig("soup", weight=0.3)),
    Recipe(MethodConfig("ties", expert_weights=(0.7, 1.2), density=0.4, lam=0.9)),
    Recipe(MethodConfig("dare_ties", drop_rate=0.3, seed=5)),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.title())
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_files_round_trip(recipe, suffix, tmp_path):
    path = tmp_path / f"r{suffix}"
    text = recipe.dump(path)
    assert path.read_text() == text
    data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    assert data == recipe.to_dict()
    assert Recipe.load(path) == recipe
    assert ("plan" in data) == recipe.method.spec.uses_plan  # no dummy plan for methods without one


def test_hand_written_files(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("method: layer_swap\nplan: {b: 2, u: 1, revert: 3-4}\n")
    r = Recipe.load(f)
    assert r.plan == Plan(b=2, u=1, revert=(3, 4)) and r.needs_base
    f.write_text("method: {name: ties, density: 0.5}\n")
    assert Recipe.load(f) == Recipe(MethodConfig("ties", density=0.5))


@pytest.mark.parametrize("text, message", [
    ("method: soup\nplan: {b: 1}\n", "takes no layer map"),
    ("method: layer_swap\n", "needs a plan"),
    ("method: {name: soup, density: 0.2}\n", "soup does not use density; it takes weight"),
    ("method: blend\n", "unknown merge method 'blend'"),
    ("plan: {b: 1, bottom: 2}\n", "unknown plan key bottom"),
    ("plan: {b: '2'}\n", "plan b is a whole number"),
    ("plan: {b: 1}\nextra: 1\n", "unknown key extra"),
    ("method: {name: soup, weight: 2}\n", "weight must lie in"),
    ("plan: [1, 2]\n", "plan is a mapping"),
    ("method: soup\n  bad: : indent\n", "not valid YAML"),
    # every value is read by its field in the recipe-field table (layerswap.recipe.fields), bounds first
    ("plan: {b: 1, revert: 0-2000000000}\n", "Layer 2000000000 is outside"),
    ("plan: {b: 1, transition_weight: 2}\n", "transition weight must lie in"),
    ("plan: {kind: weights, weights: [0.5, 1.5]}\n", "layer weights must lie in"),
    ("method: {name: ties, density: 0}\n", "density must lie in"),
    ("method: {name: dare_ties, seed: '3'}\n", "method seed is a whole number"),
])
def test_clear_errors(text, message, tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(text)
    with pytest.raises(UserError, match=message):
        Recipe.load(f)


def test_constructor_refuses_a_dummy_plan():
    with pytest.raises(UserError, match="takes no layer map"):
        Recipe(MethodConfig("soup"), Plan())
    with pytest.raises(UserError, match="needs a layer map"):
        Recipe()


def test_from_loose_values():
    r = Recipe.from_values(num_layers=10, method="ties", expert_weights="0.7, 1.2", density="0.4", b=3)
    assert r == Recipe(MethodConfig("ties", expert_weights=(0.7, 1.2), density=0.4))
    r = Recipe.from_values(num_layers=10, b=3.0, transition="ramp", revert="0,8-9")
    assert r.plan == Plan(b=3, u=1, tb=1, tu=1, transition="ramp", revert=(0, 8, 9))  # u, tb, tu: default_plan(10)
    assert Recipe.from_values(layer_weights="1,0.5,0").plan.weights == (1.0, 0.5, 0.0)
    assert Recipe.from_values(kind="swap", layer_weights="1,0.5,0", b=1, u=0, tb=0, tu=0).plan.kind == "swap"
    with pytest.raises(UserError, match="expert weights take two numbers"):
        Recipe.from_values(method="task_arithmetic", expert_weights="1,2,3")
    with pytest.raises(UserError, match="exceeds the model's 4 layers"):
        Recipe.from_values(num_layers=4, b=3, u=2, tb=0, tu=0)


def test_app_keeps_expert_weights():
    from layerswap.ui.controls import recipe

    r = recipe(2, 1, 1, 1, "flat", 0.5, "neighbour", method="task_arithmetic", lam=0.8, expert_weights="0.6,1.3")
    assert r.plan is None and r.method == MethodConfig("task_arithmetic", expert_weights=(0.6, 1.3), lam=0.8)


def test_cli_recipe_file_is_the_flags(trio, tmp_path, capsys):
    f = tmp_path / "r.yaml"
    Recipe(plan=Plan(b=1, u=2, tb=1, tu=0, transition_weight=0.3)).dump(f)
    common = ["--math", str(trio["math"]), "--lang", str(trio["lang"])]
    assert cli(["merge", *common, "--recipe", str(f), "-o", str(tmp_path / "a"), "-q"]) == 0
    assert cli(["merge", *common, "--b", "1", "--u", "2", "--tb", "1", "--tu", "0", "--transition-weight", "0.3",
                "-o", str(tmp_path / "b"), "-q"]) == 0
    a, b = read_dir(tmp_path / "a"), read_dir(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert cli(["export-yaml", *common, "--recipe", str(f), "-o", str(tmp_path / "m.yml")]) == 0
    capsys.readouterr()
    assert cli(["merge", *common, "--recipe", str(f), "--b", "2", "-o", str(tmp_path / "c")]) == 2
    assert "already says the whole recipe; drop --b" in capsys.readouterr().err


# ---- the base guard: one refusal, raised by `Recipe.require_base` wherever a merge needs the base ------------

def test_the_base_guard_says_why_and_what_to_do():
    Recipe(plan=Plan(b=1, u=1, tb=1, tu=1)).require_base(False)  # nothing to refuse
    Recipe(MethodConfig("ties", density=0.2)).require_base(True)
    with pytest.raises(UserError, match=r"^TIES works on task vectors \(expert minus base\): pass --base \(the model "
                                        r"both experts were fine-tuned from\)\.$"):
        Recipe(MethodConfig("ties", density=0.2)).require_base(False)
    with pytest.raises(UserError, match=r"^the plan reverts layer 2 to the base model: load it\.$"):
        Recipe(plan=Plan(b=1, u=1, tb=1, tu=1, revert=(2,))).require_base(False, "load it")


def test_the_base_guard_is_raised_in_one_place():
    """No module but `recipes` words the refusal (`base_reason` is asked only by `Recipe.require_base`)."""
    from tests.helpers import REPO

    askers = sorted(str(p.relative_to(REPO)) for p in (REPO / "layerswap").rglob("*.py")
                    if "base_reason()" in p.read_text())
    assert askers == ["layerswap/recipe/recipes.py"]


@pytest.mark.parametrize("command, flags, said", [
    ("merge", ["--method", "task_arithmetic"], "Task arithmetic works on task vectors (expert minus base)"),
    ("lens", ["--b", "1", "--u", "1", "--tb", "1", "--tu", "1", "--revert", "0,3", "--mgsm-lang", "sw",
      "--question", "2+2?"],
     "the plan reverts layers 0,3 to the base model"),
])
def test_a_command_without_the_base_it_needs_says_so(trio, tmp_path, capsys, command, flags, said):
    out = tmp_path / ("out.html" if command == "lens" else "out")
    rc = cli([command, "--math", str(trio["math"]), "--lang", str(trio["lang"]), *flags, "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists()
    assert err == f"layerswap {command}: error: {said}: pass --base (the model both experts were fine-tuned from)."
