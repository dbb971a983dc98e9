"""The passes over the weights: the sample, the main pass, the two exact fallback passes, and the threaded driver."""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.roles import EXPERTS
from layerswap.core.runtime import Progress, torch_threads
from layerswap.analysis import compiled
from layerswap.analysis.bins import NBINS, SUB_BINS, Hist, as_float32, bin_index, boundary_bin, first_bits
from layerswap.analysis.kernels import MAX_WINDOW_BINS, CountPass, MainPass, ThresholdPass, Window
from layerswap.analysis.records import TensorMeta, TopK
from layerswap.analysis.stream import ChunkStream


@dataclass
class Computed:
    """What the passes found, before it becomes an `Analysis`."""

    sums: np.ndarray  # (8, T): ‖θ_base‖², ‖Δm‖², ‖Δl‖², ⟨Δm, Δl⟩, Σ|Δm|, Σ|Δl|, ‖θm − θl‖², Σ|θm − θl|
    hists: dict[str, Hist]
    topk: dict[float, TopK]
    passes: int
    bytes_read: int
    sample_entries: int


def compute(cks: list[Checkpoint], tensors: list[TensorMeta], ks: Sequence[float], device: str, *, chunk: int,
            sample_fraction: float, sample_max_entries: int, sample_block: int, max_kept: int, workers: int,
            progress: Progress | None) -> list[Computed]:
    """Every statistic of base, math and each language expert (`cks`: base, math, then one or more
    languages) over `tensors`, one `Computed` per language; see the package docstring.

    The checkpoints are streamed together, so base and math are read once for every language; each
    language's numbers are those of its own pair (every handler sees its pair's slices as a pair run would).
    """
    dev = torch.device(device)
    use = compiled.use_compiled(dev, sum(t.numel for t in tensors))
    args = (cks, tensors, ks, dev, chunk, use, sample_fraction, sample_max_entries, sample_block, max_kept, workers,
            progress)
    if use:  # its lanes take the cores: torch's own threads would only get in their way
        with torch_threads(1):
            return _compute(*args)
    return _compute(*args)


class FanOut:
    """A handler that feeds each slice of base, math and N language experts to N pair handlers (the torch
    kernels; `compiled.CompiledFamilyPass` shares the math expert's part instead)."""

    def __init__(self, handlers: list):
        self.handlers = handlers

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int) -> None:
        for i, h in enumerate(self.handlers):
            h.chunk(t, name, [raw[0], raw[1], raw[2 + i]], n)

    def finish(self, t: int) -> None:
        for h in self.handlers:
            h.finish(t)

    def absorb(self, other: "FanOut") -> None:
        for h, o in zip(self.handlers, other.handlers):
            h.absorb(o)

    def close(self) -> None:
        for h in self.handlers:
            close = getattr(h, "close", None)
            if close is not None:
                close()


def _compute(cks: list[Checkpoint], tensors: list[TensorMeta], ks: Sequence[float], dev, chunk: int,
             use_compiled: bool, sample_fraction: float, sample_max_entries: int, sample_block: int,
             max_kept: int, workers: int, progress: Progress | None) -> list[Computed]:
    langs = len(cks) - 2
    numel = np.asarray([t.numel for t in tensors], np.int64)
    N = int(numel.sum())
    Ks = {k: min(N, max(1, round(k / 100 * N))) for k in ks}
    nbytes, sample_n = 0, 0
    windows: list[dict[float, dict[str, Window]]] = [{} for _ in range(langs)]
    if ks and sample_fraction > 0:
        if progress:
            progress(0.0, "sampling |Δ| to place the top-k% window")
        ests, raws, nb, sample_n = sample(cks, tensors, sample_fraction, sample_max_entries, sample_block)
        nbytes += nb
        windows = [{k: {r: window_from_sample(est[r], raw[r], Ks[k], max_kept) for r in EXPERTS} for k in ks}
                   for est, raw in zip(ests, raws)]
    kept = max(1, max_kept // workers)

    def handler():  # each has `handlers`: one MainPass's results per language
        if use_compiled:  # a pair's fused loop, or a family's shared math part
            lanes = compiled.lanes_for(workers)
            if langs == 1:
                return compiled.CompiledMainPass(len(tensors), windows[0], dev, chunk, kept, lanes=lanes)
            return compiled.CompiledFamilyPass(len(tensors), windows, dev, chunk, kept, lanes=lanes)
        return FanOut([MainPass(len(tensors), w, dev, chunk, kept) for w in windows])

    h, nb = run_pass(cks, tensors, handler, dev, chunk, progress, "statistics", 0.02, 0.95 if ks else 1.0, workers)
    nbytes += nb
    out = []
    for i, ps in enumerate(h.handlers):
        ps.max_kept = max_kept
        hists = ps.hists()
        topk: dict[float, TopK] = {}
        for k in windows[i]:
            r = resolve(ps, hists, numel, k, Ks[k], N)
            if r is not None:
                topk[k] = r
        missing = [k for k in ks if k not in topk]
        own = 0
        if missing:  # this language's window missed: its own two exact passes (rare)
            more, own = fallback([cks[0], cks[1], cks[2 + i]], tensors, hists, missing, Ks, N, dev, chunk, progress,
                                 workers)
            topk.update(more)
        out.append(Computed(ps.sums, hists, {k: topk[k] for k in ks}, 3 if missing else 1, nbytes + own, sample_n))
    return out


# ---- the threaded driver ---------------------------------------------------------------------------

def split(tensors: Sequence[TensorMeta], workers: int) -> list[list[int]]:
    """Tensor indices in `workers` groups of about equal size, each in file order."""
    groups: list[list[int]] = [[] for _ in range(max(1, workers))]
    load = [0] * len(groups)
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].numel):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += tensors[i].numel
    return [sorted(g) for g in groups if g]


# The reader's requests: 16 MiB per file (at most 64 MiB a slot, however many files), 4 slots ahead. Against 8 MiB
# and 2 ahead, the cold 8B pair and family analyses took 15-17 % less time (docs/benchmarks.md, 2026-11-29).
READ_BYTES, SLOT_BYTES, PREFETCH = 16 << 20, 64 << 20, 4


def run_pass(cks: list[Checkpoint], tensors: Sequence[TensorMeta], make_handler: Callable, device: torch.device,
             chunk: int, progress: Progress | None, label: str, p0: float, p1: float, workers: int = 1):
    """Feed every slice of every tensor (base, math, lang) to a handler (see `kernels`).

    With several workers, each thread takes its own share of the tensors with its own reader and
    working memory (torch releases the GIL inside each operation), and the handlers are merged.
    Progress goes from `p0` to `p1`. Returns (handler, bytes read).
    """
    total = sum(t.numel for t in tensors) or 1
    groups = split(tensors, workers)
    done = [0] * len(groups)
    nbytes = [0] * len(groups)
    handlers = [make_handler() for _ in groups]
    errors: list[BaseException] = []

    def work(g: int, report: bool) -> None:
        idx = groups[g]
        h = handlers[g]
        last_report = -1.0
        try:
            with ChunkStream(cks, [tensors[i].name for i in idx], chunk_elems=chunk, device=str(device),
                             read_bytes=max(1 << 20, min(READ_BYTES, SLOT_BYTES // len(cks)) // len(groups)),
                             prefetch=PREFETCH) as s:
                for c in s:
                    t = idx[c.index]
                    if c.n:
                        h.chunk(t, c.name, c.tensors, c.n)
                    if c.last:
                        h.finish(t)
                    done[g] += c.n
                    frac = sum(done) / total
                    if report and progress and (frac - last_report >= 0.01 or frac >= 1.0):
                        last_report = frac
                        progress(p0 + (p1 - p0) * frac, f"{label}: {c.name}")
                    if errors:
                        return
                nbytes[g] = s.bytes_read
        except BaseException as e:  # raised in the calling thread
            errors.append(e)
        finally:
            close = getattr(h, "close", None)  # a handler with threads of its own (compiled.CompiledFamilyPass)
            if close is not None:
                close()

    if len(groups) == 1:
        work(0, True)
    else:
        threads = [threading.Thread(target=work, args=(g, False), name=f"layerswap-analysis-{g}", daemon=True)
                   for g in range(len(groups))]
        for th in threads:
            th.start()
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=0.25)
            if progress:
                progress(p0 + (p1 - p0) * sum(done) / total, f"{label} ({len(groups)} workers)")
    if errors:
        raise errors[0]
    h = handlers[0]
    for other in handlers[1:]:
        h.absorb(other)
    return h, sum(nbytes)


# ---- the sample, and the window it places --------------------------------------------------------

def sample(cks: list[Checkpoint], tensors: Sequence[TensorMeta], fraction: float, max_entries: int,
           block: int = 8192) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], int, int]:
    """Histograms of each expert's |Δ| at sampled positions (blocks spread over every tensor).

    `cks`: base, math, then one or more language experts (base and math are read once for all).
    Returns, per language, per role, the estimated count of the whole model in each bin (each
    sampled entry stands for numel/sampled entries of its tensor) and the raw sampled counts; then
    the bytes read and the number of entries sampled.
    """
    N = sum(t.numel for t in tensors)
    f = min(fraction, max_entries / max(N, 1))
    roles = ["math"] + [f"lang{i}" for i in range(len(cks) - 2)]  # the math expert's counts serve every language
    est = {r: np.zeros(NBINS) for r in roles}
    raw = {r: np.zeros(NBINS, np.int64) for r in roles}
    nbytes = sampled = 0
    for t in tensors:
        if t.numel == 0:
            continue
        want = max(1, round(t.numel * f / block))
        if want * block * 2 >= t.numel:
            ranges = [(0, t.numel)]
        else:
            rng = np.random.default_rng(zlib.crc32(t.name.encode()))
            starts = np.sort(rng.choice(t.numel // block, size=want, replace=False)) * block
            ranges = [(int(s), block) for s in starts]
        got = sum(c for _, c in ranges)
        size = cks[0].tensors[t.name].nbytes // t.numel
        counts = {r: np.zeros(NBINS, np.int64) for r in roles}
        for start, count in ranges:
            a, *xs = (ck.read(t.name, start, count) for ck in cks)
            a = a.to(torch.float32)
            nbytes += len(cks) * count * size
            for r, x in zip(roles, xs):
                counts[r] += torch.bincount(bin_index((x - a).abs_()), minlength=NBINS).numpy()
        for r in roles:
            raw[r] += counts[r]
            est[r] += counts[r] * (t.numel / got)
        sampled += got
    ests = [{"math": est["math"], "lang": est[r]} for r in roles[1:]]
    raws = [{"math": raw["math"], "lang": raw[r]} for r in roles[1:]]
    return ests, raws, nbytes, sampled


def window_from_sample(est: np.ndarray, raw: np.ndarray, K: int, max_kept: int) -> Window:
    """Bins around the sample's estimate of the bin of the K-th largest |Δ|, with a generous margin.

    The margin is 3% of K plus 4 standard errors of a binomial count of the sampled top set (the
    sample is drawn in blocks, so its real error is larger; a miss only costs the exact passes).
    """
    above_est = np.cumsum(est[::-1])[::-1]  # estimated entries in bins >= b
    above_raw = np.cumsum(raw[::-1])[::-1]
    if above_raw[0] == 0:
        return Window(1, 1)
    b_star = np.flatnonzero(above_est >= K)
    m = int(above_raw[b_star[-1]]) if len(b_star) else int(above_raw[0])  # sampled entries in the top set
    delta = 0.03 + 4.0 / math.sqrt(max(m, 1))
    delta = min(delta, 0.5, max(max_kept / (4.0 * K), 0.002))
    ge_hi = np.flatnonzero(above_est >= K * (1 - delta))
    ge_lo = np.flatnonzero(above_est >= K * (1 + delta))
    hi = int(ge_hi[-1]) + 1 if len(ge_hi) else 1
    lo = int(ge_lo[-1]) if len(ge_lo) else 1
    hi, lo = max(hi, 1), max(lo, 1)
    lo = min(lo, hi)
    if hi - lo > MAX_WINDOW_BINS:  # a flat stretch of the distribution: keep the bins nearest the estimate
        mid = int(b_star[-1]) if len(b_star) else lo
        lo = max(lo, min(mid - MAX_WINDOW_BINS // 2, hi - MAX_WINDOW_BINS))
        hi = lo + MAX_WINDOW_BINS
    return Window(lo, hi)


# ---- exact top-k% from the main pass, or from two more passes ---------------------------------------

def _gather(store: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not store:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    ts = np.concatenate([np.full(len(u), t) for t, u, _ in store])
    return ts, np.concatenate([u for _, u, _ in store]), np.concatenate([c for _, _, c in store])


def resolve(ps: MainPass, hists: dict[str, Hist], numel: np.ndarray, k: float, K: int, N: int) -> TopK | None:
    """Exact thresholds, counts and intersections for one k from the main pass, or None if a window missed."""
    if ps.overflow:
        return None
    j = ps.ks.index(k)
    T = len(numel)
    thr, n_gt, n_eq = {}, {}, {}
    for r in EXPERTS:
        w = ps.windows[k][r]
        above = hists[r].count_ge(w.hi)
        if w.lo == w.hi:  # zero-threshold window: right only if fewer than K entries are nonzero
            if w.hi != 1 or int(above.sum()) >= K:
                return None
            thr[r], n_gt[r], n_eq[r] = 0.0, above, numel - above
            continue
        ts, bits, cnt = _gather(ps.own[r])
        vals = as_float32(bits)
        bins = (bits + 0xFFFF) >> 16  # bin_index of the kept bit patterns
        inw = (bins >= w.lo) & (bins < w.hi)
        ts, vals, cnt = ts[inw], vals[inw], cnt[inw]
        need = K - int(above.sum())
        if need < 1 or need > int(cnt.sum()):
            return None
        uv, inv = np.unique(vals, return_inverse=True)
        per_value = np.bincount(inv, weights=cnt, minlength=len(uv))
        from_top = np.cumsum(per_value[::-1])  # entries >= each value, largest value first
        t_star = float(uv[::-1][int(np.searchsorted(from_top, need))])
        thr[r] = t_star
        n_gt[r] = above + np.bincount(ts[vals > t_star], weights=cnt[vals > t_star], minlength=T).astype(np.int64)
        n_eq[r] = np.bincount(ts[vals == t_star], weights=cnt[vals == t_star], minlength=T).astype(np.int64)
    G = ps.joint_def[j].astype(np.float64)
    GE, EG, EE = np.zeros(T), np.zeros(T), np.zeros(T)
    ts, keys, cnt = _gather(ps.pairs[j])
    if len(ts):
        vm, vl = as_float32(keys >> 32), as_float32(keys & 0xFFFFFFFF)
        gm, em = vm > thr["math"], vm == thr["math"]
        gl, el = vl > thr["lang"], vl == thr["lang"]
        for arr, mask in ((G, gm & gl), (GE, gm & el), (EG, em & gl), (EE, em & el)):
            arr += np.bincount(ts[mask], weights=cnt[mask], minlength=T)
    zm, zl = thr["math"] == 0.0, thr["lang"] == 0.0
    if zl:  # |Δ| == 0 is the complement of |Δ| > 0
        GE = n_gt["math"] - G
    if zm:
        EG = n_gt["lang"] - G
    if zm and zl:
        EE = numel - n_gt["math"] - n_gt["lang"] + G
    elif zm:
        EE = n_eq["lang"] - GE
    elif zl:
        EE = n_eq["math"] - EG
    return _topk(k, K, N, thr, n_gt, n_eq, G, GE, EG, EE, 1)


def _topk(k, K, N, thr, n_gt, n_eq, G, GE, EG, EE, passes) -> TopK:
    """A TopK from the class counts: G (both above), GE / EG (one above, one tied), EE (both tied)."""
    f = {}
    for r in EXPERTS:
        gt, eq = int(n_gt[r].sum()), int(n_eq[r].sum())
        f[r] = (K - gt) / eq if eq else 0.0
    joint = G + f["lang"] * GE + f["math"] * EG + f["math"] * f["lang"] * EE
    return TopK(k, K, N, thr, n_gt, n_eq, np.asarray(joint, dtype=float), passes)


def fallback(cks, tensors, hists, ks, Ks, N, dev, chunk, progress, workers) -> tuple[dict[float, TopK], int]:
    """Exact top-k% in two more passes: locate each threshold inside its bin, then count."""
    bins, need = {}, {}
    for k in ks:
        for r in EXPERTS:
            tot = hists[r].total()
            b = boundary_bin(tot, Ks[k])
            bins[(k, r)] = b
            need[(k, r)] = Ks[k] - int(tot[b + 1:].sum())
    tp = ThresholdPass(bins, dev, chunk)
    nbytes = 0
    if tp.bins:
        tp, nb = run_pass(cks, tensors, lambda: ThresholdPass(bins, dev, chunk), dev, chunk, progress,
                          "locating the top-k% thresholds", 0.95, 0.97, workers)
        nbytes += nb
    thr: dict[float, dict[str, float]] = {k: {} for k in ks}
    for (k, r), b in bins.items():
        if b == 0:
            thr[k][r] = 0.0
            continue
        fine = tp.fine[(k, r)].cpu().numpy()
        from_top = np.cumsum(fine[::-1])
        sub = SUB_BINS - 1 - int(np.searchsorted(from_top, need[(k, r)]))
        thr[k][r] = float(as_float32([first_bits(b) + sub])[0])
    cp, nb = run_pass(cks, tensors, lambda: CountPass(len(tensors), thr, dev, chunk), dev, chunk, progress,
                      "counting the top-k% sets", 0.97, 1.0, workers)
    nbytes += nb
    out = {}
    for k in ks:
        c = cp.counts[k]
        n_gt, n_eq = {"math": c[0], "lang": c[2]}, {"math": c[1], "lang": c[3]}
        out[k] = _topk(k, Ks[k], N, thr[k], n_gt, n_eq, c[4].astype(float), c[5].astype(float),
                       c[6].astype(float), c[7].astype(float), 3)
    return out, nbytes
