"""Shipped models bring their own MGSM set and recommended plan, in every CLI command (issue 33, point 2).

The expected plans are read from the organisms' results files here, independently of `layerswap.shipped.demo`."""

from __future__ import annotations

import json

import pytest

from layerswap import Plan
from layerswap.evaluation import mgsm
from layerswap.shipped import organisms
from layerswap.cli import main as cli
from layerswap.core.errors import UserError
from layerswap.recipe.plans import default_plan
from layerswap.models.presets import assets_dir
from tests.helpers import assert_matches_plan

A = assets_dir()
TRIOS = {"demo": ("assets:demo/base", "assets:demo/math", "assets:demo/lang"),
         "demo-unlocalised": ("assets:demo/base", "assets:demo/unlocalised/math", "assets:demo/unlocalised/lang"),
         "demo2": ("assets:demo2/base", "assets:demo2/math", "assets:demo2/lang")}
RESULTS = {"demo": A / "demo/results.json", "demo-unlocalised": A / "demo/unlocalised/results.json",
           "demo2": A / "demo2/results.json"}
DATA = {"demo": A / "demo/mgsm", "demo-unlocalised": A / "demo/mgsm", "demo2": A / "demo2/mgsm"}


def recommended(name: str) -> Plan:
    raw = json.loads(RESULTS[name].read_text())["recommended_plan"]
    return Plan(**{k: raw[k] for k in ("b", "u", "tb", "tu", "transition", "transition_weight", "non_layer")})


@pytest.mark.parametrize("name", TRIOS)
def test_each_shipped_pair_brings_its_set_and_plan(name):
    base, math, lang = TRIOS[name]
    L = json.loads(RESULTS[name].read_text())["num_layers"]
    assert organisms.test_set(math, lang, base) == DATA[name]
    assert organisms.test_set(str(organisms.shipped(math))) == DATA[name]  # its folder, as a sweep file names it
    opening = organisms.opening_plan(TRIOS[name], L)
    assert opening.plan == recommended(name) and "recommended" in opening.why
    assert organisms.preset_of(TRIOS[name]) == name


@pytest.mark.parametrize("code", ["qa", "qb", "qc"])
def test_a_shipped_familys_members_open_on_its_tables_plan(code):
    """demo3 has no dev-chosen plan: each member opens on the swap its family table was measured with (read here
    from the JSON itself), and so does `layerswap eval` over the family when no plan flag is given."""
    raw = json.loads((A / "demo3/family_table.json").read_text())["recipes"][code]["swap"]["plan"]
    refs = ("assets:demo3/base", "assets:demo3/math", f"assets:demo3/lang_{code}")
    opening = organisms.opening_plan(refs, 8)
    assert (opening.plan.b, opening.plan.u, opening.plan.tb, opening.plan.tu) == (raw["b"], raw["u"], raw["tb"],
                                                                                   raw["tu"]) == (2, 1, 0, 0)
    assert "family table for " + code in opening.why
    assert organisms.opening_plan(refs, 2).plan == default_plan(2)  # a plan that does not fit: the literature's


def test_other_models_bring_nothing(trio):
    refs = (str(trio["base"]), str(trio["math"]), str(trio["lang"]))
    assert organisms.test_set(*refs) is None and organisms.test_set("org/model", "assets:nothing/here") is None
    assert organisms.opening_plan(refs, 6).plan == default_plan(6)
    # two shipped experts that were never measured as a pair: the literature's plan
    assert organisms.opening_plan(("", "assets:demo/math", "assets:demo2/lang"), 8).plan == default_plan(8)


def test_mgsm_reads_a_shipped_set_by_its_reference():
    assert mgsm.load("yy", "assets:demo2/mgsm")[0].question == mgsm.load("yy", A / "demo2/mgsm")[0].question
    assert "yy" in mgsm.languages("assets:demo2/mgsm")
    with pytest.raises(UserError, match="no such shipped model"):
        mgsm.load("en", "assets:../../etc")
    with pytest.raises(UserError, match=r"has no language 'xx'; it has: en \(English\), yy \(Oruki\)"):
        mgsm.check_languages(["xx"], "assets:demo2/mgsm")


def test_merge_without_plan_flags_uses_and_says_the_recommended_plan(tmp_path, capsys):
    base, math, lang = TRIOS["demo2"]
    assert cli(["merge", "--math", math, "--lang", lang, "--base", base, "-o", str(tmp_path / "m"), "-q"]) == 0
    out = capsys.readouterr().out
    plan = recommended("demo2")
    assert f"plan: {plan.title()} (10 layers): the plan recommended for assets:demo2 (math + lang)" in out
    assert_matches_plan(tmp_path / "m", {"math": A / "demo2/math", "lang": A / "demo2/lang"}, plan)
    # a flag given: the rest of the plan still comes from the recommended one, and no claim is made about it
    assert cli(["merge", "--math", math, "--lang", lang, "--b", "2", "-o", str(tmp_path / "m2"), "-q"]) == 0
    out = capsys.readouterr().out
    assert f"plan: {plan.with_(b=2).title()}" in out and "recommended" not in out


@pytest.mark.parametrize("argv", [
    ["ask", "--mgsm-lang", "xx", "--index", "0"],
    ["eval", "--langs", "xx", "--limit", "1"],
    ["lens", "--mgsm-lang", "xx", "--index", "0"],
    ["sweep", "--langs", "xx", "--limit", "1"],
])
def test_a_language_the_set_lacks_is_refused_before_any_model_loads(argv, tmp_path, capsys):
    """The language expert does not exist: a command that opened a model first would say that instead."""
    missing = str(tmp_path / "no-such-expert")
    assert cli([argv[0], "--math", "assets:demo2/math", "--lang", missing, *argv[1:]]) != 0
    err = capsys.readouterr().err
    assert ("has no language 'xx'" in err or "Unknown MGSM language code xx" in err) and "yy" in err, err
    assert "no-such-expert" not in err


def test_eval_uses_the_models_set_and_takes_a_shipped_set_by_reference(capsys):
    base, math, lang = TRIOS["demo2"]
    assert cli(["eval", "--math", math, "--lang", lang, "--models", "math", "--limit", "1", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "languages yy;" in err and "\nyy | 1 |" in out  # Oruki, its target language, from its own set
    assert cli(["eval", "--math", math, "--lang", lang, "--models", "math", "--limit", "1", "-q",
                "--mgsm-dir", "assets:demo/mgsm", "--langs", "xx"]) == 0  # a shipped set named like a model
    assert "\nxx | 1 |" in capsys.readouterr().out


def test_a_sweep_file_names_shipped_models_and_sets_by_reference(tmp_path):
    from layerswap.sweeps import load_spec

    f = tmp_path / "s.yaml"
    f.write_text("experts: {math: assets:demo2/math, lang: assets:demo2/lang}\n"
                 "recipes: [{name: r, plan: {b: 1, u: 0, tb: 0, tu: 0}}]\n"
                 "test_sets: [{path: assets:demo2/mgsm, langs: [yy]}]\n")
    spec = load_spec(f)
    spec.check_experts()
    assert spec.expert_sets[0].math == "assets:demo2/math" and spec.test_sets[0].path == "assets:demo2/mgsm"
    assert len(mgsm.prompts("yy", limit=2, source=spec.test_sets[0].path)) == 2
