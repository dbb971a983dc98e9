"""Issue 40: an expert family (one math expert, N language experts with their MGSM codes, one base), its checks,
and `layerswap eval` over it: the table per language, with an independent evaluation of sampled rows."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from layerswap import UserError
from layerswap.core.stats import clopper_pearson, mcnemar
from layerswap.evaluation.run import EvalConfig, EvalReport, QuestionResult
from layerswap.evaluation.table import LANG, MATH, family_table
from layerswap.models.family import MAX_LANGS, Family, check_family, split_spec
from layerswap.recipe.methods import method_list
from layerswap.serving.hosting import Limits, Policy
from tests.helpers import cli_in_process, family_sets

DEMO = ["--math", "assets:demo/math", "--base", "assets:demo/base"]


# ---- the family as data ---------------------------------------------------------------------------

def test_lang_specs_are_read_bounded_and_checked():
    fam = Family.parse("m/", ["sw=lang-sw/", " te = org/te-expert "], "b/")
    assert fam.codes == ("sw", "te") and fam.member("te").ref == "org/te-expert" and fam.base == "b/"
    assert split_spec("./runs/lr=1e-5") == (None, "./runs/lr=1e-5")  # a folder with '=' later stays a reference
    assert split_spec("org/model") == (None, "org/model")
    for specs, msg in [(["sw=a", "sw=b"], "Two language experts for sw (a and b); keep one --lang sw=REF."),
                       (["sw=a", "plain/ref"], "every language expert needs its MGSM language"),
                       (["SW=a"], "SW is not a language code"),
                       (["sw="], "give the sw expert's folder or Hub id"),
                       ([f"l{i}x=r{i}" for i in range(MAX_LANGS + 1)], "at most 8 are allowed here: drop l8x."),
                       (["sw=" + "x" * 2000], "at most 1000 characters")]:
        with pytest.raises(UserError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            Family.parse("m/", specs)
    with pytest.raises(UserError, match="at most 2 are allowed here: drop ja"):
        Family.parse("m/", ["sw=a", "te=b", "ja=c"], cap=2)


def test_hosted_mode_lowers_the_cap():
    assert Policy().family_cap == MAX_LANGS
    assert Policy(hosted=True).family_cap == Limits().family_langs == 4
    assert Policy.from_env({"LAYERSWAP_HOSTED": "1", "LAYERSWAP_MAX_FAMILY_LANGS": "2"}).family_cap == 2
    assert Policy.from_env({"LAYERSWAP_HOSTED": "1", "LAYERSWAP_MAX_FAMILY_LANGS": "50"}).family_cap == MAX_LANGS


def test_method_list_takes_the_short_names():
    assert method_list("swap,soup,ta,ties,dare") == [("swap", "layer_swap"), ("soup", "soup"),
                                                     ("ta", "task_arithmetic"), ("ties", "ties"),
                                                     ("dare", "dare_linear")]
    with pytest.raises(UserError, match="Unknown merge method 'tie'"):
        method_list("swap,tie")
    with pytest.raises(UserError, match="names layer_swap twice"):
        method_list("swap,layer_swap")


def _results(model: str, lang: str, right: list[bool]) -> list[QuestionResult]:
    return [QuestionResult(model, lang, i, "q", "p", "o", 1, "", "", ok, ok, "test") for i, ok in enumerate(right)]


def test_the_table_is_exact_intervals_and_paired_tests_against_the_better_expert(tmp_path):
    rows = {MATH: {"sw": [1, 1, 0, 0, 1, 0], "te": [1, 0, 0, 0, 0, 0]},
            LANG: {"sw": [0, 1, 0, 0, 0, 0], "te": [1, 1, 1, 0, 0, 0]},
            "swap": {"sw": [1, 1, 1, 1, 1, 0], "te": [0, 0, 1, 0, 0, 0]}}
    rep = EvalReport(EvalConfig(langs=["sw", "te"]), [MATH, LANG, "swap", "ties"])
    for m, per in rows.items():
        for lang, right in per.items():
            rep.results += _results(m, lang, [bool(x) for x in right])
    t = family_table(rep)
    sw, te = t.cell("swap", "sw"), t.cell("swap", "te")
    assert (sw.n, sw.correct, sw.better) == (6, 5, MATH) and (sw.low, sw.high) == clopper_pearson(5, 6)
    assert sw.p == mcnemar([bool(x) for x in rows["swap"]["sw"]], [bool(x) for x in rows[MATH]["sw"]]).p
    assert te.better == LANG and t.cell(LANG, "te").p is None and t.cell(MATH, "sw").p is None
    assert t.cell(MATH, "te").p == mcnemar([True] + [False] * 5, [True, True, True, False, False, False]).p
    assert t.cell("ties", "sw") is None and t.average("ties") is None  # not evaluated (yet): an empty cell
    assert t.average("swap") == pytest.approx((5 / 6 + 1 / 6) / 2)
    md = t.markdown().splitlines()
    assert md[0] == "model | sw | te | average" and md[-1] == "ties | – | – | –"
    assert md[4].startswith(f"swap | 83.3 [{100 * sw.low:.1f}, {100 * sw.high:.1f}] p=")
    data = json.loads(t.text("json", {"protocol": {"shots": 0}}))
    assert data["protocol"] == {"shots": 0} and data["results"]["te"]["swap"]["correct"] == 1
    assert data["results"]["sw"]["swap"]["interval"] == list(clopper_pearson(5, 6)) and "ties" not in data["results"]["sw"]
    table = list(csv.DictReader(t.write(tmp_path / "t.csv", "csv").open()))
    assert {(r["model"], r["language"]): r["correct"] for r in table}[("swap", "te")] == "1"
    from layerswap.analysis.plots import family_bars

    fig = family_bars(t)
    bars = {b.name: b for b in fig.data}
    assert list(bars) == [MATH, LANG, "swap", "ties"] and list(bars["swap"].x) == ["sw", "te", "average"]
    assert bars["swap"].y[0] == pytest.approx(100 * 5 / 6) and bars["swap"].error_y.array[0] == \
        pytest.approx(100 * (sw.high - 5 / 6)) and bars["ties"].y == (None, None, None)
    # a tie between the experts goes to the math expert
    rep.results = _results(MATH, "sw", [True, False]) + _results(LANG, "sw", [False, True])
    assert family_table(rep).cell(LANG, "sw").better == MATH


# ---- the CLI on the demo organism -----------------------------------------------------------------

@pytest.fixture(scope="module")
def family_mgsm(tmp_path_factory) -> Path:
    """The demo's set (Kovani xx, English) plus a Swahili set (the demo's English questions in MGSM's sw format)."""
    return family_sets(tmp_path_factory.mktemp("family_mgsm"))


def test_eval_prints_and_writes_the_family_table_and_sampled_rows_agree(family_mgsm, tmp_path):
    """Three languages, each with its own expert; the table on stdout and in every format; then rows evaluated
    independently (their merge exported on its own, answered by a fresh engine) agree exactly."""
    from layerswap.engines import open_engine
    from layerswap.evaluation.run import evaluate
    from layerswap.merge.merging import export_merge
    from layerswap.models.checkpoints import Checkpoint
    from layerswap.recipe.methods import MethodConfig
    from layerswap.recipe.plans import Plan
    from layerswap.recipe.recipes import Recipe

    out = {k: tmp_path / f"t.{k}" for k in ("json", "csv", "md", "html")}
    langs = {"xx": "assets:demo/lang", "en": "assets:demo/unlocalised/lang", "sw": "assets:demo/ablation/lang_lora"}
    r = cli_in_process("eval", *DEMO, *(a for c, ref in langs.items() for a in ("--lang", f"{c}={ref}")),
                       "--methods", "swap,soup,ta,ties", "--b", "1", "--u", "1", "--tb", "0", "--tu", "0",
                       "--limit", "4", "--max-new-tokens", "24", "--mgsm-dir", str(family_mgsm),
                       "--engine", "transformers", "-q", "--json", str(out["json"]), "--csv", str(out["csv"]),
                       "--md", str(out["md"]), "--plot", str(out["html"]), "-o", str(tmp_path / "answers.jsonl"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "model | xx | en | sw | average" and [x.split(" | ")[0] for x in lines[2:]] == \
        [MATH, LANG, "swap", "soup", "ta", "ties"]
    assert out["md"].read_text() == r.stdout
    data = json.loads(out["json"].read_text())
    assert data["languages"] == ["xx", "en", "sw"] and data["family"]["languages"] == langs
    for lang in langs:
        for m in data["models"]:
            c = data["results"][lang][m]
            assert c["n"] == 4 and c["interval"] == list(clopper_pearson(c["correct"], 4))
            assert (c["p_vs_better_expert"] is None) == (m == c["better_expert"])
    assert sum(1 for _ in csv.DictReader(out["csv"].open())) == 6 * 4
    assert "plotly" in out["html"].read_text()[:5000].lower()
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 3 * 6 * 4 and {a["model"] for a in answers} == set(data["models"])
    assert "swap b=1 u=1 tb=0 tu=0" in r.stderr

    cfg = lambda code: EvalConfig(langs=[code], limit=4, max_new_tokens=24, source=str(family_mgsm))  # noqa: E731

    def correct(model: str, code: str) -> tuple[int, int]:
        engine, _ = open_engine(model, engine="transformers", device="cpu")
        rep = evaluate({"m": engine}, cfg(code))
        return len(rep.results), sum(x.flexible_correct for x in rep.results)

    def merged(code: str, recipe: Recipe) -> str:
        from layerswap.models.adapters import open_expert

        folder = tmp_path / f"{code}-{recipe.method.name}"
        base = Checkpoint.open("assets:demo/base")
        export_merge(open_expert("assets:demo/math", "assets:demo/base"), open_expert(langs[code], "assets:demo/base"),
                     recipe, folder, base=base, device="cpu", card=False)
        return str(folder)

    cell = lambda code, m: (data["results"][code][m]["n"], data["results"][code][m]["correct"])  # noqa: E731
    sample = {("en", MATH): "assets:demo/math", ("xx", LANG): langs["xx"],
              ("xx", "ta"): merged("xx", Recipe(MethodConfig("task_arithmetic"))),
              ("en", "swap"): merged("en", Recipe(plan=Plan(b=1, u=1, tb=0, tu=0)))}
    for (code, row), model in sample.items():
        assert correct(model, code) == cell(code, row), (code, row)
    assert sum(cell(code, row)[1] for code, row in sample) > 0  # not a comparison of zeros


# ---- bad input, refused before anything heavy --------------------------------------------------------

@pytest.mark.parametrize("extra, msg", [
    (["--lang", "en=assets:demo/ablation/other_shape"],
     r"The en expert \(assets:demo/ablation/other_shape\) does not fit this family .*cannot be merged.*drop --lang en=\."),
    (["--lang", "en=assets:demo/ablation/seed1/lang"],
     r"The en expert \(assets:demo/ablation/seed1/lang\) does not fit this family .*may not share a base"),
    (["--lang", "en=assets:demo/ablation/lang_prefix"],
     r"The en expert \(assets:demo/ablation/lang_prefix\): A prefix-tuning expert merges only with another"),
    (["--lang", "ja=assets:demo/lang"], r"--lang ja=assets:demo/lang: The MGSM set .* has no language ja \(Japanese\)"),
    (["--lang", "xx=assets:demo/unlocalised/lang"], r"Two language experts for xx"),
    ([a for i in range(8) for a in ("--lang", f"l{i}x=nowhere/{i}")], r"has 9 language experts; at most 8"),
    (["--lang", "en=assets:demo/lang", "--methods", "swap,tie"], r"Unknown merge method 'tie'"),
    (["--lang", "en=assets:demo/lang", "--lang-recipe", "ja=r.yaml"], r"--lang-recipe ja=r.yaml: write CODE=FILE"),
    (["--lang", "en=assets:demo/lang", "--card", "x"], r"a family has a merge per language: drop --card"),
])
def test_bad_families_are_refused_before_anything_heavy(extra, msg, no_engines, tmp_path):
    r = cli_in_process("eval", *DEMO, "--lang", "xx=assets:demo/lang", *extra, "--limit", "2", "--engine",
                       "transformers", "-q", "--json", str(tmp_path / "t.json"))
    assert r.returncode == 2 and r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if "error:" in line]  # (a LoRA or prefix expert logs its loading)
    assert len(errors) == 1 and r.stderr.strip().endswith(errors[0]), r.stderr
    assert re.search(msg, errors[0]), r.stderr
    assert not (tmp_path / "t.json").exists()


def test_check_family_names_the_member_and_a_plain_lang_still_works(no_engines):
    fam = Family.parse("assets:demo/math", ["xx=assets:demo/lang", "en=assets:demo/ablation/other_shape"],
                       "assets:demo/base")
    with pytest.raises(UserError, match="The en expert"):
        check_family(fam)
    ok = check_family(Family.parse("assets:demo/math", ["xx=assets:demo/lang"], "assets:demo/base"))
    assert ok.num_layers == 8 and "shared base" in ok.lines["xx"]
    # commands of one pair: one --lang L (or CODE=L) as before, several refused with the way to a family
    r = cli_in_process("inspect", *DEMO, "--lang", "xx=assets:demo/lang")
    assert r.returncode == 0 and "compatible" in r.stdout.lower()
    r = cli_in_process("ask", *DEMO, "--lang", "xx=assets:demo/lang", "--lang", "en=assets:demo/lang", "--index", "0")
    assert r.returncode == 2 and "layerswap ask takes one language expert" in r.stderr
    # inspect over a family: every member's compatibility, the one that does not fit named
    r = cli_in_process("inspect", *DEMO, "--lang", "xx=assets:demo/lang", "--lang", "en=assets:demo/unlocalised/lang")
    assert r.returncode == 0 and "compatible: a family of 2 language experts, 8 layers" in r.stdout
    assert "  en: " in r.stdout and "shared base" in r.stdout
    r = cli_in_process("inspect", *DEMO, "--lang", "xx=assets:demo/lang", "--lang",
                       "en=assets:demo/ablation/other_shape")
    assert r.returncode == 2 and "The en expert (assets:demo/ablation/other_shape) does not fit" in r.stderr
    r = cli_in_process("eval", "--math", "assets:demo/math", "--lang", "assets:demo/lang", "--methods", "swap")
    assert r.returncode == 2 and "--methods is for a family" in r.stderr
    r = cli_in_process("eval", "--math", "assets:demo/math", "--lang", "xx=assets:demo/lang", "--methods", "swap,ta")
    assert r.returncode == 2 and "give --base, the model the family's experts were fine-tuned from (needed by ta)" \
        in r.stderr


def test_one_shared_plan_or_one_per_language(tmp_path):
    """The swap's plan: the plan flags over each pair's recommended plan, shared; --lang-recipe gives one language
    its own; the baselines take the method flags; a soup recipe as a swap is refused."""
    from layerswap.cli import build_parser
    from layerswap.cli.family import family_recipes
    from layerswap.cli.options import read_langs
    from layerswap.recipe.plans import Plan
    from layerswap.recipe.recipes import Recipe
    from layerswap.shipped.organisms import opening_plan

    own = tmp_path / "te.yaml"
    Recipe(plan=Plan(b=3, u=1, tb=0, tu=0)).dump(own)
    args = build_parser().parse_args(["eval", *DEMO, "--lang", "xx=assets:demo/lang", "--lang", "te=assets:demo/lang",
                                      "--u", "1", "--density", "0.5", "--lang-recipe", f"te={own}"])
    read_langs(args)
    rs = family_recipes(args, 8, method_list("swap,ties"))
    demo_plan = opening_plan(("assets:demo/base", "assets:demo/math", "assets:demo/lang"), 8).plan
    assert rs["xx"]["swap"].plan.b == demo_plan.b and rs["xx"]["swap"].plan.u == 1
    assert (rs["te"]["swap"].plan.b, rs["te"]["swap"].plan.u) == (3, 1)
    assert rs["xx"]["ties"].method.density == rs["te"]["ties"].method.density == 0.5
    soup = tmp_path / "soup.yaml"
    Recipe.from_values(method="soup").dump(soup)
    args.lang_recipe = [f"xx={soup}"]
    with pytest.raises(UserError, match="is a soup recipe; it gives the swap"):
        family_recipes(args, 8, method_list("swap"))


def test_one_lang_with_its_code_in_a_pair_command():
    """A pair command keeps one --lang (CODE=L gives the reference); a plain --lang L stays a pair everywhere; one
    CODE=L is a family of one where a family is taken (eval, search, sweep: scored on CODE, as the table)."""
    from layerswap.cli import build_parser
    from layerswap.cli.options import read_langs

    args = build_parser().parse_args(["ask", "--math", "m", "--lang", "xx=org/l"])
    read_langs(args)
    assert (args.lang, args.family) == ("org/l", None)
    with pytest.raises(UserError, match="takes one language expert"):
        read_langs(build_parser().parse_args(["ask", "--math", "m", "--lang", "xx=a", "--lang", "en=b"]))
    args = build_parser().parse_args(["sweep", "--math", "m", "--lang", "org/l", "--langs", "en"])
    read_langs(args)
    assert (args.lang, args.langs, args.family) == ("org/l", "en", None)
    for cmd in ("eval", "sweep", "search"):
        args = build_parser().parse_args([cmd, "--math", "m", "--lang", "xx=org/l"])
        read_langs(args)
        assert args.family.codes == ("xx",) and args.lang == "org/l", cmd
