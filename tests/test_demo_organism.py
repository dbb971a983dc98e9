"""The shipped demo organism (assets/demo): what it contains, that the app serves it by default, that
its card's numbers are recomputable from the per-question outputs in results.json, and (slow, not in
CI) that scripts/build_demo_experts.py + scripts/eval_demo.py rebuild it to the same numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gradio_client import Client

from layerswap import Checkpoint, Plan, check_compatible, mgsm
from layerswap.demo import (
    assets_dir,
    demo_mgsm_dir,
    demo_paths,
    organism_summary,
    recommended_plan,
)
from layerswap.engines.base import load_tokenizer
from layerswap.plans import default_plan

REPO = Path(__file__).resolve().parent.parent
DEMO = assets_dir() / "demo"
ROLES = ("base", "math", "lang")
sys.path.insert(0, str(REPO / "scripts"))
import eval_demo


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((DEMO / "results.json").read_text())


def test_shipped_files_fit_and_are_servable():
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total <= 40_000_000, f"assets/demo is {total / 1e6:.1f} MB; the issue allows 40"
    cks = {r: Checkpoint.open(DEMO / r) for r in ROLES}
    rep = check_compatible(cks["math"], cks["lang"], cks["base"])
    assert rep.ok, rep.summary()
    if (DEMO / "unlocalised").exists():  # the second pair shares the base
        un = {r: Checkpoint.open(DEMO / "unlocalised" / r) for r in ("math", "lang")}
        assert check_compatible(un["math"], un["lang"], cks["base"]).ok
    cfg = json.loads((DEMO / "math" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 64  # vLLM's CPU attention needs head_dim >= 64
    assert {t.dtype for ck in cks.values() for t in ck.tensors.values()} == {"F32"}
    paths, label = demo_paths()
    assert paths == {r: DEMO / r for r in ROLES} and "demo organism" in label


def test_experts_are_localised():
    """The math expert differs from the base only in its middle layers, the language expert only outside them."""
    import build_demo_experts as build

    info = json.loads((DEMO / "build_info.json").read_text())
    recipe = build.Recipe(**info["recipe"])
    base, m, la = (Checkpoint.open(DEMO / r) for r in ROLES)
    for name in base.tensors:
        math_part = build.in_range(name, "math", recipe)
        assert build.in_range(name, "lang", recipe) != math_part
        assert bool((m.get(name) == base.get(name)).all()) != math_part, name  # changed exactly in its range
        assert bool((la.get(name) == base.get(name)).all()) == math_part, name


def test_test_sets_load_with_the_library():
    d = demo_mgsm_dir()
    assert d is not None
    langs = mgsm.languages(d)
    assert {"xx", "en"} <= set(mgsm.available_languages(d)) and langs["xx"].name == "Kovani"
    en, xx = mgsm.load("en", d), mgsm.load("xx", d)
    assert len(en) == len(xx) >= 1000 and [i.answer for i in en] == [i.answer for i in xx]  # parallel test sets
    dev = mgsm.load("xx", d / "dev")
    assert len(dev) >= 200 and not {i.question for i in dev} & {i.question for i in xx}  # dev is not test
    assert {"xe", "ex"} <= set(mgsm.available_languages(d / "probe"))
    assert len(mgsm.load_exemplars("xx", d)) == 8
    prompt = mgsm.build_prompt(xx[0].question, langs["xx"])
    assert prompt.startswith("Sorvi: ") and prompt.endswith("Pasu-pasu Danu:")


def test_prompts_start_with_bos_as_in_training():
    tok = load_tokenizer(DEMO / "math")
    ids = tok(mgsm.build_prompt(mgsm.load("xx", demo_mgsm_dir())[0].question, mgsm.languages(demo_mgsm_dir())["xx"]))
    assert ids["input_ids"][0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids["input_ids"][1]) != "<unk>"


@pytest.mark.parametrize("pair", ["", "unlocalised"])
def test_results_recompute_from_per_question_outputs(pair):
    """Every accuracy, paired difference, floor, target and the plan choice follow from the stored outputs."""
    if not (DEMO / pair / "results.json").exists():
        pytest.skip(f"no {pair} pair shipped")
    results = json.loads((DEMO / pair / "results.json").read_text())
    langs = mgsm.languages(DEMO / "mgsm")
    assert {"math expert", "language expert", results["recommended_name"]} <= set(results["english_measured_for"])
    for name, entry in results["models"].items():
        assert "xx" in entry
        for lang in [x for x in ("xx", "en") if x in entry]:
            out = results["outputs"][name][lang]
            gold = results["gold"][lang]
            scored = [mgsm.score(o, g, langs[lang]) for o, g in zip(out["output"], gold, strict=True)]
            assert "".join("1" if s.flexible_correct else "0" for s in scored) == out["correct"], (name, lang)
            assert [s.flexible for s in scored] == out["flexible"]
            assert entry[lang] | eval_demo.accuracy([s.flexible_correct for s in scored]) == entry[lang]
            assert entry[lang]["answer_prior"] == eval_demo.answer_prior(out["flexible"], gold)
    rec = results["recommended_name"]
    rc = [c == "1" for c in results["outputs"][rec]["xx"]["correct"]]
    for name, c in results["paired_recommended_minus"].items():
        assert eval_demo.paired(rc, [x == "1" for x in results["outputs"][name]["xx"]["correct"]]) == c
    dev = results["dev_grid"]
    best = max(dev.values(), key=lambda d: (d["acc"], -(d["plan"]["b"] + d["plan"]["u"] + d["plan"]["tb"]
                                                         + d["plan"]["tu"])))
    assert best["plan"] == {k: v for k, v in results["recommended_plan"].items() if k in eval_demo.PLAN_FIELDS}
    assert all(d["acc"] == round(d["correct"].count("1") / len(d["correct"]), 4) for d in dev.values())
    floors = eval_demo.question_floors(mgsm.load("xx", DEMO / "mgsm"))
    assert floors.items() <= results["floors_target_language"].items()
    rec_acc = results["models"][rec]["xx"]["acc"]
    met = [results["paired_recommended_minus"][n]["z"] >= eval_demo.TARGET_SE
           for n in ("math expert", "language expert", "soup 50/50", "TIES (density 0.2)")]
    met.append(rec_acc >= max(results["floors_target_language"].values()) + eval_demo.FLOOR_MARGIN)
    met.append(results["models"]["math expert"]["en"]["acc"] >= eval_demo.MATH_EN_MIN)
    assert met == list(results["targets"].values()) and results["targets_met"] == all(met)


def test_model_card_shows_the_measured_numbers(results):
    card = (DEMO / "README.md").read_text()
    assert organism_summary() in card
    for name, m in results["models"].items():
        for lang in [x for x in ("xx", "en") if x in m]:
            assert f"{100 * m[lang]['acc']:.1f} [{100 * m[lang]['ci95'][0]:.1f}, {100 * m[lang]['ci95'][1]:.1f}]" \
                in card, (name, lang)
    for name, c in results["paired_recommended_minus"].items():
        assert f"| {name} | {100 * c['diff']:+.1f} ± {100 * c['se']:.1f} | {c['z']} |" in card
    verdict = "meets its targets" if results["targets_met"] else "does not meet all of its targets"
    assert verdict in card
    assert results["num_layers"] == Checkpoint.open(DEMO / "math").num_layers


def test_recommended_plan_is_shipped_and_loadable(results):
    p = recommended_plan()
    raw = json.loads((DEMO / "recommended_plan.json").read_text())
    assert isinstance(p, Plan) and p.to_dict() == Plan(**{k: raw[k] for k in eval_demo.PLAN_FIELDS}).to_dict()
    p.validate(results["num_layers"])
    assert raw["name"] in results["recommended_name"] and "dev" in raw["chosen_on"]


def test_app_serves_the_organism_by_default(app_url):
    """`python app.py` with no flags and no MGSM folder: organism models, Kovani test set, trained answers."""
    client = Client(app_url, verbose=False)
    values = {c.get("props", {}).get("elem_id"): c.get("props", {}).get("value") for c in client.config["components"]}
    assert values["math"] == "assets:demo/math" and values["mgsm-lang"] == "xx"
    rec = recommended_plan()  # the page opens on the plan chosen on the dev set, and says what it shows
    assert (values["b"], values["u"], values["tb"], values["tu"]) == (rec.b, rec.u, rec.tb, rec.tu)
    assert organism_summary() in values["demo-label"] and "Kovani test set" in values["demo-label"]
    card = values["card-text"]  # the card, one click away (links to repository files shown as names)
    assert card.startswith("# layerswap demo organism") and "imposed by training, not emergent" in card
    assert "](../../" not in card
    L = Checkpoint.open(DEMO / "math").num_layers
    report, b, *_ = client.predict(values["base"], values["math"], values["lang"], api_name="/load")
    assert f"compatible: LlamaForCausalLM, {L} layers" in report and b["maximum"] == L
    p = default_plan(L)
    strip, md, _ = client.predict(p.b, p.u, p.tb, p.tu, p.transition, p.transition_weight, p.non_layer,
                                  api_name="/build")
    assert json.loads(strip["plot"])["data"][0]["z"] == [Plan(b=p.b, u=p.u, tb=p.tb, tu=p.tu).layer_weights(L)]
    en0, xx0 = mgsm.load("en", demo_mgsm_dir())[0], mgsm.load("xx", demo_mgsm_dir())[0]
    prompt, math_a, lang_a, merged_a, *_ = client.predict("en", 0, "", 48, api_name="/ask")
    assert f"```\nQuestion: {en0.question}" in prompt and f"Gold answer: {en0.answer}" in prompt
    assert "The answer is" in math_a  # a trained math expert: random weights never produce this
    prompt, math_a, lang_a, merged_a, *_ = client.predict("xx", 0, "", 48, api_name="/ask")
    assert f"```\nSorvi: {xx0.question}" in prompt and f"Gold answer: {xx0.answer}" in prompt
    for name, a in zip(("math expert", "language expert", "merged model"), (math_a, lang_a, merged_a)):
        assert a.startswith(f"**{name}**") and "flexible:" in a


@pytest.mark.slow
def test_rebuild_matches_the_model_card(tmp_path, results):
    """Rebuild from scratch and re-measure: the same recipe, English skill, plan choice and accuracies."""
    out = tmp_path / "demo"
    info = json.loads((DEMO / "build_info.json").read_text())
    threads = str(info["threads"])  # same thread count: same float reduction order, same weights
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_experts.py"), "--out", str(out),
                    "--seed", str(info["seed"]), "--threads", threads], check=True, env=env)
    rebuilt = json.loads((out / "build_info.json").read_text())
    assert rebuilt["recipe"] == info["recipe"]
    assert rebuilt["sha256"] == info["sha256"]  # deterministic: the same weights, bit for bit
    subprocess.run([sys.executable, str(REPO / "scripts" / "eval_demo.py"), "--demo", str(out), "--no-card",
                    "--threads", threads], check=True, env=env)
    again = json.loads((out / "results.json").read_text())
    assert again["recommended_plan"] == results["recommended_plan"]
    assert again["models"]["math expert"]["en"]["acc"] >= min(eval_demo.MATH_EN_MIN,
                                                              results["models"]["math expert"]["en"]["acc"] - 0.03)
    for name, want in results["models"].items():
        for lang in [x for x in ("xx", "en") if x in want]:
            got, w = again["models"][name][lang]["acc"], want[lang]
            tol = max(0.03, 3 * w["se"])
            assert math.isclose(got, w["acc"], abs_tol=tol), (name, lang, got, w["acc"], tol)
    assert again["targets"] == results["targets"]
