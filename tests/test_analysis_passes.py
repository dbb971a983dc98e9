"""layerswap.analysis.passes (and kernels): every statistic against a direct computation on whole tensors
(float64 sums, sort-based top-k%), on every computation path: sampled window, exact passes, workers,
and both main-pass kernels on CPU (the compiled loop and the torch operations)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from layerswap import Checkpoint, UserError
from layerswap.analysis import Analysis, analyze
from tests.helpers import read_dir

ROLES = ("math", "lang")

pytestmark = pytest.mark.usefixtures("analysis_kernel")  # each CPU kernel (tests/conftest.py)


# ---- an independent reference ----------------------------------------------------------------

def reference(paths: dict[str, Path], ks=()) -> dict:
    """Every metric from whole tensors: float64 sums, thresholds by a full sort of float32 |Δ|."""
    sd = {r: read_dir(paths[r]) for r in ("base", "math", "lang")}
    names = list(sd["base"])
    out: dict = {"names": names}
    a = {n: sd["base"][n].double() for n in names}
    d = {r: {n: sd[r][n].double() - a[n] for n in names} for r in ROLES}
    out["relative"] = {r: {n: float(d[r][n].norm() / a[n].norm()) for n in names} for r in ROLES}
    out["mean_abs"] = {r: {n: float(d[r][n].abs().mean()) for n in names} for r in ROLES}
    out["cosine"] = {n: float((d["math"][n] * d["lang"][n]).sum() / (d["math"][n].norm() * d["lang"][n].norm()))
                     for n in names}
    out["ml_relative"] = {n: float((d["math"][n] - d["lang"][n]).norm() / a[n].norm()) for n in names}
    # |Δ| exactly as stored values give it in float32
    absd = {r: {n: (sd[r][n].float() - sd["base"][n].float()).abs().reshape(-1) for n in names} for r in ROLES}
    N = sum(v.numel() for v in absd["math"].values())
    out["topk"] = {}
    for k in ks:
        K = min(N, max(1, round(k / 100 * N)))
        share, p = {}, {}
        for r in ROLES:
            allv = torch.cat([absd[r][n] for n in names])
            t = float(torch.sort(allv, descending=True).values[K - 1])
            gt = sum(int((absd[r][n] > t).sum()) for n in names)
            eq = sum(int((absd[r][n] == t).sum()) for n in names)
            frac = (K - gt) / eq
            p[r] = {n: (absd[r][n] > t).double() + frac * (absd[r][n] == t).double() for n in names}
            share[r] = {n: float(p[r][n].sum()) / K for n in names}
            share[r + "_threshold"] = t
        joint = {n: float((p["math"][n] * p["lang"][n]).sum()) for n in names}
        jac = {}
        for n in names:
            union = share["math"][n] * K + share["lang"][n] * K - joint[n]
            jac[n] = joint[n] / union if union > 0 else float("nan")
        out["topk"][k] = {"share": share, "joint": joint, "jaccard": jac, "K": K, "N": N}
    return out


def open_trio(paths) -> dict[str, Checkpoint]:
    return {r: Checkpoint.open(paths[r]) for r in ("base", "math", "lang")}


def run(paths, **kw) -> Analysis:
    c = open_trio(paths)
    kw.setdefault("cache", False)
    return analyze(c["base"], c["math"], c["lang"], **kw)


def assert_matches(an: Analysis, ref: dict, ks) -> None:
    names = [t.name for t in an.tensors]
    assert sorted(names) == sorted(ref["names"])
    for r in ROLES:
        rel, mab = an.values(r, "relative"), an.values(r, "mean_abs")
        for i, n in enumerate(names):
            assert rel[i] == pytest.approx(ref["relative"][r][n], rel=1e-5, abs=1e-9), (r, n)
            assert mab[i] == pytest.approx(ref["mean_abs"][r][n], rel=1e-5, abs=1e-12), (r, n)
    cos, mlr = an.values("overlap", "cosine"), an.values("math-lang", "relative")
    for i, n in enumerate(names):
        assert cos[i] == pytest.approx(ref["cosine"][n], rel=1e-4, abs=1e-6, nan_ok=True), n
        assert mlr[i] == pytest.approx(ref["ml_relative"][n], rel=1e-5), n
    for k in ks:
        tk, rk = an.topk_at(k), ref["topk"][k]
        assert (tk.K, tk.N) == (rk["K"], rk["N"])
        for r in ROLES:
            assert tk.threshold[r] == rk["share"][r + "_threshold"]
            share = tk.share(r)
            assert share.sum() == pytest.approx(1.0, abs=1e-9)
            for i, n in enumerate(names):
                assert share[i] == pytest.approx(rk["share"][r][n], abs=1e-9), (k, r, n)
        jac = tk.jaccard()
        for i, n in enumerate(names):
            assert tk.joint[i] == pytest.approx(rk["joint"][n], abs=1e-6), (k, n)
            if np.isnan(rk["jaccard"][n]):
                assert np.isnan(jac[i])
            else:
                assert jac[i] == pytest.approx(rk["jaccard"][n], abs=1e-9), (k, n)
        assert tk.overlap() == pytest.approx(sum(rk["joint"].values()) / rk["K"], abs=1e-9)


# ---- fixtures: trios with particular change patterns ----------------------------------------------

def write_like(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def ulp_trio(root: Path, base_dir: Path, p_change: dict[str, float], seed: int = 0) -> dict[str, Path]:
    """bf16 experts that move a random subset of entries by exactly one unit in the last place:
    |Δ| takes few distinct values and the top-k% threshold sits inside huge ties."""
    base = read_dir(base_dir)
    base = {n: v.to(torch.bfloat16) for n, v in base.items()}
    out = {"base": write_like(base_dir, root / "base", base)}
    g = torch.Generator().manual_seed(seed)
    for r in ROLES:
        t = {}
        for n, v in base.items():
            bits = v.view(torch.int16).clone()
            mask = (torch.rand(v.shape, generator=g) < p_change[r]) & (v != 0)  # no step from ±0 into NaN
            step = torch.where(torch.rand(v.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
            bits[mask] += step[mask]
            t[n] = bits.view(torch.bfloat16)
        out[r] = write_like(base_dir, root / r, t)
    return out


@pytest.fixture(scope="module")
def ties(tmp_path_factory, trio) -> dict[str, Path]:
    return ulp_trio(tmp_path_factory.mktemp("ties"), trio["base"], {"math": 0.3, "lang": 0.2})


@pytest.fixture(scope="module")
def sparse(tmp_path_factory, trio) -> dict[str, Path]:
    """Fewer than 1% of the language expert's entries change: its top-1% threshold is 0."""
    return ulp_trio(tmp_path_factory.mktemp("sparse"), trio["base"], {"math": 0.5, "lang": 0.004}, seed=3)


# ---- the metrics ----------------------------------------------------------------------------------

KS = (0.1, 1.0, 10.0)


def test_every_metric_matches_direct_computation_fp32(trio):
    ref = reference(trio, KS)
    an = run(trio, ks=KS)
    assert_matches(an, ref, KS)
    assert all(tk.passes == 1 for tk in an.topk.values())  # the sampled window held every threshold
    assert len(an.tensors) == len(ref["names"]) and an.N == ref["topk"][1.0]["N"]


def test_bf16_and_every_computation_path_agree(trio_bf16):
    ref = reference(trio_bf16, KS)
    paths = {
        "sampled": run(trio_bf16, ks=KS),
        "small chunks, block sample": run(trio_bf16, ks=KS, chunk_elems=777, sample_block=64, sample_fraction=0.02),
        "three workers": run(trio_bf16, ks=KS, workers=3, chunk_elems=5000),
        "two workers, exact passes": run(trio_bf16, ks=KS, workers=2, sample_fraction=0),
        "no sample (exact passes)": run(trio_bf16, ks=KS, sample_fraction=0),
        "window overflow (exact passes)": run(trio_bf16, ks=KS, max_kept=3),
    }
    for label, an in paths.items():
        assert_matches(an, ref, KS)
    assert {tk.passes for tk in paths["no sample (exact passes)"].topk.values()} == {3}
    assert {tk.passes for tk in paths["window overflow (exact passes)"].topk.values()} == {3}


def test_ties_are_shared_exactly(ties):
    ks = (1.0, 5.0, 25.0)
    ref = reference(ties, ks)
    for kw in ({}, {"sample_fraction": 0}, {"chunk_elems": 1000, "sample_block": 128, "sample_fraction": 0.01},
               {"workers": 2, "max_kept": 50}):
        an = run(ties, ks=ks, **kw)
        assert_matches(an, ref, ks)
    tk = an.topk_at(25.0)
    for r in ROLES:
        eq = int(tk.n_eq[r].sum())
        assert eq > 1000 and 0 < tk.tie_fraction(r) < 1  # the threshold really sits inside a large tie


def test_zero_threshold_when_few_entries_changed(sparse):
    ref = reference(sparse, (1.0, 2.0))
    for kw in ({}, {"sample_fraction": 0}):
        an = run(sparse, ks=(1.0, 2.0), **kw)
        assert_matches(an, ref, (1.0, 2.0))
        assert an.topk_at(1.0).threshold["lang"] == 0.0 and an.topk_at(1.0).threshold["math"] > 0


def test_truncated_file_is_a_user_error(trio, tmp_path):
    paths = {r: tmp_path / r for r in ("base", "math", "lang")}
    for r in paths:
        shutil.copytree(trio[r], paths[r])
    c = open_trio(paths)
    f = paths["lang"] / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)  # headers were read before: the tensor read finds the end
    with pytest.raises(UserError, match="truncated"):
        analyze(c["base"], c["math"], c["lang"], cache=False)
    with pytest.raises(UserError, match="truncated"):  # raised in a worker thread, reported here
        analyze(c["base"], c["math"], c["lang"], cache=False, sample_fraction=0, workers=2)


def test_non_finite_weights_are_a_user_error(trio, tmp_path):
    sd = read_dir(trio["lang"])
    sd["model.layers.1.self_attn.v_proj.weight"][3, 3] = float("nan")
    paths = {"base": trio["base"], "math": trio["math"], "lang": write_like(trio["lang"], tmp_path / "lang", sd)}
    with pytest.raises(UserError, match="model.layers.1.self_attn.v_proj.weight holds NaN or infinite values"):
        run(paths, ks=(1.0,))


def test_bad_arguments(trio):
    c = open_trio(trio)
    with pytest.raises(UserError, match="percentage"):
        analyze(c["base"], c["math"], c["lang"], ks=(0,), cache=False)
    with pytest.raises(UserError, match="workers must be at least 1"):
        analyze(c["base"], c["math"], c["lang"], workers=0, cache=False)
    with pytest.raises(UserError, match="no CUDA GPU|Unknown device"):
        analyze(c["base"], c["math"], c["lang"], device="cuda" if not torch.cuda.is_available() else "mps",
                cache=False)
