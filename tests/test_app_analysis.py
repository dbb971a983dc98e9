"""The 'where each expert changed' section as a user drives it (gradio_client against `python app.py`),
checked against the library on the same demo checkpoints."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest
from gradio_client import Client

from layerswap import Checkpoint, Plan
from layerswap.analysis import analyze
from tests.helpers import shown

PLAN_ARGS = (2, 1, 1, 1, "flat", 0.5, "neighbour")


@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


@pytest.fixture(scope="module")
def loaded(client, tmp_path_factory):
    values = {c.get("props", {}).get("elem_id"): c.get("props", {}).get("value") for c in client.config["components"]}
    paths = {r: values[r] for r in ("base", "math", "lang")}
    client.predict(paths["base"], paths["math"], paths["lang"], api_name="/load")
    cks = {r: Checkpoint.open(p) for r, p in paths.items()}
    an = analyze(cks["base"], cks["math"], cks["lang"], ks=(1.0, 5.0), cache=tmp_path_factory.mktemp("cache"))
    return cks, an


def heatmap(client, panels, metric="relative", overlap="cosine", k=1.0, norm="raw", plan=PLAN_ARGS):
    heat, summary, profile, nonlayer, top, csv_file = client.predict(panels, metric, overlap, k, norm, "", *plan,
                                                                     api_name="/heatmap")
    heat, profile, nonlayer, top = (shown(x) for x in (heat, profile, nonlayer, top))
    return json.loads(heat["plot"]), summary, json.loads(profile["plot"]), nonlayer, top, csv_file


def test_panels_values_overlay_and_hover(client, loaded):
    cks, an = loaded
    fig, summary, profile, nonlayer, top, _ = heatmap(client, ["math", "lang", "overlap", "merged"])
    assert [d["name"] for d in fig["data"]] == ["math expert vs base", "language expert vs base",
                                                "overlap of the two experts' changes", "merged model vs base"]
    grid = np.array([[np.nan if v is None else v for v in row] for row in fig["data"][1]["z"]], dtype=float)
    np.testing.assert_allclose(grid, an.grid(an.values("lang", "relative")), rtol=1e-9)
    merged = an.merged(Plan(*PLAN_ARGS), cks["math"], cks["lang"], cks["base"])
    mz = np.array(fig["data"][3]["z"], dtype=float)
    np.testing.assert_allclose(mz, an.grid(an.values("merged", "relative", merged=merged)), rtol=1e-9)
    L = cks["math"].num_layers
    # plan b=2 u=1 tb=tu=1: the merged model copies the language expert in layers 0-1 and L-1, the math
    # expert in 3..L-3
    np.testing.assert_allclose(mz[:, [0, 1, L - 1]], grid[:, [0, 1, L - 1]], rtol=1e-12)
    math_grid = np.array(fig["data"][0]["z"], dtype=float)
    np.testing.assert_allclose(mz[:, 3:L - 2], math_grid[:, 3:L - 2], rtol=1e-12)
    # the plan overlay: outlined swapped blocks, shaded transitions (layers 2 and L-2), on every panel
    rects = [(s["x0"], s["x1"], s.get("fillcolor")) for s in fig["layout"]["shapes"]]
    outlined = sorted({(x0, x1) for x0, x1, fill in rects if fill == "rgba(0,0,0,0)"})
    shaded = sorted({(x0, x1) for x0, x1, fill in rects if fill != "rgba(0,0,0,0)"})
    assert outlined == [(-0.5, 1.5), (L - 1.5, L - 0.5)] and shaded == [(1.5, 2.5), (L - 2.5, L - 1.5)]
    assert len(rects) == 4 * 4
    # hover: tensor name, shape and every metric
    hover = fig["data"][0]["customdata"][0][3]
    shape = "×".join(map(str, cks["math"].tensors["model.layers.3.self_attn.q_proj.weight"].shape))
    for part in ("model.layers.3.self_attn.q_proj.weight", f"shape {shape}", "math vs base: rel", "mean|Δ|",
                 "top-1% share", "cosine", "Jaccard", "merged (w_lang 0)"):
        assert part in hover, part
    assert "Top-1% sets" in summary and "keeps" in summary
    assert [d["name"] for d in profile["data"]] == ["math expert", "language expert", "merged model"]
    np.testing.assert_allclose(profile["data"][1]["y"], an.layer_profile("lang", "relative"), rtol=1e-9)
    assert {r[0] for r in nonlayer["data"]} == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert len(top["data"]) == 20


def test_topk_metric_row_normalisation_and_csv(client, loaded):
    _, an = loaded
    fig, summary, _, _, top, csv_file = heatmap(client, ["math", "lang"], metric="topk", k=5.0, norm="row")
    assert "Top-5% sets" in summary
    z = {d["name"]: np.array([[np.nan if v is None else v for v in row] for row in d["z"]], dtype=float)
         for d in fig["data"]}
    both = np.stack(list(z.values()))
    assert np.allclose(np.nanmax(both, axis=(0, 2))[np.nanmax(both, axis=(0, 2)) > 0], 1.0)  # rows scaled to max 1
    raw = an.grid(an.values("lang", "topk", 5.0))
    rowmax = np.nanmax(np.stack([an.grid(an.values(r, "topk", 5.0)) for r in ("math", "lang")]), axis=(0, 2))
    np.testing.assert_allclose(z["language expert vs base"], raw / np.where(rowmax > 0, rowmax, 1)[:, None],
                               rtol=1e-9)
    ranked = an.most_changed(10, by="topk", k=5.0)
    assert [r[2] for r in top["data"][:5]] == [r["tensor"] for r in ranked[:5]]
    assert csv_file["visible"] and csv_file["value"].endswith(".csv")
    rows = list(csv.DictReader(open(csv_file["value"])))
    assert len(rows) == 2 * len(an.tensors)
    assert rows[0]["tensor"] == ranked[0]["tensor"] and float(rows[0]["topk"]) == pytest.approx(ranked[0]["topk"])
    assert {"rank", "expert", "tensor", "layer", "ptype", "shape", "topk", "relative_math", "relative_lang"} <= set(rows[0])


def test_log_scale_and_jaccard_overlap(client, loaded):
    _, an = loaded
    fig, *_ = heatmap(client, ["math", "overlap"], metric="mean_abs", overlap="jaccard", norm="log")
    z = np.array(fig["data"][0]["z"], dtype=float)
    want = an.grid(an.values("math", "mean_abs"))
    floor = want[want > 0].min()
    np.testing.assert_allclose(z, np.log10(np.maximum(want, floor)), rtol=1e-9)
    assert "Jaccard" in fig["layout"]["annotations"][1]["text"]


def test_suggest_sets_the_sliders(client, loaded):
    _, an = loaded
    b, u, tb, tu, md = client.predict("relative", 1.0, api_name="/weight_diff_prior")
    s = an.suggest_plan("relative", 1.0)
    assert (b["value"], u["value"], tb["value"], tu["value"]) == (s.plan.b, s.plan.u, s.plan.tb, s.plan.tu)
    assert f"b={s.plan.b}, u={s.plan.u}" in md and "Rule:" in md


def test_invalid_plan_drops_overlay_and_merged_panel(client, loaded):
    L = loaded[0]["math"].num_layers
    fig, summary, *_ = heatmap(client, ["math", "merged"], plan=(L, 2, 1, 1, "flat", 0.5, "neighbour"))
    assert "No plan overlay" in summary and f"exceeds the model's {L} layers" in summary
    assert [d["name"] for d in fig["data"]] == ["math expert vs base"] and not fig["layout"].get("shapes")


def test_lens_panel_matches_the_library(client, loaded):
    """The analysis tab's lens on the demo: the page's JSON equals `run_lens` on the same models and plan, and the
    figures outline the plan."""
    from layerswap.analysis.lens import LensConfig, run_lens
    from layerswap.recipe.recipes import Recipe
    from tests.helpers import DEMO_MGSM

    cks, _ = loaded
    plan = (2, 0, 0, 0, "flat", 0.5, "neighbour", "swap", "", 4, 0, 0, "all", "layer_swap", 0.5, 1.0, 0.2, 0.9, "1,1", "")
    summary, curves, grid, js = client.predict("xx", 3, "", "", 4, 0, *plan, api_name="/lens")
    assert "MGSM xx question 3" in summary and "Token classes:" in summary
    assert shown(curves)["plot"] and shown(grid)["plot"]
    got = json.loads(open(shown(js)).read())
    ref = run_lens(cks["math"].path, cks["lang"].path, Recipe(plan=Plan(b=2, u=0, tb=0, tu=0)),
                   base=cks["base"].path, config=LensConfig("xx", index=3, batch=4, source=DEMO_MGSM), device="cpu")
    want = ref.to_json()
    assert set(got["models"]) == set(want["models"]) == {"math", "lang", "merged", "base"}
    for role in want["models"]:
        for g, w in zip(got["models"][role]["layers"], want["models"][role]["layers"]):
            assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]]
            for key in ("p_target", "p_english", "p_digits", "alignment", "cka"):
                assert g[key] == pytest.approx(w[key], abs=1e-4), (role, g["layer"], key)
    # Heavy events are validated as they join the queue (ui.lane), so the refusal is the join's HTTP error.
    with pytest.raises(Exception) as refused:
        client.predict("xx", 3, "", "", 0, 0, *plan, api_name="/lens")
    said = getattr(getattr(refused.value, "response", None), "text", "") or str(refused.value)
    assert re.search("less than minimum value 1|batch", said), said


def test_analysis_after_a_build_that_reverts_a_layer(client, loaded):
    """Build a plan that reverts layer 3, then the analysis: every panel is drawn, and the merged model's
    layer 3 is the base (zero change), as the library computes it."""
    cks, an = loaded
    plan = (2, 1, 1, 1, "flat", 0.5, "neighbour", "swap", "", 2, 0, 0, "all", "layer_swap", 0.5, 1.0, 0.2, 0.9,
            "1,1", "3")
    client.predict(*plan, api_name="/build")
    fig, summary, *_ = heatmap(client, ["math", "lang", "merged"], plan=plan)
    assert [d["name"] for d in fig["data"]][-1] == "merged model vs base" and "Merged model" in summary
    mz = np.array([[np.nan if v is None else v for v in row] for row in fig["data"][2]["z"]], dtype=float)
    merged = an.merged(Plan(b=2, u=1, tb=1, tu=1, revert=(3,)), cks["math"], cks["lang"], cks["base"])
    np.testing.assert_allclose(mz, an.grid(an.values("merged", "relative", merged=merged)), rtol=1e-9)
    col = mz[:, 3]
    assert np.all(col[np.isfinite(col)] == 0.0) and np.isfinite(col).any()
