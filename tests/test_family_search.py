"""Issue 40: `layerswap search` over a family: each language's plan found on its own dev questions and held out
on its test questions (exact intervals), and a shared plan best on average over the languages' dev sets,
recomputed here independently from the answers the results file records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerswap.core.stats import clopper_pearson
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.sweeps import load_results
from tests.helpers import DEMO_MGSM, cli_in_process, family_sets

LANGS = {"xx": "assets:demo/lang", "en": "assets:demo/unlocalised/lang"}
SMALL = ["--budget", "8", "--dev", "20", "--test", "30", "--first-rung", "10", "--max-new-tokens", "24", "--z", "1",
         "--max-b", "2", "--max-u", "2", "--max-t", "0", "--non-layer-choices", "math", "--engine", "transformers",
         "--device", "cpu", "-q"]
HELD_OUT = {"plan", "shared plan", "the math expert", "the language expert"}  # record names of held-out answers


def family_args(langs: dict[str, str] = LANGS) -> list[str]:
    return ["search", "--math", "assets:demo/math", "--base", "assets:demo/base",
            *(a for c, ref in langs.items() for a in ("--lang", f"{c}={ref}"))]


@pytest.fixture(scope="module")
def family_mgsm(tmp_path_factory) -> Path:
    """The demo's sets (Kovani xx, English; and its English as sw), parallel: each language's split is drawn from
    its set."""
    d = family_sets(tmp_path_factory.mktemp("family_mgsm"))  # sw: a third code with a set, for the refusals
    lines = (DEMO_MGSM / "mgsm_en.tsv").read_text().splitlines(keepends=True)
    (d / "mgsm_te.tsv").write_text("".join(lines[:-1]))  # and a set one question short: not parallel
    return d


def _recorded(rows: list[dict]) -> dict[tuple[str, str, int], bool]:
    """(plan as a recipe, language, question id) -> answered right, from every search record of the file."""
    out = {}
    for r in rows:
        if r.get("kind") != "search" or r["recipe"] is None:
            continue
        key = json.dumps(r["recipe"], sort_keys=True)
        for lang, bits in r["correct_flexible"].items():
            for i, bit in zip(r["ids"], bits):
                out[(key, lang, int(i))] = bit == "1"
    return out


def _recipe_key(params: dict) -> str:
    plan = Plan.from_dict({k: v for k, v in params.items() if k != "title"})
    return json.dumps(Recipe(plan=plan).to_dict(), sort_keys=True)


def test_search_over_a_family_reports_a_plan_per_language_held_out_and_the_shared_plan(family_mgsm, tmp_path):
    results, out = tmp_path / "results.jsonl", tmp_path / "out.json"
    r = cli_in_process(*family_args(), *SMALL, "--mgsm-dir", str(family_mgsm), "-o", str(results), "--json",
                       "--json-out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout)  # stdout is the JSON alone; the summary went to stderr
    assert data == json.loads(out.read_text()) and "shared plan:" in r.stderr
    assert data["family"]["languages"] == LANGS and list(data["held_out"]) == list(LANGS)
    rows = load_results(results)
    known = _recorded(rows)
    for code in LANGS:
        own = data["languages"][code]
        split = own["split"]
        assert split["langs"] == [code] and split["dev_source"] is None and len(split["dev"]) == 20
        assert not set(split["dev"]) & set(split["test"]) and len(split["test"]) == 30  # disjoint
        held = data["held_out"][code]
        t = held["test"]
        assert held["plan"] == own["plan"]["title"] and t["n"] == 30
        k = round(t["accuracy"] * 30)
        assert t["interval"] == [round(x, 4) for x in clopper_pearson(k, 30)]  # exact (Clopper-Pearson)
        # the plan's held-out answers are the test questions' own records; its choice saw only dev questions
        plan_key = _recipe_key(own["plan"])
        assert sum(known[(plan_key, code, i)] for i in split["test"]) == k
        mine = [row for row in rows if row["eval"]["langs"] == [code]]
        held_rows = [row for row in mine if row["name"] in HELD_OUT or row["name"].startswith("the recommended")]
        assert held_rows and {i for row in held_rows for i in row["ids"]} == set(split["test"])
        assert {i for row in mine if row not in held_rows for i in row["ids"]} <= set(split["dev"])
    splits = [data["languages"][c]["split"] for c in LANGS]  # parallel sets: the same problems on each side
    assert all(sp["dev"] == splits[0]["dev"] and sp["test"] == splits[0]["test"] for sp in splits)
    # the shared plan: among the candidates, the highest mean dev accuracy, recomputed from the records
    shared = data["shared"]
    cands = shared["candidates"]
    assert {c["plan"] for c in cands} >= {data["languages"][c]["plan"]["title"] for c in LANGS}

    def mean_dev(c: dict) -> float:
        key = _recipe_key(c["params"])
        return sum(sum(known[(key, code, i)] for i in data["languages"][code]["split"]["dev"]) / 20
                   for code in LANGS) / len(LANGS)

    assert all(c["dev"][code]["n"] == 20 for c in cands for code in LANGS)
    # a plan complete in one language's search but stopped early in the other's: its other dev answers were asked
    assert any(row["name"].startswith("shared candidate") for row in rows)
    means = [mean_dev(c) for c in cands]
    assert [c["mean_dev"] for c in cands] == [round(m, 4) for m in means]
    best = max(range(len(cands)), key=lambda j: (means[j], -sum(cands[j]["params"][x] for x in ("b", "u", "tb", "tu"))))
    assert shared["plan"]["title"] == cands[best]["plan"] and shared["mean_dev"] == round(means[best], 4)
    for code in LANGS:
        t = data["held_out"][code]["shared_test"]
        ids = data["languages"][code]["split"]["test"]
        k = sum(known[(_recipe_key(cands[best]["params"]), code, i)] for i in ids)
        assert t["n"] == 30 and round(t["accuracy"] * 30) == k and t["interval"] == [round(x, 4)
                                                                                     for x in clopper_pearson(k, 30)]
    # run again: everything comes from the records, nothing is answered twice, the same result
    again = cli_in_process(*family_args(), *SMALL, "--mgsm-dir", str(family_mgsm), "-o", str(results), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    d2 = json.loads(again.stdout)
    assert len(load_results(results)) == len(rows)
    assert d2["shared"] == shared and d2["held_out"] == data["held_out"]
    assert all(d2["languages"][c]["evaluated"]["questions_run"] == 0 for c in LANGS)


@pytest.mark.parametrize("extra, msg", [
    (["--lang", "ja=assets:demo/lang"], r"--lang ja=assets:demo/lang: The MGSM set .* has no language ja"),
    (["--lang", "sw=assets:demo/ablation/other_shape"], r"The sw expert \(assets:demo/ablation/other_shape\) does "
                                                         r"not fit this family"),
    (["--langs", "xx"], r"A family's languages are its codes \(xx, en\); drop --langs"),
    (["--shared-top", "0"], r"shared_top is a number of plans per language from 1 to 20"),
    (["--lang", "te=assets:demo/lang"], r"The languages' sets split differently \(xx: 1000, en: 1000, te: 999 "),
])
def test_bad_family_searches_are_refused_before_anything_heavy(extra, msg, family_mgsm, no_engines, tmp_path):
    import re

    r = cli_in_process(*family_args(), *SMALL, *extra, "--mgsm-dir", str(family_mgsm), "-o",
                       str(tmp_path / "r.jsonl"))
    assert r.returncode == 2 and r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(msg, errors[0]), r.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_a_stopped_family_search_resumes_from_its_records(family_mgsm, tmp_path):
    """Stopped while the second language is searched: the first language's search and the second's answers so
    far are records; run again, the first language answers nothing and the result is the whole one."""
    import threading

    from layerswap.engines import EngineSettings
    from layerswap.models.family import Family
    from layerswap.search import SearchConfig
    from layerswap.search.family import search_family

    fam = Family.parse("assets:demo/math", [f"{c}={r}" for c, r in LANGS.items()], "assets:demo/base")
    cfg = SearchConfig(langs=[], source=str(family_mgsm), budget=3, dev=20, test=30, first_rung=10, max_new_tokens=24,
                       max_b=1, max_u=1, max_t=0, non_layer=("math",))
    engine = EngineSettings(engine="transformers", device="cpu")
    stop = threading.Event()

    def progress(f: float, text: str) -> None:
        if text.startswith("en ") and "1/3 plans" in text:
            stop.set()  # the second language's first plan is scored

    results = tmp_path / "r.jsonl"
    first = search_family(fam, cfg, results=results, engine=engine, progress=progress, cancel=stop)
    assert first.cancelled and first.shared is None and first.languages["xx"].test is not None
    assert first.languages["en"].cancelled and first.to_dict()["shared"] is None
    kept = len(load_results(results))
    again = search_family(fam, cfg, results=results, engine=engine)
    assert not again.cancelled and again.shared is not None and again.shared.plan is not None
    assert again.languages["xx"].evaluated["questions_run"] == 0
    assert again.languages["xx"].test == first.languages["xx"].test
    assert again.languages["en"].evaluated["questions_reused"] > 0 and len(load_results(results)) > kept
