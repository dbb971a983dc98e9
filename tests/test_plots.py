"""layerswap.analysis.plots: the analysis heatmaps (panels on shared scales, normalisations, plan overlay), profile, export."""

from __future__ import annotations

import numpy as np
import pytest

from layerswap import Checkpoint, Plan, UserError
from layerswap.analysis import analyze
from layerswap.analysis.plots import analysis_heatmaps, layer_profile, normalise, plan_cell_weights, save_figure


@pytest.fixture(scope="module")
def setup(trio):
    c = {r: Checkpoint.open(trio[r]) for r in ("base", "math", "lang")}
    an = analyze(c["base"], c["math"], c["lang"], ks=(1.0,), cache=False)
    plan = Plan(b=1, u=1, tb=1, tu=1, transition="ramp")
    return c, an, plan, an.merged(plan, c["math"], c["lang"], c["base"])


def z(trace) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in trace["z"]], dtype=float)


def test_change_panels_share_one_scale(setup):
    _, an, plan, merged = setup
    fig = analysis_heatmaps(an, ["math", "lang", "merged", "overlap"], merged=merged, plan=plan)
    d = fig.data
    assert d[0].zmin == d[1].zmin == d[2].zmin == 0 and d[0].zmax == d[1].zmax == d[2].zmax
    top = max(np.nanmax(an.values(p, "relative", merged=merged)[[i for i, t in enumerate(an.tensors)
                                                                 if t.layer is not None]])
              for p in ("math", "lang", "merged"))
    assert d[0].zmax == pytest.approx(top)
    assert [t.showscale for t in d] == [True, False, False, True]  # one colour bar per scale
    assert d[3].zmin == -d[3].zmax  # cosine: symmetric around zero
    assert fig.layout.height > 4 * 9 * 20


def test_normalisations():
    g = {"a": np.array([[1.0, 2.0], [0.0, 4.0]]), "b": np.array([[4.0, 0.5], [np.nan, 2.0]])}
    row, note = normalise(g, "row")
    np.testing.assert_allclose(row["a"], [[0.25, 0.5], [0.0, 1.0]])
    np.testing.assert_allclose(row["b"], [[1.0, 0.125], [np.nan, 0.5]])
    assert note == "÷ row max"
    log, _ = normalise(g, "log")
    np.testing.assert_allclose(log["a"], [[0.0, np.log10(2)], [np.log10(0.5), np.log10(4)]])  # 0 -> smallest > 0
    assert normalise(g, "raw")[0] is g
    with pytest.raises(UserError, match="normalisation must be one of"):
        normalise(g, "zscore")


def test_plan_overlay_by_column_and_by_cell(setup):
    _, an, plan, merged = setup
    fig = analysis_heatmaps(an, ["math"], plan=plan)
    shapes = fig.layout.shapes
    outlined = sorted((s.x0, s.x1) for s in shapes if s.fillcolor == "rgba(0,0,0,0)")
    shaded = sorted((s.x0, s.x1) for s in shapes if s.fillcolor != "rgba(0,0,0,0)")
    assert outlined == [(-0.5, 0.5), (4.5, 5.5)] and shaded == [(0.5, 1.5), (3.5, 4.5)]
    assert all(s.yref == "y domain" for s in shapes)  # whole columns
    per_module = Plan(b=1, u=1, tb=1, tu=1, modules="attention")  # MLP tensors stay with the math expert
    w = plan_cell_weights(an, per_module)
    assert w.shape == (9, 6) and w[an.ptypes.index("up_proj")].max() == 0.0 and w[0, 0] == 1.0
    fig = analysis_heatmaps(an, ["math"], plan=per_module)
    cells = [s for s in fig.layout.shapes if s.yref == "y"]
    attention_rows = {an.ptypes.index(p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "input_layernorm")}
    assert {round(s.y0 + 0.5) for s in cells} == attention_rows


def test_profile_and_topk_panels(setup, tmp_path):
    _, an, plan, merged = setup
    fig = layer_profile(an, "topk", 1.0, merged, plan)
    assert [t.name for t in fig.data] == ["math expert", "language expert", "merged model"]
    np.testing.assert_allclose(fig.data[0].y, an.layer_profile("math", "topk", 1.0))
    assert "top-1%" in fig.layout.title.text
    fig = analysis_heatmaps(an, ["math", "merged", "merged-lang"], metric="topk", merged=merged, plan=plan)
    assert "top-1%" in fig.layout.annotations[0].text and "histograms" in fig.layout.annotations[1].text
    assert "relative change" in fig.layout.annotations[2].text  # vs-expert panels have no top-k%
    np.testing.assert_allclose(z(fig.data[0]), an.grid(an.values("math", "topk", 1.0)))
    out = save_figure(fig, tmp_path / "f.html")
    assert "model.layers.2.mlp.up_proj.weight" in out.read_text()


def test_figure_errors(setup):
    _, an, _, _ = setup
    with pytest.raises(UserError, match="need a plan"):
        analysis_heatmaps(an, ["merged"])
    with pytest.raises(UserError, match="Unknown panel"):
        analysis_heatmaps(an, ["expert"])
    with pytest.raises(UserError, match="at least one panel"):
        analysis_heatmaps(an, [])
    with pytest.raises(UserError, match="cosine or jaccard"):
        analysis_heatmaps(an, ["overlap"], overlap_metric="relative")


def test_reverted_layers_on_the_strip_and_the_overlay(setup):
    from layerswap.analysis.plots import BASE_COLOR, layer_strip

    an = setup[1]
    plan = Plan(b=1, u=1, tb=1, tu=0, revert=(3,))
    fig = layer_strip(plan, an.num_layers)
    assert fig.data[0].z[0][3] is None and fig.data[1].text[0][3] == "B" and fig.data[1].z[0][2] is None
    heat = analysis_heatmaps(an, ["math", "lang"], plan=plan)
    dashed = [s for s in heat.layout.shapes if s.line.dash == "dash"]
    assert len(dashed) == 2 and {(s.x0, s.x1) for s in dashed} == {(2.5, 3.5)}
    assert all(s.line.color == BASE_COLOR for s in dashed)
    assert "reverted to the base" in heat.layout.title.text
    ms = an.merged(plan, setup[0]["math"], setup[0]["lang"], setup[0]["base"])  # a reverted layer is the base
    fig = analysis_heatmaps(an, ["merged", "merged-math"], merged=ms, plan=plan)
    col3 = [row[3] for row in fig.data[0].z]
    assert col3 and all(v == 0.0 for v in col3)
