"""The streaming analysis against a direct computation on whole tensors (float64, sort-based top-k%)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from layerswap import Checkpoint, Plan, UserError, export_merge
from layerswap.analysis import NBINS, Analysis, analyze, bin_index, bin_lower_value, store
from layerswap.analysis.stream import ChunkStream

ROLES = ("math", "lang")


# ---- an independent reference ----------------------------------------------------------------

def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def reference(paths: dict[str, Path], ks=(), merged_dir: Path | None = None) -> dict:
    """Every metric from whole tensors: float64 sums, thresholds by a full sort of float32 |Δ|."""
    sd = {r: load_dir(paths[r]) for r in ("base", "math", "lang")}
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
    if merged_dir is not None:
        mm = load_dir(merged_dir)
        out["merged"] = {}
        for vs in ("base", "math", "lang"):
            out["merged"][vs] = {
                "relative": {n: float((mm[n].double() - sd[vs][n].double()).norm() / a[n].norm()) for n in names},
                "mean_abs": {n: float((mm[n].double() - sd[vs][n].double()).abs().mean()) for n in names},
            }
        mabs = {n: (mm[n].float() - sd["base"][n].float()).abs().reshape(-1) for n in names}
        out["merged_topk"] = {}
        for k in ks:
            K = out["topk"][k]["K"]
            t = float(torch.sort(torch.cat([mabs[n] for n in names]), descending=True).values[K - 1])
            gt = sum(int((mabs[n] > t).sum()) for n in names)
            eq = sum(int((mabs[n] == t).sum()) for n in names)
            out["merged_topk"][k] = {n: (int((mabs[n] > t).sum()) + (K - gt) / eq * int((mabs[n] == t).sum())) / K
                                     for n in names}
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
    base = load_dir(base_dir)
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


def layered_trio(root: Path, base_dir: Path, L: int, lang_layers: set[int], seed: int = 5) -> dict[str, Path]:
    """float32 experts: the language expert changes `lang_layers` strongly, the math expert the others."""
    base = load_dir(base_dir)
    g = torch.Generator().manual_seed(seed)
    out = {"base": base_dir}
    for r in ROLES:
        t = {}
        for n, v in base.items():
            layer = int(n.split(".layers.")[1].split(".")[0]) if ".layers." in n else None
            strong = (layer in lang_layers) if r == "lang" else (layer is not None and layer not in lang_layers)
            scale = 0.05 if strong else 0.005
            t[n] = v + scale * v.std() * torch.randn(v.shape, generator=g)
        out[r] = write_like(base_dir, root / r, t)
    return out


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


def test_group_aggregates_are_exact(trio):
    """A layer's relative change is over all its tensors together, not a mean of ratios."""
    an = run(trio, ks=(1.0,))
    sd = {r: load_dir(trio[r]) for r in ("base", "lang")}
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


def test_bins_are_ordered_and_bin_zero_is_exactly_zero():
    v = torch.tensor([0.0, 1e-45, 1e-38, 1e-8, 0.001, 0.0010001, 1.0, 1e30], dtype=torch.float32)
    b = bin_index(v).tolist()
    assert b[0] == 0 and all(x >= 1 for x in b[1:]) and b == sorted(b)
    for value, bin_ in zip(v.tolist()[1:], b[1:]):
        assert bin_lower_value(bin_) <= value < bin_lower_value(bin_ + 1)
    assert max(b) < NBINS


def test_non_layer_tensors_are_reported_separately(trio):
    an = run(trio, ks=(1.0,))
    nl = {an.tensors[i].ptype for i in an.non_layer()}
    assert nl == {"embed", "final_norm", "lm_head"}
    assert all(an.tensors[i].layer is None for i in an.non_layer())
    s = an.summary(1.0)
    tk = an.topk_at(1.0)
    assert s["topk_non_layer_lang"] == pytest.approx(float(tk.share("lang")[an.non_layer()].sum()))


# ---- the merged model ------------------------------------------------------------------------------

@pytest.mark.parametrize("plan", [Plan(b=2, u=1, tb=1, tu=1), Plan(b=1, u=1, tb=2, tu=1, transition="ramp",
                                                                   non_layer="avg")])
def test_merged_matches_the_exported_merge(trio_bf16, tmp_path, plan):
    c = open_trio(trio_bf16)
    export_merge(c["math"], c["lang"], plan, tmp_path / "merged")
    ref = reference(trio_bf16, (1.0, 10.0), merged_dir=tmp_path / "merged")
    an = analyze(c["base"], c["math"], c["lang"], ks=(1.0, 10.0), cache=False)
    ms = an.merged(plan, c["math"], c["lang"], c["base"])
    names = [t.name for t in an.tensors]
    for panel, vs in (("merged", "base"), ("merged-math", "math"), ("merged-lang", "lang")):
        for metric in ("relative", "mean_abs"):
            got = an.values(panel, metric, merged=ms)
            for i, n in enumerate(names):
                assert got[i] == pytest.approx(ref["merged"][vs][metric][n], rel=1e-5, abs=1e-12), (panel, metric, n)
    blended = [n for n, w in zip(names, ms.weights) if w not in (0.0, 1.0)]
    assert sorted(ms.streamed) == sorted(blended) and blended  # only blended tensors were read again
    for k in (1.0, 10.0):
        mt = ms.topk_at(k)
        lo, hi = mt.bounds()
        est = an.values("merged", "topk", k, ms)
        assert est.sum() == pytest.approx(1.0)
        for i, n in enumerate(names):
            exact = ref["merged_topk"][k][n]
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


def test_merged_refuses_other_checkpoints(trio, trio_bf16):
    an = run(trio, ks=())
    c = open_trio(trio_bf16)
    with pytest.raises(UserError, match="not the ones this analysis was computed on"):
        an.merged(Plan(b=1, u=1, tb=1, tu=1), c["math"], c["lang"], c["base"])


# ---- suggest plan ----------------------------------------------------------------------------------

def test_suggest_plan_follows_the_dominance_rule(trio, tmp_path):
    t = layered_trio(tmp_path, trio["base"], 6, lang_layers={0, 1, 5})
    an = run(t, ks=(1.0,))
    s = an.suggest_plan()
    assert s.lang_dominant == [True, True, False, False, False, True]
    assert (s.plan.b, s.plan.u, s.plan.tb, s.plan.tu) == (2, 1, 1, 1)
    assert "b=2, u=1" in s.markdown() and "`LL···L`" in s.markdown()
    s2 = an.suggest_plan("topk", 1.0)
    assert s2.lang_dominant == s.lang_dominant
    # swapped blocks that leave a single math layer: no room for transition layers
    t2 = layered_trio(tmp_path / "wide", trio["base"], 6, lang_layers={0, 1, 2, 4, 5})
    s3 = run(t2, ks=()).suggest_plan()
    assert s3.lang_dominant == [True, True, True, False, True, True]
    assert (s3.plan.b, s3.plan.u, s3.plan.tb, s3.plan.tu) == (3, 2, 0, 0)
    # an expert identical to the base never dominates: nothing to swap, and the note says so
    t3 = dict(t2, lang=trio["base"])
    s4 = run(t3, ks=()).suggest_plan()
    assert (s4.plan.b, s4.plan.u) == (0, 0) and "nothing to swap" in s4.note
    t4 = dict(t2, math=trio["base"])
    s5 = run(t4, ks=()).suggest_plan()
    assert (s5.plan.b, s5.plan.u) == (5, 0) and "one layer is left to the math expert" in s5.note
    s5.plan.validate(6)


# ---- cache -----------------------------------------------------------------------------------------

def test_cache_hit_and_invalidation(trio, tmp_path, monkeypatch):
    paths = {r: tmp_path / r for r in ("base", "math", "lang")}
    for r in paths:
        shutil.copytree(trio[r], paths[r])
    cache = tmp_path / "cache"
    first = run(paths, ks=(1.0,), cache=cache)
    assert not first.run.cached and len(list(cache.glob("*.npz"))) == 1
    again = run(paths, ks=(1.0,), cache=cache)
    assert again.run.cached
    for r in ROLES:
        np.testing.assert_array_equal(again.sq[r], first.sq[r])
        np.testing.assert_array_equal(again.topk_at(1.0).count(r), first.topk_at(1.0).count(r))
        np.testing.assert_array_equal(again.hist[r].counts, first.hist[r].counts)
    # a new k recomputes once and keeps the old one; both are then hits
    more = run(paths, ks=(5.0,), cache=cache)
    assert not more.run.cached and more.ks == [1.0, 5.0]
    assert run(paths, ks=(1.0, 5.0), cache=cache).run.cached
    # change one value of the language expert: the fingerprint changes, the analysis reruns
    sd = load_file(paths["lang"] / "model.safetensors")
    name = "model.layers.2.mlp.up_proj.weight"
    sd[name] = sd[name].clone()
    sd[name][0, 0] += 1.0
    save_file(sd, paths["lang"] / "model.safetensors", metadata={"format": "pt"})
    changed = run(paths, ks=(1.0,), cache=cache)
    assert not changed.run.cached
    i = changed.index(name)
    assert changed.sq["lang"][i] > first.sq["lang"][i]
    assert run(paths, ks=(1.0,), cache=cache).run.cached
    # a corrupt cache file is recomputed, not trusted
    for f in cache.glob("*.npz"):
        f.write_bytes(b"garbage")
    assert not run(paths, ks=(1.0,), cache=cache).run.cached
    # a new result keeps the folder at CACHE_KEEP analyses, the newest
    monkeypatch.setattr(store, "CACHE_KEEP", 3)
    for j in range(5):
        (cache / f"old{j}.npz").write_bytes(b"x")
    newest = run(paths, ks=(2.0,), cache=cache)
    assert len(list(cache.glob("*.npz"))) == 3 and Path(newest.run.cache_file).exists()


def test_save_and_load_roundtrip(trio, tmp_path):
    an = run(trio, ks=(1.0, 10.0))
    back = Analysis.load(an.save(tmp_path / "a.npz"))
    assert back.tensors == an.tensors and back.ks == an.ks
    assert back.rows(10.0) == an.rows(10.0)


# ---- the reader ------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 1000, 1 << 20])
def test_chunk_stream_reads_every_byte(trio_bf16, chunk):
    c = open_trio(trio_bf16)
    names = ["model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"]
    got = {n: [] for n in names}
    with ChunkStream([c["base"], c["lang"]], names, chunk_elems=chunk if chunk > 1 else 1) as s:
        for ch in s:
            assert ch.n <= max(chunk, 1)
            got[ch.name].append([t.clone() for t in ch.tensors])
            if chunk == 1 and ch.start > 50:
                break
    if chunk == 1:
        return
    for n in names:
        for j, role in enumerate(("base", "lang")):
            flat = torch.cat([parts[j] for parts in got[n]])
            assert torch.equal(flat, load_dir(trio_bf16[role])[n].reshape(-1))


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
    sd = load_dir(trio["lang"])
    sd["model.layers.1.self_attn.v_proj.weight"][3, 3] = float("nan")
    paths = {"base": trio["base"], "math": trio["math"], "lang": write_like(trio["lang"], tmp_path / "lang", sd)}
    with pytest.raises(UserError, match="model.layers.1.self_attn.v_proj.weight holds NaN or infinite values"):
        run(paths, ks=(1.0,))


def test_bad_inputs(trio, tmp_path):
    c = open_trio(trio)
    with pytest.raises(UserError, match="percentage"):
        analyze(c["base"], c["math"], c["lang"], ks=(0,), cache=False)
    with pytest.raises(UserError, match="workers must be at least 1"):
        analyze(c["base"], c["math"], c["lang"], workers=0, cache=False)
    with pytest.raises(UserError, match="no CUDA GPU|Unknown device"):
        analyze(c["base"], c["math"], c["lang"], device="cuda" if not torch.cuda.is_available() else "mps",
                cache=False)
    an = run(trio, ks=(1.0,))
    with pytest.raises(UserError, match="k=5 was not computed"):
        an.topk_at(5)
    with pytest.raises(UserError, match="not 'topk'"):
        an.values("merged-math", "topk", 1.0)
    cfg = json.loads((trio["base"] / "config.json").read_text())
    assert cfg["num_hidden_layers"] == an.num_layers
