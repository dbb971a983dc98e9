"""A family in sweeps (issue 40): a sweep file's ``family:`` and the flag form's repeated ``--lang CODE=L`` become one
expert set per language, each scored on its own language only; the report lays them out as the paper's table. The
numbers are checked against `layerswap eval` over the same family (another code path: one math expert loaded once,
the languages switched) and against a merge exported and answered on its own."""

from __future__ import annotations

import json

import pytest
import yaml

from layerswap import UserError
from layerswap.sweeps import load_results, load_spec, run_sweep
from layerswap.sweeps.report import family_table, sweep_figures, table_text, write_html
from tests.helpers import REPO, cli_in_process

DEMO3 = {"math": "assets:demo3/math", "base": "assets:demo3/base",
         "langs": {"qa": "assets:demo3/lang_qa", "qb": "assets:demo3/lang_qb"}}
EVAL = {"limit": 3, "max_new_tokens": 32}
ENGINE = {"engine": "transformers", "device": "cpu"}


def _file(tmp_path, **over) -> str:
    d = {"name": "fam", "family": DEMO3,
         "recipes": [{"name": "soup", "method": {"name": "soup", "weight": 0.5}}],
         "grid": {"name": "swap b={b} u={u}", "recipe": {"plan": {"tb": 0, "tu": 0}}, "vary": {"b": [1, 2], "u": [1]}},
         "test_sets": [{"path": "assets:demo3/mgsm"}], "eval": EVAL, "engine": ENGINE}
    d.update(over)
    f = tmp_path / "family.yaml"
    f.write_text(yaml.safe_dump({k: v for k, v in d.items() if v is not None}))
    return str(f)


def test_a_family_becomes_one_set_per_language_and_bad_families_are_refused(tmp_path):
    spec = load_spec(_file(tmp_path))
    assert [(s.name, s.lang, s.langs, s.family) for s in spec.expert_sets] == [
        ("qa", "assets:demo3/lang_qa", ("qa",), "family"), ("qb", "assets:demo3/lang_qb", ("qb",), "family")]
    assert spec.test_sets[0].langs == ("qa", "qb")  # langs left out: the family's codes
    assert [[t.langs for t in s.scored_on(spec.test_sets)] for s in spec.expert_sets] == [[("qa",)], [("qb",)]]
    shipped = load_spec(REPO / "assets" / "sweeps" / "7-family.yaml")
    assert [s.name for s in shipped.expert_sets] == ["qa", "qb", "qc"] and not shipped.missing()
    many = {f"q{chr(97 + i)}": "assets:demo3/lang_qa" for i in range(9)}
    for over, msg in [({"experts": {"math": "m", "lang": "l"}}, "give the experts once"),
                      ({"family": {**DEMO3, "langs": many}}, "9 language experts; at most 8"),
                      ({"family": {**DEMO3, "langs": {"Q!": "assets:demo3/lang_qa"}}}, "is not a language code"),
                      ({"family": {**DEMO3, "langz": {}}}, "unknown key langz"),
                      ({"family": {"math": "assets:demo3/math", "langs": []}}, "at least one language"),
                      ({"family": "assets:demo3"}, "a family is"),
                      ({"test_sets": [{"path": "assets:demo3/mgsm", "langs": ["qa"]}]},
                       "the family's qb expert is scored on qb questions, but no test set lists qb")]:
        with pytest.raises(UserError, match=msg):
            load_spec(_file(tmp_path, **over))


def test_a_listed_recipe_can_give_a_family_member_its_own_plan(tmp_path):
    """A recipe's ``langs: {qb: {b: 1}}``: qb runs the recipe with its own plan keys (the rest kept) under the same
    name, qa the shared one; the record is the one a pair sweep of qb with that recipe writes (its key reused), and
    the family's table has the row for both. Codes outside the family, keys that are not plan keys and methods
    without a plan are refused when the file is read."""
    own = [{"name": "own", "plan": {"b": 2, "u": 1, "tb": 0, "tu": 0, "transition": "ramp"},
            "langs": {"qb": {"b": 1}}}]
    spec = load_spec(_file(tmp_path, recipes=own, grid=None))
    qa, qb = spec.expert_sets
    assert [p.recipe.plan.b for p in spec.points_for(qa)] == [2] and spec.points_for(qa)[0] is spec.points[0]
    got = spec.points_for(qb)[0].recipe.plan
    assert (got.b, got.u, got.tb, got.tu, got.transition) == (1, 1, 0, 0, "ramp")
    out = tmp_path / "r.jsonl"
    run = run_sweep(_file(tmp_path, recipes=own, grid=None, include_experts=False), out)
    by_set = {r["set"]: r for r in run.rows}
    assert by_set["qa"]["recipe"]["plan"]["b"] == 2 and by_set["qb"]["recipe"]["plan"]["b"] == 1
    assert by_set["qa"]["name"] == by_set["qb"]["name"] == "own"
    assert [r["recipe"] for r in family_table(run.rows)] == ["own"]
    pair = _file(tmp_path, family=None, experts={"math": DEMO3["math"], "lang": DEMO3["langs"]["qb"],
                                                 "base": DEMO3["base"]}, include_experts=False, grid=None,
                 recipes=[{"name": "own", "plan": {"b": 1, "u": 1, "tb": 0, "tu": 0, "transition": "ramp"}}],
                 test_sets=[{"path": "assets:demo3/mgsm", "langs": ["qb"]}])
    again = run_sweep(pair, out)
    assert again.ran == 0 and again.rows[0]["key"] == by_set["qb"]["key"]  # the same point: reused
    for langs, msg in [({"qz": {"b": 1}}, "gives qz its own plan, but qz is not a language of the sweep's family"),
                       ({"qb": {"method": "soup"}}, "unknown key method"),
                       ({"qb": []}, "langs is {CODE"), ({"Q!": {"b": 1}}, "is not a language code")]:
        with pytest.raises(UserError, match=msg):
            load_spec(_file(tmp_path, recipes=[{**own[0], "langs": langs}], grid=None))
    with pytest.raises(UserError, match="a soup merge has no plan to give a language"):
        load_spec(_file(tmp_path, recipes=[{"name": "s", "method": "soup", "langs": {"qb": {"b": 1}}}], grid=None))


def test_a_member_the_running_engines_cannot_take_is_loaded_afresh(tmp_path):
    """When the running engines cannot take the next member (`Workbench.switch_problem`: a LoRA rank past the
    engine's), the sweep loads the experts again instead of switching, and every point is still measured."""
    from layerswap.sweeps.run import workbench_for

    calls: list[str] = []

    def refusing(spec):
        wb = workbench_for(spec)
        for name in ("load", "switch_lang"):
            setattr(wb, name, lambda *a, _f=getattr(wb, name), _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
        wb.switch_problem = lambda lang: f"{lang} needs LoRA rank 16 for its merge"
        return wb

    run = run_sweep(_file(tmp_path, grid=None), tmp_path / "r.jsonl", workbench=refusing)
    assert calls == ["load", "load"] and run.ran == len(run.rows) == 2 * 3
    assert sorted((r["set"], r["name"]) for r in run.rows) == sorted(
        (c, n) for c in ("qa", "qb") for n in ("math expert", "language expert", "soup"))


def test_a_family_sweep_is_the_papers_table_and_agrees_with_eval_over_the_family(tmp_path):
    from layerswap.sweeps.run import workbench_for

    calls: list[str] = []

    def counted(spec):  # the sweep's own workbench, its loads and language switches counted
        wb = workbench_for(spec)
        for name in ("load", "switch_lang"):
            setattr(wb, name, lambda *a, _f=getattr(wb, name), _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
        return wb

    out = tmp_path / "r.jsonl"
    run = run_sweep(_file(tmp_path), out, workbench=counted)
    assert calls == ["load", "switch_lang"]  # the math expert loaded once; qb's expert switched in
    rows = run.rows
    assert len(rows) == 2 * (2 + 3) and run.ran == len(rows)  # per language: 2 experts, soup, 2 swaps
    for r in rows:  # each set scored on its own language only
        assert r["eval"]["langs"] == [r["set"]] and r["family"] == "family"
    table = family_table(rows)
    assert [r["recipe"] for r in table] == ["math expert", "language expert", "soup", "swap b=1 u=1", "swap b=2 u=1"]
    for t in table:
        mine = [r for r in rows if r["name"] == t["recipe"]]
        assert sorted(r["set"] for r in mine) == ["qa", "qb"]
        for r in mine:
            assert t[r["set"]] == round(100 * r["accuracy"]["flexible"][r["set"]], 1)
        exact = [100 * r["accuracy"]["flexible"][r["set"]] for r in mine]
        assert t["average"] == round(sum(exact) / 2, 1) and t["n"] == 6
    text = table_text(rows)
    assert text.splitlines()[0] == "| recipe | qa | qb | average | n |"
    assert "swap b=2 u=1" in write_html(rows, tmp_path / "r.html").read_text()
    assert "The family" in (tmp_path / "r.html").read_text()
    assert [k for k, _ in sweep_figures(rows)] == ["heatmap", "bars"]

    # the same family through `layerswap eval` (serving.family: math loaded once, languages switched)
    j = tmp_path / "t.json"
    r = cli_in_process("eval", "--math", DEMO3["math"], "--base", DEMO3["base"],
                       *(a for c, ref in DEMO3["langs"].items() for a in ("--lang", f"{c}={ref}")),
                       "--methods", "swap,soup", "--b", "2", "--u", "1", "--tb", "0", "--tu", "0",
                       "--limit", "3", "--max-new-tokens", "32", "--engine", "transformers", "-q", "--json", str(j))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(j.read_text())["results"]
    names = {"math expert": "math expert", "language expert": "language expert", "swap": "swap b=2 u=1",
             "soup": "soup"}
    for code in ("qa", "qb"):
        for model, cell in data[code].items():
            rec = next(x for x in rows if x["set"] == code and x["name"] == names[model])
            assert (cell["n"], cell["correct"]) == (rec["n"][code], rec["correct_flexible"][code].count("1")), \
                (code, model)
    assert sum(data[c][m]["correct"] for c in data for m in data[c]) > 0  # not a comparison of zeros

    # a pair sweep of one member on its language measures the same points: all reused from the results file
    pair = _file(tmp_path, family=None, experts={"math": DEMO3["math"], "lang": DEMO3["langs"]["qb"],
                                                 "base": DEMO3["base"]},
                 test_sets=[{"path": "assets:demo3/mgsm", "langs": ["qb"]}])
    again = run_sweep(pair, out)
    assert again.ran == 0 and len(again.rows) == 5 and len(load_results(out)) == 10


def test_the_flag_form_takes_a_family(tmp_path):
    langs = [a for c, ref in DEMO3["langs"].items() for a in ("--lang", f"{c}={ref}")]
    common = ["sweep", "--math", DEMO3["math"], "--base", DEMO3["base"], *langs, "--b-values", "2", "--u-values",
              "1", "--t-values", "0", "--limit", "2", "--max-new-tokens", "16", "--engine", "transformers", "-q"]
    r = cli_in_process(*common, "--csv", str(tmp_path / "t.csv"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a family of 2 (qa, qb: each on its own language)" in r.stdout
    assert "| recipe | qa | qb | average | n |" in r.stdout
    assert "averaged over the family's languages; best of 1" in r.stdout
    assert (tmp_path / "t.csv").read_text().splitlines()[0].startswith("set,recipe,kind,test set,family,")
    r = cli_in_process(*common, "--langs", "qa")
    assert r.returncode != 0 and "A family's languages are its codes (qa, qb); drop --langs." in r.stderr
    r = cli_in_process("sweep", "--math", DEMO3["math"], "--base", DEMO3["base"], "--lang", "zz=assets:demo3/lang_qa",
                       "--lang", "qa=assets:demo3/lang_qa", "--limit", "1", "-q")
    assert r.returncode != 0 and "--lang zz=assets:demo3/lang_qa" in r.stderr
