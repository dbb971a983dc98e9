"""The compiled CPU passes (layerswap.analysis.compiled) against an independent NumPy computation of
slices: float64 sums, exact histograms, the window entries counted by value, the pairs, and the
merged model's distances and histogram."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from layerswap.analysis import compiled  # noqa: E402
from layerswap.analysis.kernels import MainPass, MergedPass, Window  # noqa: E402


def numpy_slice(a: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> dict:
    """|Δ| as float32 from the stored values, and its bin, with NumPy only."""
    fa, fm, fl = (x.float().numpy().astype(np.float32) for x in (a, m, l))
    dm, dl = np.abs(fm - fa), np.abs(fl - fa)
    bits = {"math": dm.view(np.int32).astype(np.int64), "lang": dl.view(np.int32).astype(np.int64)}
    bins = {r: (b + 0xFFFF) >> 16 for r, b in bits.items()}
    xa, xm, xl = fa.astype(np.float64), (fm - fa).astype(np.float64), (fl - fa).astype(np.float64)
    sums = [xa @ xa, xm @ xm, xl @ xl, xm @ xl, np.abs(xm).sum(), np.abs(xl).sum(), (xm - xl) @ (xm - xl),
            np.abs(xm - xl).sum()]
    return {"bits": bits, "bins": bins, "sums": np.array(sums)}


def slices(dtype: torch.dtype, n: int, seed: int, ulp: bool):
    g = torch.Generator().manual_seed(seed)
    a = (0.02 * torch.randn(n, generator=g)).to(dtype)
    if ulp:  # bf16 steps of one unit in the last place: huge ties at few distinct values
        out = []
        for p in (0.3, 0.2):
            bits = a.view(torch.int16).clone()
            mask = torch.rand(n, generator=g) < p
            bits[mask] += torch.where(torch.rand(n, generator=g) < 0.5, 1, -1).to(torch.int16)[mask]
            out.append(bits.view(torch.bfloat16))
        return a, out[0], out[1]
    m = (a.float() + 4e-4 * torch.randn(n, generator=g)).to(dtype)
    l = (a.float() + 2e-4 * torch.randn(n, generator=g) + 0.5 * (m.float() - a.float())).to(dtype)  # correlated
    return a, m, l


def windows_around(ref: dict, qs: list[float]) -> dict[float, dict[str, Window]]:
    out = {}
    for q in qs:
        w = {}
        for r in ("math", "lang"):
            b = int(np.quantile(ref["bins"][r], q))
            w[r] = Window(max(1, b - 1), b + 2)
        out[q] = w
    return out


@pytest.mark.parametrize("dtype,ulp,lanes", [(torch.bfloat16, False, 1), (torch.bfloat16, True, 1),
                                             (torch.float32, False, 1), (torch.float16, False, 1),
                                             (torch.bfloat16, False, 3), (torch.bfloat16, True, 2)])
def test_one_tensor_matches_numpy(dtype, ulp, lanes):
    n, step = 50_000, 7000 if lanes == 1 else 20_000  # lanes split a slice in blocks of 8192 entries
    a, m, l = slices(dtype, n, 1, ulp)
    ref = numpy_slice(a, m, l)
    wins = windows_around(ref, [0.97, 0.995])
    p = compiled.CompiledMainPass(1, wins, torch.device("cpu"), step, 1 << 22, lanes=lanes)
    for s in range(0, n, step):  # several slices of one tensor
        p.chunk(0, "t", [a[s:s + step], m[s:s + step], l[s:s + step]], min(step, n - s))
    p.finish(0)
    p.close()
    assert np.allclose(p.sums[:, 0], ref["sums"], rtol=1e-12, atol=0)
    hists = p.hists()
    for r in ("math", "lang"):
        want = np.bincount(ref["bins"][r], minlength=32768)
        lo, counts = hists[r].tensor(0)
        got = np.zeros(32768, np.int64)
        got[lo:lo + len(counts)] = counts
        assert np.array_equal(got, want)
        # every entry inside any window, by value
        inside = np.zeros(n, bool)
        for w in wins.values():
            inside |= (ref["bins"][r] >= w[r].lo) & (ref["bins"][r] < w[r].hi)
        u, c = np.unique(ref["bits"][r][inside], return_counts=True)
        (t, bits, cnt), = p.own[r]
        assert t == 0 and np.array_equal(bits, u) and np.array_equal(cnt, c)
    bm, bl = ref["bins"]["math"], ref["bins"]["lang"]
    keys = (ref["bits"]["math"] << 32) | ref["bits"]["lang"]
    for j, k in enumerate(p.ks):
        wm, wl = wins[k]["math"], wins[k]["lang"]
        both = (bm >= wm.lo) & (bl >= wl.lo)
        sure = both & (bm >= wm.hi) & (bl >= wl.hi)
        assert p.joint_def[j, 0] == sure.sum()
        u, c = np.unique(keys[both & ~sure], return_counts=True)
        got = p.pairs[j]
        if len(u):
            (t, gk, gc), = got
            assert np.array_equal(gk, u) and np.array_equal(gc, c)
        else:
            assert not got


def test_same_results_as_the_torch_kernels():
    """Both implementations of the main pass keep the same integers (sums: to rounding)."""
    a, m, l = slices(torch.bfloat16, 30_000, 4, False)
    ref = numpy_slice(a, m, l)
    wins = windows_around(ref, [0.99])
    out = []
    for make in (MainPass, lambda *a: compiled.CompiledMainPass(*a, lanes=2)):
        p = make(2, wins, torch.device("cpu"), 4096 * 5, 1 << 22)
        for t in range(2):
            for s in range(0, 30_000, 4096 * 5):
                p.chunk(t, "t", [a[s:s + 4096 * 5], m[s:s + 4096 * 5], l[s:s + 4096 * 5]], min(4096 * 5, 30_000 - s))
            p.finish(t)
        out.append(p)
    torch_p, comp_p = out
    assert np.allclose(torch_p.sums, comp_p.sums, rtol=1e-5)
    assert np.array_equal(torch_p.joint_def, comp_p.joint_def)
    for r in ("math", "lang"):
        ht, hc = torch_p.hists()[r], comp_p.hists()[r]
        assert np.array_equal(ht.counts, hc.counts) and np.array_equal(ht.lo, hc.lo)
        for (t1, b1, c1), (t2, b2, c2) in zip(torch_p.own[r], comp_p.own[r], strict=True):
            assert t1 == t2 and np.array_equal(b1, b2) and np.array_equal(c1, c2)
    for (t1, k1, c1), (t2, k2, c2) in zip(torch_p.pairs[0], comp_p.pairs[0], strict=True):
        assert t1 == t2 and np.array_equal(k1, k2) and np.array_equal(c1, c2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_merged_pass_matches_numpy(dtype, monkeypatch):
    import layerswap.analysis.compiled as comp

    monkeypatch.setattr(comp, "CPU_STEP", 1000)  # blends in several steps inside each slice
    n, step = 20_000, 6000
    a, m, l = slices(dtype, n, 3, False)
    w = 0.3
    acc = torch.zeros(n, dtype=torch.float32)  # mergekit's linear: zeros, then one fused multiply-add per input
    acc.addcmul_(m.float(), torch.tensor([1 - w])).addcmul_(l.float(), torch.tensor([w]))
    x = acc.to(dtype).float().numpy().astype(np.float64)
    refs = [v.float().numpy().astype(np.float64) for v in (a, m, l)]
    want = []
    for r in refs:
        want += [((x - r) ** 2).sum(), np.abs(x - r).sum()]
    bins = (np.abs((x - refs[0]).astype(np.float32)).view(np.int32).astype(np.int64) + 0xFFFF) >> 16
    out = []
    for cls in (comp.CompiledMergedPass, MergedPass):
        p = cls(np.array([w]), torch.device("cpu"), step)
        for s in range(0, n, step):
            p.chunk(0, "t", [a[s:s + step], m[s:s + step], l[s:s + step]], min(step, n - s))
        p.finish(0)
        out.append(p)
    comp_p, torch_p = out
    exact = dtype != torch.float32  # differences of bf16 / fp16 values are exact in float32
    assert np.allclose(comp_p.sums[:, 0], want, rtol=1e-12 if exact else 1e-6, atol=0)
    assert np.allclose(torch_p.sums[:, 0], want, rtol=1e-5)
    for p in (comp_p, torch_p):
        lo, counts = p.parts[0]
        got = np.zeros(32768, np.int64)
        got[lo:lo + len(counts)] = counts
        assert np.array_equal(got, np.bincount(bins, minlength=32768))


def test_kept_values_past_the_limit_give_up():
    a, m, l = slices(torch.bfloat16, 20_000, 2, False)
    wins = windows_around(numpy_slice(a, m, l), [0.9])
    p = compiled.CompiledMainPass(1, wins, torch.device("cpu"), 20_000, 10)
    p.chunk(0, "t", [a, m, l], 20_000)
    p.finish(0)
    assert p.overflow and not p.own["math"] and not p.pairs[0]


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_family_pass_keeps_each_pairs_numbers(lanes):
    """The math part computed once for two languages: each language's results are its pair's, to the bit, even
    when one language's window entries pass the limit and the other's do not."""
    n, step = 40_000, 20_000
    a, m, l1 = slices(torch.bfloat16, n, 5, False)
    l2 = slices(torch.bfloat16, n, 6, True)[2]  # a tie-heavy language: few distinct kept values
    ref = numpy_slice(a, m, l1)
    w1 = windows_around(ref, [0.95, 0.99])
    w2 = {k: {"math": w1[k]["math"], "lang": w["lang"]} for k, w in windows_around(numpy_slice(a, m, l2),
                                                                                    [0.95, 0.99]).items()}

    def feed(p, langs):
        for t in range(2):
            for s in range(0, n, step):
                p.chunk(t, "t", [a[s:s + step], m[s:s + step], *(x[s:s + step] for x in langs)], step)
            p.finish(t)
        p.close()
        return p

    pairs = [feed(compiled.CompiledMainPass(2, w, torch.device("cpu"), step, 1 << 22, lanes=lanes), [x])
             for w, x in ((w1, l1), (w2, l2))]
    limit = (pairs[0].kept + pairs[1].kept) // 2
    assert pairs[1].kept < limit < pairs[0].kept
    for max_kept in (1 << 22, limit):
        fam = feed(compiled.CompiledFamilyPass(2, [w1, w2], torch.device("cpu"), step, max_kept, lanes=lanes),
                   [l1, l2])
        for h, w, x in zip(fam.handlers, (w1, w2), (l1, l2)):
            p = feed(compiled.CompiledMainPass(2, w, torch.device("cpu"), step, max_kept, lanes=lanes), [x])
            assert np.array_equal(h.sums, p.sums) and np.array_equal(h.joint_def, p.joint_def)
            assert (h.overflow, h.kept) == (p.overflow, p.kept)
            for r in ("math", "lang"):
                assert np.array_equal(h.hists()[r].counts, p.hists()[r].counts)
                assert len(h.own[r]) == len(p.own[r])
                for x1, x2 in zip(h.own[r], p.own[r]):
                    assert x1[0] == x2[0] and np.array_equal(x1[1], x2[1]) and np.array_equal(x1[2], x2[2])
            for j in range(2):
                assert [(t, k.tolist(), c.tolist()) for t, k, c in h.pairs[j]] == \
                       [(t, k.tolist(), c.tolist()) for t, k, c in p.pairs[j]]
        assert [h.overflow for h in fam.handlers] == [max_kept == limit, False]


def test_the_choice_of_kernel(monkeypatch):
    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", "torch")
    assert not compiled.use_compiled("cpu", 1 << 30)
    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", "auto")
    assert compiled.use_compiled("cpu", compiled.MIN_ENTRIES) and not compiled.use_compiled("cuda:0", 1 << 30)
    assert not compiled.use_compiled("cpu", compiled.MIN_ENTRIES - 1)  # small models: numba's import costs more
    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", "compiled")
    assert compiled.use_compiled("cpu", 10)
    monkeypatch.setattr(compiled, "available", lambda: False)
    with pytest.raises(Exception, match="needs numba"):
        compiled.use_compiled("cpu", 10)
    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", "auto")
    assert not compiled.use_compiled("cpu", 1 << 30)  # without numba the torch kernels run
    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", "fast")
    with pytest.raises(Exception, match="auto, torch or compiled"):
        compiled.use_compiled("cpu", 10)


@pytest.mark.parametrize("kernel, during", [("compiled", 1), ("torch", 3)])
def test_the_compiled_lanes_run_with_one_torch_thread(trio, kernel, during, monkeypatch):
    """torch's pool beside the compiled lanes oversubscribes the cores (3x the wall time at 8B): the compiled pass
    runs with one torch thread and gives the caller's setting back; the torch kernels keep the caller's."""
    from layerswap import Checkpoint
    from layerswap.analysis import analyze, kernels

    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", kernel)
    seen = []

    def recording(cls):
        class Recording(cls):
            def __init__(self, *a, **k):
                seen.append(torch.get_num_threads())  # the setting while the main pass runs
                super().__init__(*a, **k)
        return Recording

    monkeypatch.setattr(compiled, "CompiledMainPass", recording(compiled.CompiledMainPass))
    monkeypatch.setattr("layerswap.analysis.passes.MainPass", recording(kernels.MainPass))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        analyze(*(Checkpoint.open(trio[r]) for r in ("base", "math", "lang")), cache=False)
        assert seen and set(seen) == {during} and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
