"""layerswap.analysis.results: the queries on an Analysis (groups, grid, tables, report), the number format,
and the architecture that orders and labels the rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from safetensors.torch import load_file

from layerswap import Checkpoint, Plan, UserError
from layerswap.analysis import analyze, format_value
from layerswap.recipe.sources import tensor_weights
from tests.helpers import make_trio


@pytest.fixture(scope="module")
def an(trio):
    c = {r: Checkpoint.open(trio[r]) for r in ("base", "math", "lang")}
    return analyze(c["base"], c["math"], c["lang"], ks=(1.0,), cache=False)


def test_group_aggregates_are_exact(an, trio):
    """A layer's relative change is over all its tensors together, not a mean of ratios."""
    sd = {r: load_file(trio[r] / "model.safetensors") for r in ("base", "lang")}
    prof = an.layer_profile("lang", "relative")
    for layer in (0, 3, 5):
        names = [n for n in sd["base"] if f".layers.{layer}." in n]
        num = sum(float((sd["lang"][n].double() - sd["base"][n].double()).pow(2).sum()) for n in names)
        den = sum(float(sd["base"][n].double().pow(2).sum()) for n in names)
        assert prof[layer] == pytest.approx((num / den) ** 0.5, rel=1e-6)
    shares = an.layer_profile("lang", "topk", 1.0)
    tk = an.topk_at(1.0)
    assert shares.sum() + tk.share("lang")[an.non_layer()].sum() == pytest.approx(1.0)
    grid = an.grid(an.values("math", "relative"))
    assert grid.shape == (9, 6) and not np.isnan(grid).any()
    assert an.row_labels[:4] == ["q", "k", "v", "o"]


def test_non_layer_tensors_are_reported_separately(an):
    nl = {an.tensors[i].ptype for i in an.non_layer()}
    assert nl == {"embed", "final_norm", "lm_head"}
    assert all(an.tensors[i].layer is None for i in an.non_layer())
    assert [r["tensor"] for r in an.non_layer_rows(1.0)] == [an.tensors[i].name for i in an.non_layer()]
    s = an.summary(1.0)
    tk = an.topk_at(1.0)
    assert s["topk_non_layer_lang"] == pytest.approx(float(tk.share("lang")[an.non_layer()].sum()))


def test_tables_and_report(an):
    top = an.most_changed(3, by="relative")
    assert [r["rank"] for r in top] == [1, 2, 3] and top[0]["relative"] >= top[1]["relative"] >= top[2]["relative"]
    assert {r["expert"] for r in an.most_changed(len(an.tensors) * 2)} == {"math expert", "language expert"}
    text = an.report(1.0)
    assert f"math expert {format_value('relative', an.overall('math', 'relative'))}" in text
    assert "Top-1% sets" in text and "Computed in" in text


def test_query_errors(an):
    with pytest.raises(UserError, match="k=5 was not computed"):
        an.topk_at(5)
    with pytest.raises(UserError, match="not 'topk'"):
        an.values("merged-math", "topk", 1.0)
    with pytest.raises(UserError, match="Unknown panel"):
        an.values("expert", "relative")
    with pytest.raises(UserError, match="need a plan"):
        an.values("merged", "relative")


def test_format_value():
    assert format_value("relative", 0.012345) == "1.23%"
    assert format_value("topk", 0.5) == "50%" and format_value("jaccard", 1.0) == "100%"
    assert format_value("cosine", 0.12345) == "+0.123" and format_value("cosine", -0.5) == "-0.500"
    assert format_value("mean_abs", 0.00012345) == "0.000123"
    assert format_value("relative", None) == format_value("cosine", math.nan) == format_value("mean_abs", np.inf) == "–"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer):
    """A trio whose architecture has rows Llama lacks (q_norm, k_norm in the attention block)."""
    paths = make_trio(tmp_path_factory.mktemp("qwen3"), tokenizer, layers=4, architecture="qwen3")
    return {r: Checkpoint.open(paths[r]) for r in ("base", "math", "lang")}


def test_rows_follow_the_models_architecture(qwen3):
    c = qwen3
    an = analyze(c["base"], c["math"], c["lang"], ks=(), cache=False)
    assert an.model_type == "qwen3"
    assert an.row_labels == ["q", "k", "v", "o", "q_norm", "k_norm", "gate", "up", "down", "attn_norm", "mlp_norm"]
    # the merged model's weights are the merge's: q_norm goes with attention in this architecture
    plan = Plan(b=1, u=1, tb=0, tu=0, modules="attention")
    ms = an.merged(plan, c["math"], c["lang"], c["base"])
    want = tensor_weights(c["math"], plan)
    assert {t.name: float(w) for t, w in zip(an.tensors, ms.weights)} == {t.name: want[t.name] for t in an.tensors}
    assert ms.weights[an.index("model.layers.0.self_attn.q_norm.weight")] == 1.0


def test_format_row_formats_each_column_by_its_metric():
    from layerswap.analysis import format_row

    row = {"tensor": "t", "layer": None, "relative_math": 0.01234, "mean_abs_lang": 0.000123, "topk_share_math": 0.5,
           "topk_jaccard": 0.25, "cosine": -0.5, "relative": 0.1, "numel": 12, "w_lang": float("nan")}
    assert format_row(row) == {"tensor": "t", "layer": "", "relative_math": "1.23%", "mean_abs_lang": "0.000123",
                               "topk_share_math": "50%", "topk_jaccard": "25%", "cosine": "-0.500",
                               "relative": "10%", "numel": 12, "w_lang": "–"}
