"""The shipped demo organism (assets/demo): what it contains, that the app serves it by default, and
(slow, not in CI) that scripts/build_demo_experts.py rebuilds it to the numbers on its model card."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gradio_client import Client

from layerswap import Checkpoint, Plan, check_compatible
from layerswap import mgsm
from layerswap.demo import assets_dir, demo_mgsm_dir, demo_paths
from layerswap.plans import default_plan

REPO = Path(__file__).resolve().parent.parent
DEMO = assets_dir() / "demo"
ROLES = ("base", "math", "lang")


def _words_of(text: str) -> set[str]:
    return set(text.replace(".", " ").replace("?", " ").split())


def _words(tsv: Path) -> set[str]:
    return _words_of(" ".join(line.split("\t")[0] for line in tsv.read_text(encoding="utf-8").splitlines()))


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((DEMO / "results.json").read_text())


def test_shipped_files_fit_and_are_servable():
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total <= 25_000_000, f"assets/demo is {total / 1e6:.1f} MB; the issue allows 25"
    cks = {r: Checkpoint.open(DEMO / r) for r in ROLES}
    rep = check_compatible(cks["math"], cks["lang"], cks["base"])
    assert rep.ok, rep.summary()
    cfg = json.loads((DEMO / "math" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 64  # vLLM's CPU attention needs head_dim >= 64
    assert {t.dtype for ck in cks.values() for t in ck.tensors.values()} == {"F32"}
    paths, label = demo_paths()
    assert paths == {r: DEMO / r for r in ROLES} and "demo organism" in label


def test_test_sets_load_with_the_library():
    d = demo_mgsm_dir()
    assert d is not None
    langs = mgsm.languages(d)
    assert {"xx", "en"} <= set(mgsm.available_languages(d)) and langs["xx"].name == "Kovani"
    en, xx = mgsm.load("en", d), mgsm.load("xx", d)
    assert len(en) == len(xx) >= 250 and [i.answer for i in en] == [i.answer for i in xx]  # parallel test sets
    assert len(mgsm.load_exemplars("xx", d)) == 8
    prompt = mgsm.build_prompt(xx[0].question, langs["xx"])
    assert prompt.startswith("Sorvi: ") and prompt.endswith("Pasu-pasu Danu:")


def test_model_card_reports_the_measured_numbers(results):
    card = (DEMO / "README.md").read_text()
    for name, acc in results["summary_target_language"].items():
        pct = f"{100 * acc['flexible']:.1f}"
        assert pct in card, f"model card does not show {name}'s measured {pct}%"
    assert results["best_plan"]["name"] in card and (DEMO / "heatmap.png").stat().st_size > 10_000
    assert results["num_layers"] == Checkpoint.open(DEMO / "math").num_layers


def test_app_serves_the_organism_by_default(app_url):
    """`python app.py` with no flags and no MGSM folder: organism models, Kovani test set, trained answers."""
    client = Client(app_url, verbose=False)
    values = {c.get("props", {}).get("elem_id"): c.get("props", {}).get("value") for c in client.config["components"]}
    assert values["math"] == "assets:demo/math" and values["mgsm-lang"] == "xx"
    L = Checkpoint.open(DEMO / "math").num_layers
    report, b, *_ = client.predict(values["base"], values["math"], values["lang"], api_name="/load")
    assert f"compatible: LlamaForCausalLM, {L} layers" in report and b["maximum"] == L
    p = default_plan(L)
    strip, md, _ = client.predict(p.b, p.u, p.tb, p.tu, p.transition, p.transition_weight, p.non_layer,
                                  api_name="/build")
    assert json.loads(strip["plot"])["data"][0]["z"] == [Plan(b=p.b, u=p.u, tb=p.tb, tu=p.tu).layer_weights(L)]
    prompt, math_a, lang_a, merged_a, *_ = client.predict("en", 0, "", 96, api_name="/ask")
    assert "```\nQuestion: Raj has 18 eggs." in prompt and "Gold answer: 5" in prompt
    assert "The answer is" in math_a  # a trained math expert: random weights never produce this
    prompt, math_a, lang_a, merged_a, *_ = client.predict("xx", 0, "", 96, api_name="/ask")
    assert "```\nSorvi: Raj ovu 18 tenu." in prompt and "Gold answer: 5" in prompt
    kovani = _words(DEMO / "mgsm" / "mgsm_xx.tsv") - _words(DEMO / "mgsm" / "mgsm_en.tsv")
    assert _words_of(lang_a.split("```")[1]) & kovani  # the language expert answers in Kovani
    for name, a in zip(("math expert", "language expert", "merged model"), (math_a, lang_a, merged_a)):
        assert a.startswith(f"**{name}**") and "flexible:" in a


@pytest.mark.slow
def test_rebuild_matches_the_model_card(tmp_path, results):
    """Rebuild from scratch (about 20 min on 2 cores) and re-measure: within the tolerance results.json states."""
    out = tmp_path / "demo"
    info = json.loads((DEMO / "build_info.json").read_text())
    threads = str(info["threads"])  # same thread count: same float reduction order, same weights
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_experts.py"), "--out", str(out),
                    "--seed", str(info["seed"]), "--threads", threads], check=True, env=env)
    assert json.loads((out / "build_info.json").read_text())["recipe"] == info["recipe"]
    subprocess.run([sys.executable, str(REPO / "scripts" / "eval_demo.py"), "--demo", str(out)], check=True, env=env)
    again = json.loads((out / "results.json").read_text())
    for name, want in results["summary_target_language"].items():
        got = again["summary_target_language"][name]
        tol = max(0.03, 3 * want["se"])
        assert math.isclose(got["flexible"], want["flexible"], abs_tol=tol), (name, got, want, tol)
