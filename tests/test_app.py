"""The app as a user drives it: `python app.py` on the demo models, through gradio_client."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from layerswap import Checkpoint, Plan
from layerswap.evaluation import mgsm
from tests.helpers import DEMO_MGSM, shown


@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


def _demo_paths(client) -> tuple[str, str, str]:
    # the page opens with the default (demo) models filled in
    cfg = client.config
    values = {c.get("props", {}).get("elem_id"): c.get("props", {}).get("value") for c in cfg["components"]}
    return values["base"], values["math"], values["lang"]


@pytest.fixture(scope="module")
def num_layers(client) -> int:
    _, math, _ = _demo_paths(client)
    assert math == "assets:demo/math"  # shipped models are named, never shown by server path
    return Checkpoint.open(math).num_layers


def test_load_build_ask_side_by_side(client, num_layers):
    L = num_layers
    base, math, lang = _demo_paths(client)
    assert "demo" in base
    report, b, u, tb, tu, *views = client.predict(base, math, lang, api_name="/load")
    assert re.search(rf"compatible: LlamaForCausalLM, {L} layers", report)
    assert re.search(r"shared base: sampled relative distances math-base 0\.\d+", report)
    assert b["maximum"] == L and b["value"] + u["value"] + tb["value"] + tu["value"] <= L
    heat, *_ = client.predict(api_name="/heatmap")  # the analysis of the loaded models, default controls
    fig = json.loads(shown(heat)["plot"])
    assert fig["data"][0]["type"] == "heatmap" and len(fig["data"]) == 4  # math, language, overlap, merged
    assert len(fig["data"][0]["z"][0]) == L

    strip, plan_md, share = client.predict(2, 1, 1, 1, "ramp", 0.5, "neighbour", api_name="/build")
    assert share.startswith("?") and "b=2" in share and "transition=ramp" in share and "math=assets%3Ademo%2Fmath" in share
    strip = json.loads(strip["plot"])
    assert strip["data"][0]["z"] == [[1, 1, 0.5] + [0] * (L - 5) + [0.5, 1]]
    assert "**Built: the merged model answers with this plan.** swap b=2 u=1 tb=1 tu=1 (ramp)" in plan_md

    item = mgsm.load("xx", DEMO_MGSM)[3]
    prompt, *answers, strip, plan_md = client.predict("xx", 3, "", 24, 2, 1, 1, 1, "ramp", api_name="/ask")
    assert f"Sorvi: {item.question[:30]}" in prompt and f"Gold answer: {item.answer}" in prompt
    assert "answers from swap b=2 u=1 tb=1 tu=1 (ramp)" in prompt and "**Built" in plan_md
    assert len(answers) == 3
    prompt, *free, _, _ = client.predict("en", None, "What is 2 + 3?", 24, api_name="/ask")
    assert "Question: What is 2 + 3?" in prompt and len(free) == 3
    for name, a in zip(("math expert", "language expert", "merged model"), answers):
        assert a.startswith(f"**{name}** · transformers") and "flexible:" in a


def test_user_errors_show_the_fix(client, num_layers):
    L = num_layers
    with pytest.raises(AppError, match=f"exceeds the model's {L} layers; reduce them so the sum is at most {L}"):
        client.predict(L - 1, 1, 1, 1, "flat", 0.5, "neighbour", api_name="/build")
    with pytest.raises(AppError, match="no such directory"):
        client.predict("", "/nonexistent/math", "/nonexistent/lang", api_name="/load")


def test_heatmap_switch_and_export(client, tmp_path, num_layers):
    base, math, lang = _demo_paths(client)
    client.predict(base, math, lang, api_name="/load")
    heat, *_ = client.predict(["lang"], "relative", "cosine", 1.0, "raw", "", 2, 1, 1, 1, "flat", 0.5, "neighbour",
                              api_name="/heatmap")
    fig = json.loads(shown(heat)["plot"])
    assert len(fig["data"]) == 1 and "language expert vs base" in fig["layout"]["annotations"][0]["text"]
    msg, dl = client.predict(str(tmp_path / "merged"), False, 1, 1, 0, 0, "flat", 0.5, "math", api_name="/export")
    assert "Wrote" in msg and (tmp_path / "merged" / "model.safetensors").exists()
    assert dl["visible"] and Path(dl["value"]).suffix == ".zip"
    prov = json.loads((tmp_path / "merged" / "layerswap.json").read_text())
    assert prov["plan"]["non_layer"] == "math" and prov["layer_weights_lang"] == [1] + [0] * (num_layers - 2) + [1]


def test_baseline_method_and_mergekit_yaml(client, num_layers):
    base, math, lang = _demo_paths(client)
    client.predict(base, math, lang, api_name="/load")
    strip, md, _ = client.predict(1, 1, 0, 0, "flat", 0.5, "neighbour", "middle", "", 2, 0, 0, "attention",
                                  "layer_swap", 0.5, 1.0, 0.2, 0.9, api_name="/build")
    want = Plan(kind="middle", k=2, modules="attention").layer_weights(num_layers)
    assert json.loads(strip["plot"])["data"][0]["z"] == [want] and sum(want) == 2
    assert "middle k=2, attention only" in md
    yml = client.predict(1, 1, 0, 0, "flat", 0.5, "neighbour", "middle", "", 2, 0, 0, "attention",
                         api_name="/export_yaml")
    text = Path(yml["value"]).read_text()
    assert "merge_method: linear" in text and "filter: self_attn" in text
    _, md, _ = client.predict(1, 1, 0, 0, "flat", 0.5, "neighbour", "swap", "", 2, 0, 0, "all",
                              "ties", 0.5, 1.0, 0.3, 0.9, api_name="/build")
    assert "TIES" in md and "density=0.3" in md
    with pytest.raises(AppError, match="does not claim a mergekit equivalent"):
        client.predict(1, 1, 0, 0, "flat", 0.5, "neighbour", "swap", "", 2, 0, 0, "all", "ties", 0.5, 1.0, 0.3,
                       api_name="/export_yaml")


def test_revert_layers_to_the_base(client, num_layers):
    """The Revert box: those layers come from the base (marked B on the strip), in the plan, export and YAML."""
    base, math, lang = _demo_paths(client)
    client.predict(base, math, lang, api_name="/load")
    plan = [1, 0, 0, 0, "flat", 0.5, "neighbour", "swap", "", 2, 0, 0, "all", "layer_swap", 0.5, 1.0, 0.2, 0.9, "1,1"]
    strip, md, share = client.predict(*plan, "3", api_name="/build")
    assert "revert 3 to base" in md and "revert=3" in share
    marks = [t for tr in json.loads(strip["plot"])["data"] for t in (tr.get("text") or [[]])[0]]
    assert marks.count("B") == 1
    yml = Path(client.predict(*plan, "3", api_name="/export_yaml")["value"]).read_text()
    assert "layer_range: [3, 4]" in yml and "base" in yml
    with pytest.raises(AppError, match=f"revert names layers 0 to {num_layers - 1}"):
        client.predict(*plan, str(num_layers), api_name="/build")
    client.predict("", math, lang, api_name="/load")  # no base: reverting is refused with what to do
    with pytest.raises(AppError, match="base"):
        client.predict(*plan, "3", api_name="/build")
    client.predict(base, math, lang, api_name="/load")


def test_export_never_touches_inputs(client):
    """The page's Export box with Overwrite: onto, above or inside an input (or the MGSM folder) is refused."""
    from tests.helpers import DEMO
    from tests.test_outputs import snapshot

    before = snapshot(DEMO)
    for target, word in ((DEMO / "math", "is an input"), (DEMO, "contains an input"),
                         (DEMO / "mgsm" / "merged", "is inside an input"), (DEMO.parent, "contains an input")):
        with pytest.raises(AppError, match=word):
            client.predict(str(target), True, 1, 1, 0, 0, api_name="/export")
    assert snapshot(DEMO) == before


def test_push_refusals(client, tmp_path):
    """Push uploads the visitor's own export with the visitor's token; refusals are immediate and readable."""
    fresh = Client(client.src, verbose=False)
    with pytest.raises(AppError, match="Export the merged model first"):
        fresh.predict("me/merge", True, "", api_name="/push")
    fresh.predict(str(tmp_path / "to-push"), False, 1, 1, 0, 0, api_name="/export")
    with pytest.raises(AppError, match="owner/name|repo id|Repo id"):
        fresh.predict("not a repo id", True, "hf_x", api_name="/push")
    t = time.perf_counter()
    with pytest.raises(AppError, match="not reachable"):  # this machine is offline: said at once
        fresh.predict("me/merge", True, "hf_x", api_name="/push")
    assert time.perf_counter() - t < 30


def test_the_api_example_in_the_docs_runs(app_url):
    """docs/app.md's gradio_client example, run as written against the app: Load demo2, Build, Ask in Oruki."""
    from tests.helpers import REPO

    doc = (REPO / "docs" / "app.md").read_text()
    example = re.search(r"```python\n(from gradio_client import Client\n.*?)```", doc, re.S).group(1)
    assert "http://127.0.0.1:7860/" in example
    ns: dict = {}
    exec(example.replace("http://127.0.0.1:7860/", app_url), ns)
    assert "compatible: LlamaForCausalLM" in ns["report"] and len(ns["answers"]) == 3
    assert "Gold answer" in ns["prompt"] and "**Built" in ns["plan_md"]


def test_load_keeps_its_api_names_and_time_limit(client):
    """Load returns the new models' menus too (see above), as the same endpoint: its arguments keep their names and
    its jobs their kind (`hosting.JOB_SECONDS`: a Load may take 30 minutes on a hosted server)."""
    from layerswap.ui.lane import time_limit

    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert [p["parameter_name"] for p in api["/load"]["parameters"]] == ["base", "math", "lang", "force"]
    assert time_limit("load") == time_limit("load_preset") == 1800
