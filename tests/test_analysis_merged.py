"""layerswap.analysis.merged: the merged model's statistics against the merge `export_merge` writes, with
each CPU kernel (the compiled loop and the torch operations)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from layerswap import Checkpoint, Plan, UserError, export_merge
from layerswap.analysis import analyze

pytestmark = pytest.mark.usefixtures("analysis_kernel")  # each CPU kernel (tests/conftest.py)


def merged_reference(paths: dict[str, Path], merged_dir: Path, ks) -> dict:
    """The written merge against base and experts from whole tensors (float64), and its exact top-k% shares."""
    sd = {r: load_file(paths[r] / "model.safetensors") for r in ("base", "math", "lang")}
    mm = {}
    for f in sorted(merged_dir.glob("*.safetensors")):
        mm.update(load_file(f))
    names = list(sd["base"])
    a = {n: sd["base"][n].double() for n in names}
    out: dict = {}
    for vs in ("base", "math", "lang"):
        out[vs] = {
            "relative": {n: float((mm[n].double() - sd[vs][n].double()).norm() / a[n].norm()) for n in names},
            "mean_abs": {n: float((mm[n].double() - sd[vs][n].double()).abs().mean()) for n in names},
        }
    mabs = {n: (mm[n].float() - sd["base"][n].float()).abs().reshape(-1) for n in names}
    N = sum(v.numel() for v in mabs.values())
    out["topk"] = {}
    for k in ks:
        K = min(N, max(1, round(k / 100 * N)))
        t = float(torch.sort(torch.cat([mabs[n] for n in names]), descending=True).values[K - 1])
        gt = sum(int((mabs[n] > t).sum()) for n in names)
        eq = sum(int((mabs[n] == t).sum()) for n in names)
        out["topk"][k] = {n: (int((mabs[n] > t).sum()) + (K - gt) / eq * int((mabs[n] == t).sum())) / K
                          for n in names}
    return out


@pytest.mark.parametrize("plan", [Plan(b=2, u=1, tb=1, tu=1), Plan(b=1, u=1, tb=2, tu=1, transition="ramp",
                                                                   non_layer="avg")])
def test_merged_matches_the_exported_merge(trio_bf16, tmp_path, plan):
    c = {r: Checkpoint.open(trio_bf16[r]) for r in ("base", "math", "lang")}
    export_merge(c["math"], c["lang"], plan, tmp_path / "merged")
    ref = merged_reference(trio_bf16, tmp_path / "merged", (1.0, 10.0))
    an = analyze(c["base"], c["math"], c["lang"], ks=(1.0, 10.0), cache=False)
    ms = an.merged(plan, c["math"], c["lang"], c["base"])
    names = [t.name for t in an.tensors]
    for panel, vs in (("merged", "base"), ("merged-math", "math"), ("merged-lang", "lang")):
        for metric in ("relative", "mean_abs"):
            got = an.values(panel, metric, merged=ms)
            for i, n in enumerate(names):
                assert got[i] == pytest.approx(ref[vs][metric][n], rel=1e-5, abs=1e-12), (panel, metric, n)
    blended = [n for n, w in zip(names, ms.weights) if w not in (0.0, 1.0)]
    assert sorted(ms.streamed) == sorted(blended) and blended  # only blended tensors were read again
    for k in (1.0, 10.0):
        mt = ms.topk_at(k)
        lo, hi = mt.bounds()
        est = an.values("merged", "topk", k, ms)
        assert est.sum() == pytest.approx(1.0)
        for i, n in enumerate(names):
            exact = ref["topk"][k][n]
            assert lo[i] - 1e-12 <= exact <= hi[i] + 1e-12, n
            assert abs(est[i] - exact) <= mt.max_error + 1e-12
    kept = ms.kept(an, 1.0)
    tk = an.topk_at(1.0)
    lw = plan.layer_weights(an.num_layers)
    want = sum(float(tk.share("lang")[i]) * plan.tensor_weight(t.layer, t.ptype, lw) for i, t in enumerate(an.tensors))
    assert kept["lang"] == pytest.approx(want)
    # tensors copied from an expert are that expert: zero distance, and the expert's own numbers
    w = ms.weights
    mm = an.values("merged-math", "relative", merged=ms)
    assert np.all(mm[w == 0.0] == 0.0) and np.all(an.values("merged", "relative", merged=ms)[w == 1.0]
                                                  == an.values("lang", "relative")[w == 1.0])
    with pytest.raises(UserError, match="k=5 was not computed"):
        ms.topk_at(5)


def test_merged_refuses_other_checkpoints(trio, trio_bf16):
    c = {r: Checkpoint.open(trio[r]) for r in ("base", "math", "lang")}
    an = analyze(c["base"], c["math"], c["lang"], ks=(), cache=False)
    other = {r: Checkpoint.open(trio_bf16[r]) for r in ("base", "math", "lang")}
    with pytest.raises(UserError, match="not the ones this analysis was computed on"):
        an.merged(Plan(b=1, u=1, tb=1, tu=1), other["math"], other["lang"], other["base"])
