"""The shipped demo organisms (assets/demo, the cipher positive control; assets/demo2, the paper's setting when
shipped): what they contain, that the app serves the default one, that every number on their cards recomputes
from the per-question outputs in results.json, and (slow, not in CI) that the build scripts and
scripts/eval_demo.py rebuild them to the same numbers."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from gradio_client import Client

from layerswap import Checkpoint, Plan, check_compatible
from layerswap.evaluation import mgsm
from layerswap.models.pairing import check_pairing
from layerswap.shipped.demo import (DEFAULT_ORGANISM, assets_dir, demo_mgsm_dir, demo_paths, organism_summary,
                                    recommended_plan)
from layerswap.shipped.results import PLAN_FIELDS, Results, results_file
from layerswap.engines.base import load_tokenizer
from layerswap.models.presets import assets_path, presets
from layerswap.recipe.sources import tensor_weights
from layerswap.recipe.plans import default_plan
from layerswap.core.stats import clopper_pearson, mcnemar

REPO = Path(__file__).resolve().parent.parent
ROLES = ("base", "math", "lang")
sys.path.insert(0, str(REPO / "scripts"))
import eval_demo

ORGANISMS = [d for d in ("demo", "demo2") if (assets_dir() / d / "results.json").exists()]
DEFAULT = assets_dir() / DEFAULT_ORGANISM


def _results(org: str, pair: str = "") -> Results:
    return Results.read(results_file(assets_dir() / org / pair))


def _build_module(org: str):
    import build_demo2
    import build_demo_experts

    return build_demo2 if org == "demo2" else build_demo_experts


def test_assets_fit():
    total = sum(f.stat().st_size for f in assets_dir().rglob("*") if f.is_file())
    assert total <= 60_000_000, f"assets/ is {total / 1e6:.1f} MB; the issue allows 60"


@pytest.mark.parametrize("org", ORGANISMS)
def test_shipped_files_are_servable(org):
    demo = assets_dir() / org
    cks = {r: Checkpoint.open(demo / r) for r in ROLES}
    rep = check_compatible(cks["math"], cks["lang"], cks["base"])
    assert rep.ok, rep.summary()
    pairing = check_pairing(cks["math"], cks["lang"], cks["base"])
    assert not pairing.suspicious, pairing.message()  # the app loads them without --force
    for pair in ("unlocalised/math", "unlocalised/lang", "lang_revert"):  # the other experts share the base
        if (demo / pair).exists():
            assert check_compatible(cks["math"], Checkpoint.open(demo / pair), cks["base"]).ok
    cfg = json.loads((demo / "math" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 64  # vLLM's CPU attention needs head_dim >= 64
    assert {t.dtype for ck in cks.values() for t in ck.tensors.values()} == {"F32"}
    paths, label = demo_paths()
    assert paths == {r: DEFAULT / r for r in ROLES} and "demo organism" in label


@pytest.mark.parametrize("org", ORGANISMS)
def test_experts_are_localised(org):
    """Each expert differs from the base exactly in its own range (the build's `ranges`, asked of the library's
    planner); a math expert the recipe fine-tunes fully (``math_scope="all"``) differs everywhere."""
    import build_demo_experts

    build = _build_module(org)
    demo = assets_dir() / org
    info = json.loads((demo / "build_info.json").read_text())
    recipe = build.Recipe(**info["recipe"])
    base = Checkpoint.open(demo / "base")
    own = build_demo_experts.role_of(build.ranges(recipe), recipe.layers)
    experts = {"math": "math", "lang": "lang", "lang_revert": "lang"}
    for folder, role in experts.items():
        if not (demo / folder).exists():
            continue
        ck = Checkpoint.open(demo / folder)
        everywhere = role == "math" and getattr(recipe, "math_scope", "middle") == "all"  # a full fine-tune
        for name in base.tensors:
            mine = everywhere or own(name) == role
            assert bool((ck.get(name) == base.get(name)).all()) != mine, (folder, name)


@pytest.mark.parametrize("org", ORGANISMS)
def test_test_sets_load_with_the_library(org):
    d = assets_dir() / org / "mgsm"
    t = eval_demo.target_language(d.parent)
    en, xx = mgsm.load("en", d), mgsm.load(t, d)
    assert len(en) == len(xx) >= 1000 and [i.answer for i in en] == [i.answer for i in xx]  # parallel test sets
    dev = mgsm.load(t, d / "dev")
    assert len(dev) >= 200 and not {i.question for i in dev} & {i.question for i in xx}  # dev is not test
    assert len(mgsm.load_exemplars(t, d)) == 8


@pytest.mark.parametrize("org", ORGANISMS)
def test_prompts_hold_no_unknown_tokens(org):
    """Every prompt the evaluation builds, in every set and language, starts with <s> and has no <unk>."""
    demo = assets_dir() / org
    tok = load_tokenizer(demo / "math")
    for src in [demo / "mgsm", demo / "mgsm" / "dev", demo / "mgsm" / "probe"]:
        langs = mgsm.languages(src)
        for code in mgsm.available_languages(src):
            for it in mgsm.load(code, src):
                for mode in ("native_cot", "direct"):
                    ids = tok(mgsm.build_prompt(it.question, langs[code], mode=mode))["input_ids"]
                    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids, (src, code, it.index)


def _pairs(org: str) -> list[tuple[str, str]]:
    return [(org, "")] + [(org, "unlocalised")] * (assets_dir() / org / "unlocalised" / "results.json").exists()


def _always_subtract(question: str, answer: int) -> bool:
    ns = [int(x) for x in re.findall(r"[0-9]+", question)]
    return bool(ns) and ns[0] - sum(ns[1:]) == answer


@pytest.mark.parametrize("org,pair", [p for o in ORGANISMS for p in _pairs(o)])
def test_results_recompute_from_per_question_outputs(org, pair):
    """Every accuracy, interval, paired comparison, floor, baseline, target and the plan choice follow from the
    stored outputs, recomputed here without eval_demo's own functions."""
    demo = assets_dir() / org
    res = _results(org, pair)
    t = res.target
    langs = mgsm.languages(demo / "mgsm")
    items = mgsm.load(t, demo / "mgsm")
    assert {"math expert", "language expert", res.recommended} <= set(res.english_measured_for)
    assert "inverse map (language middle, math outer)" not in res.models()  # not a control: it is the base
    correct = {}
    for name in res.models():
        for lang in [x for x in (t, "en") if res.has(name, x)]:
            s = res.score(name, lang)
            if res.kind(name) == "floor":
                got = [_always_subtract(it.question, it.answer) for it in items]
            else:
                gold = res.gold(lang)
                scored = [mgsm.score(o, g, langs[lang]) for o, g in zip(res.outputs(name, lang), gold, strict=True)]
                got = [x.flexible_correct for x in scored]
                assert [x.flexible for x in scored] == res.answers(name, lang)
                assert s.strict == round(sum(x.strict_correct for x in scored) / len(scored), 4)
                prior = Counter(mgsm.normalize(x) for x in res.answers(name, lang))
                g = Counter(str(x) for x in gold)
                assert s.answer_prior == round(sum(c * g.get(a, 0) for a, c in prior.items()) / len(gold) ** 2, 4)
            assert "".join("1" if c else "0" for c in got) == res.correct(name, lang), (name, lang)
            k, n = sum(got), len(got)
            lo, hi = clopper_pearson(k, n)
            assert s.acc == round(k / n, 4) and s.n == n
            assert [s.lo, s.hi] == [round(lo, 4), round(hi, 4)]
            assert s.se == round(math.sqrt(k / n * (1 - k / n) / n), 4)
            if lang == t:
                correct[name] = got
    rec = res.recommended
    for name, c in res.comparisons().items():
        d = [int(a) - int(b) for a, b in zip(correct[rec], correct[name])]
        mean = sum(d) / len(d)
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
        assert (c.diff, c.se) == (round(mean, 4), round(se, 4)), name
        assert (c.only_a, c.only_b) == (d.count(1), d.count(-1))
        assert c.p == float(f"{mcnemar(correct[rec], correct[name]).p:.3g}")
    # the dictionary baseline replaced exactly the rows of the dictionary's word pairs found in the vocabulary
    vocab = load_tokenizer(demo / pair / "math").get_vocab()
    pairs = json.loads((demo / "dictionary.json").read_text())
    rows = sum(f.format(e) in vocab and f.format(x) in vocab and vocab[f.format(e)] != vocab[f.format(x)]
               for e, x in pairs.items() for f in ("\u2581{}", "{}"))
    assert res.entry("dictionary baseline")["rows_replaced"] == rows > 0
    # the inverse map takes every tensor from the expert that left it at the base's value: it is the base
    plan = res.plan
    cks = {r: Checkpoint.open(demo / (pair if r != "base" else "") / r) for r in ROLES}
    w = tensor_weights(cks["math"], plan)
    inverse_is_base = all(bool((cks["math" if w[n] == 1.0 else "lang"].get(n) == cks["base"].get(n)).all())
                          for n in w if w[n] in (0.0, 1.0)) and all(v in (0.0, 1.0) for v in w.values())
    assert (res.weight_difference("inverse map vs base model") == 0.0) == inverse_is_base
    # the plan chosen on dev, and the targets
    dev = res.dev()
    best = max(dev.values(), key=lambda d: (d.acc, -(d.plan["b"] + d.plan["u"] + d.plan["tb"] + d.plan["tu"])))
    assert best.plan == {k: v for k, v in res.plan_info.items() if k in PLAN_FIELDS}
    assert all(d.acc == round(d.correct.count("1") / len(d.correct), 4) for d in dev.values())
    floors = res.floors()
    gold = [it.answer for it in items]
    mode, count = Counter(gold).most_common(1)[0]
    assert floors[f"most common answer ({mode})"] == round(count / len(gold), 4)
    acc = res.score(rec, t).acc
    want = [c.diff > 0 and (c.se == 0 or c.diff / c.se >= 3 - 0.01) for c in
            (res.paired(n) for n in ("math expert", "language expert", "soup 50/50", "TIES (density 0.2)",
                                     "task arithmetic"))]
    want += [acc >= max(*floors.values(), res.score("arithmetic, always subtracting", t).acc) + 0.10,
             res.score("dictionary baseline", t).acc <= acc - 0.20, res.score(rec, t).strict >= 0.5,
             res.plan.u >= 1, res.score("math expert", "en").acc >= 0.8]
    assert want == list(res.targets().values()) and res.targets_met == all(want)


@pytest.mark.parametrize("org", ORGANISMS)
def test_model_card_shows_the_measured_numbers(org):
    demo = assets_dir() / org
    res = _results(org)
    card = (demo / "README.md").read_text()
    assert organism_summary(demo) in card
    for name in res.models():
        for lang in [x for x in (res.target, "en") if res.has(name, x)]:
            s = res.score(name, lang)
            assert f"{100 * s.acc:.1f} [{100 * s.lo:.1f}, {100 * s.hi:.1f}]" in card, (name, lang)
    for name, c in res.comparisons().items():
        assert f"| {name} | {100 * c.diff:+.1f} ± {100 * c.se:.1f} | {c.z} | {c.only_a} / {c.only_b} | {c.p:.3g} |" \
            in card
    for target, met in res.targets().items():
        assert f"| {target} | {'yes' if met else '**no**'} |" in card
    assert ("meets all of its targets" if res.targets_met else "does not meet all of its targets") in card
    assert res.num_layers == Checkpoint.open(demo / "math").num_layers
    assert str(REPO) not in card and "± 0.0 |" not in card.split("## Gates")[0].split("## What it shows")[1]


def test_cipher_card_says_what_the_positive_control_shows():
    res = _results("demo")
    card = (assets_dir() / "demo" / "README.md").read_text()
    rec, t = res.recommended, res.target
    same = sum(a == b for a, b in zip(res.outputs(rec, t), res.outputs("math expert", "en")))
    assert f"On {same} of {res.n} test questions" in card
    assert "positive control" in card and "negative control" in card and "faithful setting" not in card
    top = Counter(o.strip() for o in res.outputs("language expert", t)).most_common(2)
    assert ", ".join((f"`{k}`" if k else "an empty answer") + f" {v}×" for k, v in top) in card
    assert "answers with an empty string" not in card and "Kovani only" not in card


def test_readme_and_app_doc_state_the_cipher_organisms_numbers():
    """README's organism lines and docs/app.md's paragraph quote results.json (and the negative control's)."""
    res, un = _results("demo"), _results("demo", "unlocalised")
    t, rec = res.target, res.recommended
    pct = lambda r, n: f"{100 * r.score(n, t).acc:.1f} %"
    ci = res.score(rec, t)
    assert res.weight_difference("task arithmetic vs recommended plan") < 1e-5
    assert res.outputs("task arithmetic", t) == res.outputs(rec, t)
    app = " ".join((REPO / "docs" / "app.md").read_text().split())
    readme = " ".join((REPO / "README.md").read_text().split())
    for text in (app, readme):
        assert f"scores {pct(res, rec)} [{100 * ci.lo:.1f}, {100 * ci.hi:.1f}]" in text
        assert f"no training scores {pct(res, 'dictionary baseline')}" in text
        assert f"math expert alone {pct(res, 'math expert')}" in text
        assert "positive control for the tool" in text and "negative control" in text
        assert "task arithmetic is the same model" in text
    assert "identical answers on every question" in app
    for phrase, name in [("always subtracts", "arithmetic, always subtracting"), ("50/50 soup", "soup 50/50"),
                         ("TIES", "TIES (density 0.2)")]:
        assert f"{phrase} {pct(res, name)}" in app, name
    assert f"its best swap scores {pct(un, un.recommended)}" in app
    assert f"(the negative control) {pct(un, un.recommended)}" in readme


@pytest.mark.skipif("demo2" not in ORGANISMS, reason="the paper-setting organism is not shipped")
def test_readme_and_app_doc_state_the_paper_organisms_numbers():
    """README's and docs/app.md's lines on assets/demo2 quote its results.json, and call it what it is."""
    res = _results("demo2")
    t, rec = res.target, res.recommended
    pct = lambda n, lang=t: f"{100 * res.score(n, lang).acc:.1f} %"
    assert res.paired("math expert").diff < 0  # else "negative result" is wrong
    app = " ".join((REPO / "docs" / "app.md").read_text().split())
    readme = " ".join((REPO / "README.md").read_text().split())
    for text in (app, readme):
        assert "negative result" in text and "assets/demo2/README.md" in text
        assert f"{pct('math expert')} on " in text
        assert f"scores {pct(rec)}" in text and f"{pct('math expert', 'en')} in English" in text
    assert f"a dictionary scores {pct('dictionary baseline')}" in app and f"the base {pct('base model')}" in app
    pm = res.paired("math expert")
    p = res.plan
    assert f"b={p.b} u={p.u} tb={p.tb} tu={p.tu} ({p.transition} {p.transition_weight:g})" in app
    if pm.p >= 0.05:  # the texts say the plan is the math expert within noise, with the paired test's numbers
        for text in (app, readme):
            assert f"McNemar p = {pm.p:.2f}" in text and "within noise" in text
    else:
        assert f"{-100 * pm.diff:.0f} points below the math expert" in app


def test_cipher_card_shows_the_lens_of_the_shipped_organism():
    """The card's lens table is docs/lens/demo.json's (run on this organism's question 0), after layer b-1."""
    import demo_card

    demo = assets_dir() / "demo"
    lens = json.loads(demo_card.LENS.read_text())
    langs = mgsm.languages(demo / "mgsm")
    assert lens["prompt"] == mgsm.build_prompt(mgsm.load("xx", demo / "mgsm")[0].question, langs["xx"])
    card = (demo / "README.md").read_text()
    b = _results("demo").plan.b
    for role, name in demo_card.LENS_ROLES.items():
        layer = lens["models"][role]["layers"][b]
        assert f"| {name} | {layer['alignment']:.3f} | {layer['cka']:.3f} |" in card
    assert "](../../docs/lens/demo-curves.png)" in card and (REPO / "docs" / "lens" / "demo-curves.png").exists()


@pytest.mark.parametrize("org", ORGANISMS)
def test_recommended_plan_is_shipped_and_loadable(org):
    demo = assets_dir() / org
    res = _results(org)
    p = recommended_plan(demo)
    raw = json.loads((demo / "recommended_plan.json").read_text())
    assert isinstance(p, Plan) and p.to_dict() == Plan(**{k: raw[k] for k in PLAN_FIELDS}).to_dict() \
        == res.plan.to_dict()
    p.validate(res.num_layers)
    assert raw["name"] in res.recommended and "dev" in raw["chosen_on"]


def test_app_serves_the_organism_by_default(app_url):
    """`python app.py` with no flags and no MGSM folder: the default organism, its test set, trained answers."""
    client = Client(app_url, verbose=False)
    values = {c.get("props", {}).get("elem_id"): c.get("props", {}).get("value") for c in client.config["components"]}
    t = eval_demo.target_language(DEFAULT)
    name = mgsm.languages(DEFAULT / "mgsm")[t].name
    assert values["math"] == f"assets:{DEFAULT_ORGANISM}/math" and values["mgsm-lang"] in (t, "en")
    rec = recommended_plan()  # the page opens on the plan chosen on the dev set, and says what it shows
    assert (values["b"], values["u"], values["tb"], values["tu"]) == (rec.b, rec.u, rec.tb, rec.tu)
    assert organism_summary() in values["demo-label"] and f"{name} test set" in values["demo-label"]
    card = values["card-text"]  # the card, one click away (links to repository files shown as names)
    assert card.startswith("# layerswap demo organism") and "imposed by training" in card
    assert "](../../" not in card
    L = Checkpoint.open(DEFAULT / "math").num_layers
    report, b, *_ = client.predict(values["base"], values["math"], values["lang"], api_name="/load")
    assert f"compatible: LlamaForCausalLM, {L} layers" in report and b["maximum"] == L
    p = default_plan(L)
    strip, md, _ = client.predict(p.b, p.u, p.tb, p.tu, p.transition, p.transition_weight, p.non_layer,
                                  api_name="/build")
    assert json.loads(strip["plot"])["data"][0]["z"] == [Plan(b=p.b, u=p.u, tb=p.tb, tu=p.tu).layer_weights(L)]
    langs = mgsm.languages(demo_mgsm_dir())
    for code in ("en", t):
        item = mgsm.load(code, demo_mgsm_dir())[0]
        prompt, math_a, lang_a, merged_a, *_ = client.predict(code, 0, "", 48, api_name="/ask")
        assert f"```\n{langs[code].question} {item.question}" in prompt and f"Gold answer: {item.answer}" in prompt
        for role, a in zip(("math expert", "language expert", "merged model"), (math_a, lang_a, merged_a)):
            assert a.startswith(f"**{role}**") and "flexible:" in a
    assert "The answer is" in client.predict("en", 0, "", 48, api_name="/ask")[1]  # a trained math expert


SHIPPED_PRESETS = [n for n, p in presets().items() if all(r.startswith("assets:") for r in (p.base, p.math, p.lang))]


@pytest.mark.parametrize("name", SHIPPED_PRESETS)
def test_shipped_presets_load_and_build(app_url, name):
    """Each preset of shipped models (the organisms, the negative control), as a visitor picks it: the menu fills the
    three fields, Load reads the trio, Build draws the plan on its layers, and Ask and Evaluate take the languages of
    the preset's own test set (an API caller runs no event chained after Load: the Load sets the menus itself)."""
    client = Client(app_url, verbose=False)
    *fields, note = client.predict(name, api_name="/preset")
    base, math_ref, lang = (f["value"] if isinstance(f, dict) else f for f in fields)  # gr.update(value=...)
    p = presets()[name]
    assert (base, math_ref, lang) == (p.base, p.math, p.lang) and note.startswith(p.note)
    L = Checkpoint.open(assets_path(p.math)).num_layers
    report, b, *_ = client.predict(base, math_ref, lang, api_name="/load")
    assert f"compatible: LlamaForCausalLM, {L} layers" in report and b["maximum"] == L
    plan = default_plan(L)
    strip, *_ = client.predict(plan.b, plan.u, plan.tb, plan.tu, plan.transition, plan.transition_weight,
                               plan.non_layer, api_name="/build")
    assert json.loads(strip["plot"])["data"][0]["z"] == [plan.layer_weights(L)]
    # the Load itself set this session's menus to the preset's own test set: Ask and Evaluate take its languages
    from layerswap.shipped.organisms import test_set

    codes = mgsm.available_languages(test_set(math_ref, lang, base))
    target = next(c for c in codes if c != "en")
    prompt, *answers, _, _ = client.predict(target, 0, "", 16, api_name="/ask")
    assert mgsm.load(target, test_set(math_ref, lang, base))[0].question in prompt and len(answers) == 3
    status, *_ = client.predict([target], ["merged"], 1, 0, "native_cot", 16, api_name="/evaluate")
    assert status.startswith("**Done:** 1 answers"), status


def _rebuild(org: str, script: str, out: Path, results: Results) -> Results:
    info = json.loads((assets_dir() / org / "build_info.json").read_text())
    threads = str(info["threads"])  # same thread count: same float reduction order, same weights
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    subprocess.run([sys.executable, str(REPO / "scripts" / script), "--out", str(out), "--seed", str(info["seed"]),
                    "--threads", threads], check=True, env=env)
    rebuilt = json.loads((out / "build_info.json").read_text())
    assert rebuilt["recipe"] == info["recipe"]
    assert rebuilt["sha256"] == info["sha256"]  # deterministic: the same weights, bit for bit
    subprocess.run([sys.executable, str(REPO / "scripts" / "eval_demo.py"), "--demo", str(out), "--no-card",
                    "--threads", threads], check=True, env=env)
    again = Results.read(results_file(out))
    assert again.plan_info == results.plan_info
    for name in results.models():
        for lang in [x for x in (results.target, "en") if results.has(name, x)]:
            got, w = again.score(name, lang).acc, results.score(name, lang)
            tol = max(0.03, 3 * w.se)
            assert math.isclose(got, w.acc, abs_tol=tol), (name, lang, got, w.acc, tol)
    assert again.targets() == results.targets()
    return again


@pytest.mark.slow
def test_rebuild_matches_the_model_card(tmp_path):
    """The cipher organism, rebuilt from scratch and re-measured: the same weights, plan choice and accuracies."""
    _rebuild("demo", "build_demo_experts.py", tmp_path / "demo", _results("demo"))


@pytest.mark.slow
@pytest.mark.skipif("demo2" not in ORGANISMS, reason="the paper-setting organism is not shipped")
def test_rebuild_of_the_paper_setting_organism(tmp_path):
    """The paper-setting organism, rebuilt from scratch (weights identical by sha256) and re-measured."""
    _rebuild("demo2", "build_demo2.py", tmp_path / "demo2", _results("demo2"))
