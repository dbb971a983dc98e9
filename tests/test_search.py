"""The plan search (issue 32): the space, the dev/test split, the priors, successive halving, the strategies, the
records (resume after SIGKILL, reuse), the honest report, the CLI and its JSON, Ray workers."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from layerswap.engines import EngineSettings
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.models.presets import assets_path
from layerswap.search import SearchConfig, Space, grid_space, priors, race, rungs, search, split_questions, tau_rule
from layerswap.search.strategy import TPE, Exhaustive, choose
from layerswap.sweeps import load_results
from tests.helpers import REPO

DEMO = {r: f"assets:demo/{r}" for r in ("math", "lang", "base")}
DATA = str(assets_path("assets:demo/math").parent / "mgsm")
ENGINE = EngineSettings(engine="transformers", device="cpu", batch_size=64)


def small(**kw) -> SearchConfig:
    """A quick search on the demo organism: few questions, short answers."""
    return SearchConfig(**{"langs": ["xx"], "source": DATA, "budget": 8, "dev": 40, "test": 60,
                           "max_new_tokens": 32, "first_rung": 10, **kw})


# ---- the space ------------------------------------------------------------------------------------

def _brute(space: Space) -> list:
    """Every valid parameter combination, written out independently of `Space.plans`."""
    L = space.num_layers
    out = []
    revs = [(0, 0)] + ([(s, n) for n in range(1, L + 1) for s in range(L - n + 1)] if space.revert else [])
    for b, u, tb, tu in itertools.product(range(L + 1), repeat=4):
        if b > space.max_b or u > space.max_u or max(tb, tu) > space.max_t or b + u + tb + tu > L:
            continue
        for tr in (space.transitions if tb + tu else space.transitions[:1]):
            out += [(b, u, tb, tu, tr, nl, m, r) for nl in space.non_layer for m in space.modules for r in revs
                    if not _an_expert(L, b, u, tb, tu, nl, m, r)]
    return out


def _an_expert(L, b, u, tb, tu, nl, m, r) -> bool:
    """Builds one expert unchanged (the spaces here blend every transition layer): nothing swapped with the
    non-layer tensors the math expert's, or every layer swapped whole with the language expert's."""
    if r != (0, 0):
        return False
    return (b + u + tb + tu == 0 and nl in ("math", "neighbour")) or (
        b + u == L and tb == tu == 0 and nl in ("lang", "neighbour") and m == "all")


@pytest.mark.parametrize("space", [Space(4), Space(5, max_b=2, max_t=1, transitions=("ramp",)),
                                   Space(3, module_wise=True, revert=True, non_layer=("math", "lang")),
                                   grid_space(8)])
def test_space_counts_and_lists_exactly_the_valid_plans(space):
    plans = list(space.plans())
    assert space.size() == len(plans) == len(_brute(space))
    for p in plans:
        p.validate(space.num_layers)
        assert p.b + p.u + p.tb + p.tu <= space.num_layers
        assert space.params(p) is not None and space.plan(space.params(p)) == p


def test_grid_space_of_eight_layers_is_every_b_u_tb_tu_but_the_experts_unchanged():
    # b=u=tb=tu=0 is the math expert, b+u=8 the language expert (neighbour: embeddings follow layers 0 and 7)
    assert grid_space(8).size() == math.comb(12, 4) - 1 - 9 == 485
    s = Space(8, non_layer=("math", "lang", "avg", "neighbour"))
    assert s.unchanged_expert(Plan(b=0, u=0, tb=0, tu=0, non_layer="math")) == "math"
    assert s.unchanged_expert(Plan(b=5, u=3, tb=0, tu=0, non_layer="lang")) == "lang"
    assert s.plan({"b": 0, "u": 0, "tb": 0, "tu": 0, "non_layer": "math"}) is None  # never evaluated
    for merge in (Plan(b=0, u=0, tb=0, tu=0, non_layer="avg"), Plan(b=0, u=0, tb=0, tu=0, non_layer="lang"),
                  Plan(b=5, u=3, tb=0, tu=0, non_layer="math"), Plan(b=8, u=0, tb=0, tu=0, modules="attention"),
                  Plan(b=0, u=0, tb=0, tu=0, revert=(2,))):
        assert s.unchanged_expert(merge) is None, merge


def test_invalid_plans_are_refused_before_anything_runs():
    s = Space(8)
    assert s.plan({"b": 4, "u": 2, "tb": 1, "tu": 1}) is not None
    assert s.plan({"b": 5, "u": 3, "tb": 0, "tu": 0, "non_layer": "math"}) is not None  # every layer, not the edges
    assert s.plan({"b": 5, "u": 3, "tb": 0, "tu": 0}) is None  # the language expert itself (edges follow)
    assert s.plan({"b": 5, "u": 3, "tb": 1, "tu": 0}) is None  # 9 > 8 layers
    assert Space(8, revert=True).plan({"b": 1, "u": 0, "tb": 0, "tu": 0, "revert_start": 6, "revert_len": 3}) is None
    with pytest.raises(UserError, match="flat:W"):
        Space(8, transitions=("flat:2",))
    with pytest.raises(UserError, match="Non-layer"):
        Space(8, non_layer=("nowhere",))


def test_plans_with_the_same_effect_are_one_plan():
    s = Space(8)
    a = s.plan({"b": 2, "u": 0, "tb": 0, "tu": 0, "transition": "ramp"})
    b = s.plan({"b": 2, "u": 0, "tb": 0, "tu": 0, "transition": "flat:0.75"})
    assert a == b and s.effect(a) == s.effect(b)
    # a ramp over one layer is the flat 0.5 blend: different plans, one model
    r = s.plan({"b": 2, "u": 1, "tb": 1, "tu": 1, "transition": "ramp"})
    f = s.plan({"b": 2, "u": 1, "tb": 1, "tu": 1, "transition": "flat:0.5"})
    assert r != f and s.effect(r) == s.effect(f)


# ---- the split ------------------------------------------------------------------------------------

def test_dev_and_test_are_disjoint_the_same_in_every_language_and_seeded():
    src = str(REPO / "assets" / "demo" / "mgsm")
    a = split_questions(["xx", "en"], src, seed=3)
    assert len(a.dev) == 400 and len(a.test) == 600 and a.total == 1000
    assert not set(a.dev) & set(a.test) and set(a.dev) | set(a.test) == set(range(1000))
    assert a == split_questions(["xx", "en"], src, seed=3)
    assert a.dev != split_questions(["xx", "en"], src, seed=4).dev
    b = split_questions(["xx"], src, seed=3, dev=50, test=100)
    assert b.dev == a.dev[:50] and len(b.test) == 100 and not set(b.dev) & set(b.test)
    for bad in ({"dev": 1000}, {"dev": 0}, {"dev": 10, "test": 991}):
        with pytest.raises(UserError):
            split_questions(["xx"], src, **bad)


# ---- successive halving -------------------------------------------------------------------------

def test_rungs_double_up_to_the_dev_set():
    assert rungs(400, 25) == [25, 50, 100, 200, 400]
    assert rungs(400) == [25, 50, 100, 200, 400]
    assert rungs(30, 10) == [10, 20, 30]
    assert rungs(5, 10) == [5]


def test_a_candidate_clearly_behind_stops_and_one_level_is_promoted():
    dev = list(range(100))
    inc = [1.0] * 80 + [0.0] * 20
    asked = []

    def scorer(values):
        def score(ids):
            asked.append(len(ids))
            return [values[i] for i in ids]
        return score

    bad = race(scorer([0.0] * 100), dev, [10, 20, 40, 100], inc, z=2.0)
    assert not bad.complete and len(bad.scores) == 10 and asked == [10]  # 10 questions: d = 1, se = 0
    asked.clear()
    level = race(scorer(inc), dev, [10, 20, 40, 100], inc, z=2.0)
    assert level.complete and level.accuracy == 0.8 and asked == [10, 10, 20, 60]
    # 7 of the first 10 right against 10 of 10: d = 0.3, se = 0.153; behind by 1.96 SE: promoted at z = 2, not at z = 1
    close = [1.0] * 7 + [0.0] * 3 + [1.0] * 90
    assert len(race(scorer(close), dev, [10, 20, 40, 100], inc, z=2.0).scores) > 10
    assert len(race(scorer(close), dev, [10, 20, 40, 100], inc, z=1.0).scores) == 10


# ---- priors and strategies ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_analysis():
    from layerswap.analysis import analyze
    from layerswap.models.checkpoints import Checkpoint

    cks = {r: Checkpoint.open(ref) for r, ref in DEMO.items()}
    return analyze(cks["base"], cks["math"], cks["lang"])


def test_tau_rule_reads_the_organisms_language_layers(demo_analysis):
    # the demo's language expert trained only layers 0-1 (and embeddings), its math expert only layers 2-7
    assert tau_rule(demo_analysis, 1.0) == Plan(b=2, u=0, tb=0, tu=0)
    assert tau_rule(demo_analysis, 1.0, "mlp") == Plan(b=2, u=0, tb=0, tu=0, modules="mlp")
    names = [p.name for p in priors(Space(8), demo_analysis)]
    assert names[0] == "the weight-diff prior" and names[-1] == "the default plan"
    assert any(n.startswith("τ rule") for n in names)


def test_strategy_is_exhaustive_when_the_space_fits_the_budget_and_tpe_is_seeded():
    small_space = Space(3, transitions=("flat:0.5",), non_layer=("neighbour",))
    assert isinstance(choose("auto", small_space, [], small_space.size(), 0), Exhaustive)
    assert isinstance(choose("auto", small_space, [], small_space.size() - 1, 0), TPE)

    def first(seed):
        t = TPE(Space(8), [], seed)
        out = []
        for _ in range(15):
            h, plan, _ = t.ask()
            out.append(plan)
            t.tell(h, None)
        return out
    assert first(1) == first(1) and first(1) != first(2)


# ---- the search, end to end ---------------------------------------------------------------------

def test_search_finds_a_plan_records_every_answer_and_resumes_from_the_file(tmp_path):
    out = tmp_path / "results.jsonl"
    r = search(DEMO["math"], DEMO["lang"], DEMO["base"], small(), results=out, engine=ENGINE)
    d = r.to_dict()
    assert d["split"]["dev_source"].endswith("demo/mgsm/dev")  # the organism's own dev file, its test set held out
    assert d["evaluated"]["plans"] == len(d["trials"]) == 8
    rows = load_results(out)
    answered = sum(len(x["ids"]) for x in rows)
    assert answered == d["evaluated"]["questions_run"] + d["evaluated"]["test_questions_run"]
    plan_rows = [x for x in rows if x["recipe"] is not None and x["test_set"]["path"] == "assets:demo/mgsm/dev"]
    assert sum(len(x["ids"]) for x in plan_rows) == d["evaluated"]["questions"]  # nothing answered twice
    assert d["test"]["n"] == 60 and d["test"]["interval"][0] <= d["test"]["accuracy"] <= d["test"]["interval"][1]
    assert [b["name"] for b in d["baselines"]][:2] == ["the math expert", "the language expert"]
    m = d["baselines"][0]["mcnemar"]  # the McNemar counts name both models
    assert f"({m['only_plan']} right only with the plan, {m['only_other']} only with the math expert)" in r.text()
    assert "optimistic" in d["dev"]["optimistic"] or "best of" in d["dev"]["optimistic"]
    # the plan found is the best plan that was scored on every dev question
    complete = [t for t in d["trials"] if t["complete"]]
    assert d["dev"]["accuracy"] == max(t["dev_accuracy"] for t in complete)
    again = search(DEMO["math"], DEMO["lang"], DEMO["base"], small(), results=out, engine=ENGINE)
    assert again.evaluated["questions_run"] == 0 and again.evaluated["test_questions_run"] == 0
    assert again.plan == r.plan and again.to_dict()["trials"] == d["trials"] and again.test == r.test
    assert len(load_results(out)) == len(rows)
    # another seed reuses every answer the file holds for its questions
    other = search(DEMO["math"], DEMO["lang"], DEMO["base"], small(seed=1), results=out, engine=ENGINE)
    assert other.evaluated["questions_reused"] > 0


def test_a_search_started_from_the_loaded_workbench_leaves_the_plan_built(tmp_path):
    from layerswap.serving.workbench import Workbench

    wb = Workbench.from_settings(ENGINE)
    wb.load(DEMO["math"], DEMO["lang"], DEMO["base"])
    stop = __import__("threading").Event()
    seen = []

    def progress(f, text):
        seen.append(text)
        if "1/" in text.split(" plans")[0]:
            stop.set()  # Stop after the first plan: what was found is kept
    r = search(DEMO["math"], DEMO["lang"], DEMO["base"], small(budget=20), results=tmp_path / "r.jsonl",
               workbench=wb, progress=progress, cancel=stop)
    assert r.cancelled and r.evaluated["plans"] == 1 and r.test is None
    assert any("best so far" in t for t in seen)
    assert r.plan is not None and wb.recipe.plan == r.plan  # the caller's merged model answers with it
    wb.close()


def _cli(*extra):
    return [sys.executable, "-m", "layerswap.cli", "search", "--math", DEMO["math"], "--lang", DEMO["lang"],
            "--base", DEMO["base"], "--langs", "xx", *extra]


def test_cli_json_has_the_fields_and_a_sigkilled_search_resumes_without_re_evaluating(tmp_path):
    env = {**os.environ, "LAYERSWAP_ENGINE": "transformers", "PYTHONPATH": str(REPO)}
    args = ["--budget", "12", "--dev", "80", "--test", "100", "--max-new-tokens", "32", "--first-rung", "10", "-q"]
    whole = tmp_path / "whole.jsonl"
    subprocess.run(_cli(*args, "-o", str(whole), "--json-out", str(tmp_path / "whole.json")), check=True, env=env,
                   timeout=600, capture_output=True)
    ref = json.loads((tmp_path / "whole.json").read_text())
    for k in ("b", "u", "tb", "tu", "transition", "non_layer"):
        assert k in ref["plan"]
    assert {"n", "accuracy"} <= set(ref["dev"]) and {"n", "accuracy", "interval"} <= set(ref["test"])
    assert {"plans", "questions"} <= set(ref["evaluated"]) and {"dev", "test"} <= set(ref["split"])
    killed = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(_cli(*args, "-o", str(killed)), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < 300:
        if killed.exists() and killed.read_bytes().count(b"\n") >= 6:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the search finished before it could be killed"
    before = load_results(killed)
    done = {(r["model_key"], lang, i) for r in before for lang in r["correct_flexible"] for i in r["ids"]}
    subprocess.run(_cli(*args, "-o", str(killed), "--json-out", str(tmp_path / "resumed.json")), check=True, env=env,
                   timeout=600, capture_output=True)
    after = load_results(killed)
    new = [r for r in after if r["key"] not in {b["key"] for b in before}]
    assert new and not {(r["model_key"], lang, i) for r in new for lang in r["correct_flexible"] for i in r["ids"]} & done
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["plan"] == ref["plan"] and resumed["test"] == ref["test"] and resumed["trials"] == ref["trials"]
    assert sum(len(r["ids"]) for r in after) == sum(len(r["ids"]) for r in load_results(whole))


def test_cli_refuses_a_limit_and_bad_budgets(tmp_path):
    from tests.helpers import run_cli

    p = run_cli("search", "--math", DEMO["math"], "--lang", DEMO["lang"], "--langs", "xx", "--limit", "5")
    assert p.returncode == 2 and "--dev N" in p.stderr
    p = run_cli("search", "--math", DEMO["math"], "--lang", DEMO["lang"], "--langs", "xx", "--budget", "0",
                "-o", str(tmp_path / "r.jsonl"))
    assert p.returncode == 2 and "budget" in p.stderr


def test_hosted_searches_are_bounded_and_the_panel_sets_every_plan_control():
    from layerswap.recipe.fields import LINK_KEYS
    from layerswap.serving.hosting import Limits, Policy
    from layerswap.ui.tabs.search import plan_values

    pol = Policy(hosted=True, limits=Limits(search_plans=10, eval_questions=100))
    pol.check_search(10, 100, 100)
    with pytest.raises(UserError, match="up to 10 plans"):
        pol.check_search(11, 50, 50)
    with pytest.raises(UserError, match="100"):
        pol.check_search(5, 50, 101)
    Policy().check_search(10_000, 10**6, 10**6)  # a local research tool: anything
    ups = dict(zip(LINK_KEYS, plan_values(Plan(b=3, u=1, tb=1, tu=0, transition="ramp", non_layer="math",
                                                    modules="mlp", revert=(5, 6)))))
    assert {k: ups[k].get("value") for k in ("b", "u", "tb", "tu", "transition", "non_layer", "modules", "revert",
                                             "kind", "method")} == {
        "b": 3, "u": 1, "tb": 1, "tu": 0, "transition": "ramp", "non_layer": "math", "modules": "mlp",
        "revert": "5-6", "kind": "swap", "method": "layer_swap"}
    assert dict(zip(LINK_KEYS, plan_values(Plan(b=2, u=0, tb=0, tu=0))))["revert"].get("value") == ""


def test_two_ray_workers_race_candidates_and_their_answers_match_the_local_engine(tmp_path):
    """Candidates raced on two Ray actors: the driver writes their records; every answer equals the one the
    local engine gives for the same model and question, and a rerun resumes from the file."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray")
    cfg = small(budget=6)
    par = search(DEMO["math"], DEMO["lang"], DEMO["base"], cfg, results=tmp_path / "ray.jsonl", engine=ENGINE,
                 workers=2)
    assert par.evaluated["plans"] == 6 and par.plan is not None and par.test is not None
    ray_rows = load_results(tmp_path / "ray.jsonl")
    assert sum(len(r["ids"]) for r in ray_rows) == par.evaluated["questions_run"] + par.evaluated["test_questions_run"]
    local = search(DEMO["math"], DEMO["lang"], DEMO["base"], cfg, results=tmp_path / "local.jsonl", engine=ENGINE)

    def answers(rows):
        return {(r["model_key"], lang, i): bit for r in rows for lang, bits in r["correct_flexible"].items()
                for i, bit in zip(r["ids"], bits)}
    a, b = answers(ray_rows), answers(load_results(tmp_path / "local.jsonl"))
    shared = a.keys() & b.keys()
    assert len(shared) > 100 and all(a[k] == b[k] for k in shared)
    assert local.test is not None
    again = search(DEMO["math"], DEMO["lang"], DEMO["base"], cfg, results=tmp_path / "ray.jsonl", engine=ENGINE,
                   workers=2)
    assert again.evaluated["questions_run"] == 0 and again.plan == par.plan


# ---- honest by construction (issue 41 items 6, 10, 15; issue 39's conventions) -----------------------------

DEMO2 = tuple(f"assets:demo2/{r}" for r in ("math", "lang", "base"))
REFS2 = (DEMO2[2], DEMO2[0], DEMO2[1])  # base, math, lang as the page names them


def test_models_with_their_own_dev_file_are_searched_on_it_never_on_their_test_set(tmp_path):
    """A shipped organism's search chooses on its `mgsm/dev` (the card's questions and answer length), holds out
    its test set; other sets draw the split as before."""
    import shutil

    from layerswap.evaluation import mgsm
    from layerswap.shipped.results import Results
    from layerswap.search import for_models

    org = assets_path("assets:demo2/math").parent
    res = Results.of_pair(org)
    cfg = for_models(SearchConfig(langs=["yy"]), *DEMO2)
    card_dev = res.dev()[res.plan_info["name"]]
    assert cfg.dev_source == str(org / "mgsm" / "dev") and cfg.source == str(org / "mgsm")
    assert cfg.dev == len(card_dev.correct) == 200 and cfg.evals()["max_new_tokens"] == res.max_new_tokens == 32
    s = split_questions(cfg.langs, cfg.source, 0, cfg.dev, cfg.test, cfg.dev_source)
    assert sorted(s.dev) == list(range(200)) and s.test == tuple(range(1000))  # the card's dev questions; all tests
    dev_q = {mgsm.load("yy", cfg.dev_source)[i].question for i in s.dev}
    assert not dev_q & {q.question for q in mgsm.load("yy", cfg.source)}  # no test question chooses
    assert "assets:demo2/mgsm/dev" in s.chosen_on and s.to_dict()["dev_source"] == cfg.dev_source
    given = for_models(SearchConfig(langs=["yy"], dev=50, max_new_tokens=64), *DEMO2)
    assert (given.dev, given.max_new_tokens, given.dev_source) == (50, 64, cfg.dev_source)
    other = tmp_path / "mgsm"  # the same questions, as a set the models do not bring: the split is drawn
    other.mkdir()
    for f in ("mgsm_yy.tsv", "mgsm_en.tsv", "languages.json", "exemplars.json"):
        shutil.copy(org / "mgsm" / f, other / f)
    drawn = for_models(SearchConfig(langs=["yy"], source=str(other)), *DEMO2)
    assert drawn.dev_source is None and drawn.evals()["max_new_tokens"] == mgsm.MAX_NEW_TOKENS
    s = split_questions(drawn.langs, drawn.source, 0, drawn.dev, drawn.test, drawn.dev_source)
    assert not set(s.dev) & set(s.test) and "drawn" in s.chosen_on


def test_a_shipped_search_moves_on_held_out_and_resumed_whole_starts_no_engine(tmp_path, monkeypatch):
    """Choice on the dev file with the card's 32 tokens, the held-out set from the test set, the models'
    recommended plan as a baseline, progress moving batch by batch on held-out questions; run again, every
    answer is read from the records and no engine starts."""
    from layerswap.shipped import organisms
    from layerswap.serving.answering import Answering

    starts = []
    real = Answering.start

    def counted(self, *a, **k):
        starts.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(Answering, "start", counted)
    out, engine = tmp_path / "r.jsonl", EngineSettings(engine="transformers", device="cpu", batch_size=16)
    cfg = SearchConfig(langs=["yy"], budget=3, dev=20, test=40, first_rung=10)
    seen = []
    r = search(*DEMO2, cfg, results=out, engine=engine, progress=lambda f, d: seen.append((f, d)))
    assert starts == [1] and r.test is not None
    rows = load_results(out)
    by_set = {x["test_set"]["path"] for x in rows}
    assert by_set == {"assets:demo2/mgsm/dev", "assets:demo2/mgsm"}
    assert {x["eval"]["max_new_tokens"] for x in rows} == {32}
    opening = organisms.opening_plan(REFS2, 10)
    assert "recommended" in opening.why and "the recommended plan" in [p["name"] for p in r.to_dict()["priors"]]
    names = [b["name"] for b in r.baselines]
    assert r.plan == opening.plan or f"the recommended plan ({opening.plan.title()})" in names
    assert "assets:demo2/mgsm/dev" in r.markdown() and r.to_dict()["split"]["dev_source"].endswith("mgsm/dev")
    held = [(f, d) for f, d in seen if "held-out" in d]
    math_fracs = {f for f, d in held if "the math expert" in d}
    assert len(math_fracs) >= 3  # 40 questions in batches of 16: the bar moves inside one model's scoring
    assert all(0.97 <= f <= 1.0 for f, _ in held) and [f for f, _ in held] == sorted(f for f, _ in held)
    starts.clear()
    t0 = time.perf_counter()
    again = search(*DEMO2, cfg, results=out, engine=engine)
    assert starts == [] and again.evaluated["questions_run"] == 0 and again.evaluated["test_questions_run"] == 0
    assert again.plan == r.plan and again.test == r.test and len(load_results(out)) == len(rows)
    print(f"resumed whole in {time.perf_counter() - t0:.1f} s, no engine")


def test_cli_json_is_stdout_and_the_pages_find_a_plan_reads_the_clis_records(tmp_path, monkeypatch):
    """`search --json` prints only JSON on stdout (as `inspect --json`), `--json-out` writes the same; the page's
    Find a plan on the same models reads every answer the CLI recorded in the one default results file."""
    from layerswap.ui.context import AppDefaults, Context
    from layerswap.ui.events import Job
    from layerswap.ui.session import Visitor
    from layerswap.ui.tabs.search import find_plan

    cache = tmp_path / "cache"
    env = {**os.environ, "LAYERSWAP_ENGINE": "transformers", "PYTHONPATH": str(REPO), "LAYERSWAP_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "layerswap.cli", "search", "--math", DEMO2[0], "--lang", DEMO2[1], "--base", DEMO2[2],
           "--budget", "3", "--dev", "20", "--test", "30", "--first-rung", "10", "-q", "--json",
           "--json-out", str(tmp_path / "out.json")]
    p = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    printed = json.loads(p.stdout)
    assert printed == json.loads((tmp_path / "out.json").read_text())
    assert "assets:demo2/mgsm/dev" in p.stderr and printed["split"]["dev_source"].endswith("mgsm/dev")
    assert (cache / "search" / "results.jsonl").is_file()
    monkeypatch.setenv("LAYERSWAP_CACHE", str(cache))
    monkeypatch.setenv("LAYERSWAP_ENGINE", "transformers")
    ctx = Context(AppDefaults(math=DEMO2[0], lang=DEMO2[1], base=DEMO2[2],
                                  engine=EngineSettings(engine="transformers", device="cpu")))
    v = Visitor(refs=REFS2)
    ctx.start_loading()  # as the served page does
    try:
        md, download, *_ = find_plan(ctx, Job(v, lambda *a, **k: None), ["yy"], 3, 0, 20, 30)
        got = json.loads(open(download["value"]).read())
    finally:
        ctx.shared.close()
    assert got["evaluated"]["questions_run"] == 0 and got["evaluated"]["test_questions_run"] == 0
    assert got["plan"] == printed["plan"] and got["test"] == printed["test"] and "mgsm/dev" in md
