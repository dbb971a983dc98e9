"""The main pass (and the merged model's pass) on CPU as compiled loops (numba): a slice's statistics in one sweep.

The torch kernels (`kernels.MainPass`) make about fifteen passes over each slice (conversions,
differences, dot products, bin indices, two 32768-bin ``bincount`` calls and their allocation,
the window selection, ``unique`` of the kept entries). This loop reads each entry of the three
slices once and does it all: float64 sums, the exact |Δ| histograms, the window entries counted
in place (a dense count per float32 bit pattern of the window, so no sorting however many
entries tie), and the both-experts pairs (kept as 64-bit keys, compressed by value per tensor).

Results are identical to the torch kernels' (histograms, windows, pairs: exact integers) or
closer to the float64 reference (sums accumulate in float64 per entry instead of float32 dot
products per slice). The merged model's pass takes the merged values from `merging.blend_into`
(the export's bits) and sweeps them once for its sums and histogram. numba is optional: without
it, on CUDA, or for small models (`use_compiled`), the torch kernels run.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from layerswap.core.errors import UserError
from layerswap.merge.merging import CPU_STEP, blend_into
from layerswap.core.roles import EXPERTS
from layerswap.analysis.bins import NBINS, SUB_BINS, Hist, first_bits
from layerswap.analysis.kernels import MainPass, MergedPass, Window, merge_counts

PAIRS_ROOM = 1 << 20  # pair keys held before they are compressed by value


def available() -> bool:
    """Whether the compiled kernels can run here (numba importable)."""
    try:
        import numba  # noqa: F401
    except Exception:  # not installed, or broken against this numpy
        return False
    return True


MIN_ENTRIES = 1 << 26  # below this many entries per model, importing numba (~0.4 s of CPU) costs more than it saves


def use_compiled(device, entries: int) -> bool:
    """The one decision: the compiled loop on CPU for models of `MIN_ENTRIES` entries or more when numba
    is there; ``LAYERSWAP_ANALYSIS_KERNEL=torch`` or ``compiled`` forces a choice (tests, benchmarks)."""
    choice = os.environ.get("LAYERSWAP_ANALYSIS_KERNEL", "auto")
    if choice not in ("auto", "torch", "compiled"):
        raise UserError(f"LAYERSWAP_ANALYSIS_KERNEL must be auto, torch or compiled (got {choice!r}).")
    if choice == "torch" or str(device).split(":")[0] != "cpu":
        return False
    if choice == "compiled":
        if not available():
            raise UserError("LAYERSWAP_ANALYSIS_KERNEL=compiled needs numba: pip install numba (or unset it).")
        return True
    return entries >= MIN_ENTRIES and available()


_KERNELS: dict = {}


def kernels() -> dict:
    """The compiled functions, built on first use (cached on disk by numba)."""
    if not _KERNELS:
        from layerswap.analysis._numba import BLOCK, lang_slice, main_slice, math_slice, merged_slice

        _KERNELS.update(main=main_slice, math=math_slice, lang=lang_slice, merged=merged_slice, block=BLOCK)
    return _KERNELS


def intervals(windows: list[Window]) -> list[tuple[int, int]]:
    """Disjoint bin intervals [lo, hi) covering every non-empty window."""
    out: list[list[int]] = []
    for w in sorted((w for w in windows if w.lo < w.hi), key=lambda w: w.lo):
        if out and w.lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], w.hi)
        else:
            out.append([w.lo, w.hi])
    return [(lo, hi) for lo, hi in out]


def _raw_array(x, f32_buf: np.ndarray) -> np.ndarray:
    """A slice as the loop reads it: bf16 as its uint16 bit patterns, float32 as is, other dtypes converted."""
    import torch

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    if x.dtype == torch.float32:
        return x.numpy()
    out = f32_buf[: x.numel()]
    torch.from_numpy(out).copy_(x)
    return out


def lanes_for(workers: int) -> int:
    """Threads per worker for the compiled main pass: the cores shared out among the workers, at most
    `MAX_LANES` (each slice is split between them; the kernels release the GIL)."""
    return max(1, min(MAX_LANES, (os.cpu_count() or 1) // max(1, workers)))


MAX_LANES = 4


class _PairLane:
    """One thread's share of every slice of a pair: its own sums, histograms, window counts and pair keys."""

    def __init__(self, nk: int, dense_sizes: list[int], chunk: int, block: int):
        self.acc = np.zeros(8)
        self.hist = np.zeros((2, NBINS), np.int64)
        self.dense = [np.zeros(max(n, 1), np.int64) for n in dense_sizes]
        self.joint = np.zeros(max(nk, 1), np.int64)
        self.keys = np.empty(PAIRS_ROOM + chunk, np.int64)
        self.n_keys = 0
        self.sel = np.empty(block + 1, np.int64)  # main_slice's block of selected positions


class CompiledMainPass(MainPass):
    """`MainPass` of one pair with the per-slice work in one compiled loop, each slice split among `lanes`
    threads (same results; CPU only)."""

    def __init__(self, T: int, windows: dict[float, dict[str, Window]], device, chunk: int, max_kept: int,
                 lanes: int = 1):
        super().__init__(T, windows, device, chunk, max_kept)
        self.k = kernels()
        nk = len(self.ks)
        self.wlo = np.ones((2, max(nk, 1)), np.int64)  # per role, per k: window bins [lo, hi)
        self.whi = np.ones((2, max(nk, 1)), np.int64)
        for j, k in enumerate(self.ks):
            for i, r in enumerate(EXPERTS):
                self.wlo[i, j], self.whi[i, j] = windows[k][r].lo, windows[k][r].hi
        self.lo_sel_arr = np.array([self.lo_sel[r] for r in EXPERTS], np.int64)
        self.no_sel = np.full(2, NBINS, np.int64)  # no bin reaches it: nothing selected
        # the dense counts of each role's window entries: one array per disjoint interval of bins
        self.ivals = {r: intervals([windows[k][r] for k in self.ks]) for r in EXPERTS}
        self.ival_lo = [np.array([lo for lo, _ in self.ivals[r]] or [0], np.int64) for r in EXPERTS]
        self.ival_hi = [np.array([hi for _, hi in self.ivals[r]] or [0], np.int64) for r in EXPERTS]
        self.ival_off = []
        for r in EXPERTS:
            sizes = [(hi - lo) * SUB_BINS for lo, hi in self.ivals[r]]
            self.ival_off.append(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        self.lanes = [_PairLane(nk, [int(o[-1]) for o in self.ival_off], chunk, self.k["block"]) for _ in range(lanes)]
        self.pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="layerswap-lane") if lanes > 1 else None
        self.f32 = [np.empty(chunk, np.float32) for _ in range(3)]

    def chunk(self, t: int, name: str, raw, n: int) -> None:
        a, m, l_ = (_raw_array(x, buf) for x, buf in zip(raw, self.f32))  # one dtype (check_compatible)
        keep = bool(self.windows) and not self.overflow
        sel, nk = (self.lo_sel_arr, len(self.ks)) if keep else (self.no_sel, 0)
        block = self.k["block"]
        parts = min(len(self.lanes), max(1, n // block))
        cuts = [n * i // parts // block * block for i in range(parts)] + [n]

        def run(i: int) -> None:
            lane, s, e = self.lanes[i], cuts[i], cuts[i + 1]
            lane.n_keys = self.k["main"](
                a[s:e], m[s:e], l_[s:e], lane.acc, lane.hist, sel, self.wlo, self.whi, nk,
                self.ival_lo[0], self.ival_hi[0], self.ival_off[0], lane.dense[0],
                self.ival_lo[1], self.ival_hi[1], self.ival_off[1], lane.dense[1],
                lane.joint, lane.keys, lane.n_keys, lane.sel)

        others = [self.pool.submit(run, i) for i in range(1, parts)]
        run(0)
        for f in others:
            f.result()
        for lane in self.lanes:
            if not np.isfinite(lane.acc).all():
                raise UserError(f"{name} holds NaN or infinite values in the base or an expert; the analysis needs "
                                "finite weights (check the checkpoint).")
            if lane.n_keys > PAIRS_ROOM:
                self._compress_pairs(lane)

    def _compress_pairs(self, lane: _PairLane) -> None:
        if lane.n_keys:
            u, c = np.unique(lane.keys[: lane.n_keys], return_counts=True)
            self.pending.setdefault("pairs", []).append((u, c))
            self.pending_n += len(u)
            lane.n_keys = 0
            if self.kept + self.pending_n > self.max_kept:
                self._give_up()

    def finish(self, t: int) -> None:
        first, rest = self.lanes[0], self.lanes[1:]
        for lane in rest:  # into the first lane
            first.acc += lane.acc
            first.hist += lane.hist
            first.joint += lane.joint
            lane.acc[:], lane.hist[:], lane.joint[:] = 0.0, 0, 0
            for i in range(2):
                nz = np.flatnonzero(lane.dense[i])
                first.dense[i][nz] += lane.dense[i][nz]
                lane.dense[i][nz] = 0
        self.sums[:, t] = first.acc
        first.acc[:] = 0.0
        for i, r in enumerate(EXPERTS):
            self.parts[r][t] = Hist.trim(first.hist[i])
            first.hist[i] = 0
        self.joint_def[:, t] += first.joint[: len(self.ks)]
        first.joint[:] = 0
        for lane in self.lanes:
            self._compress_pairs(lane)
        if not self.overflow:
            for i, r in enumerate(EXPERTS):
                d = first.dense[i]
                nz = np.flatnonzero(d)
                if len(nz):
                    self.own[r].append((t, self._bits(i, nz), d[nz].copy()))
                    self.kept += len(nz)
                    d[nz] = 0
            pending = self.pending.get("pairs")
            if pending:
                u, c = merge_counts(pending)
                bm, bl = ((u >> 32) + 0xFFFF) >> 16, ((u & 0xFFFFFFFF) + 0xFFFF) >> 16
                for j in range(len(self.ks)):
                    cand = (bm >= self.wlo[0, j]) & (bl >= self.wlo[1, j])
                    cand &= ~((bm >= self.whi[0, j]) & (bl >= self.whi[1, j]))
                    if cand.any():
                        self.pairs[j].append((t, u[cand], c[cand]))
                        self.kept += int(cand.sum())
        else:
            for lane in self.lanes:
                for d in lane.dense:
                    d[:] = 0
        self.pending, self.pending_n = {}, 0
        if self.kept > self.max_kept:
            self._give_up()

    @property
    def handlers(self) -> list[MainPass]:
        """Its one language's results (as `CompiledFamilyPass.handlers`)."""
        return [self]

    def close(self) -> None:
        """Stop the lane threads (the pass is over)."""
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def _bits(self, i: int, pos: np.ndarray) -> np.ndarray:
        """float32 bit patterns of positions in role `i`'s dense counts."""
        off = self.ival_off[i]
        which = np.searchsorted(off, pos, side="right") - 1
        return first_bits(self.ival_lo[i][which]) + (pos - off[which])


class _Dense:
    """One role's window entries counted densely: one array per disjoint interval of bins of its windows."""

    def __init__(self, windows: list[Window]):
        ivals = intervals(windows)
        self.lo = np.array([lo for lo, _ in ivals] or [0], np.int64)
        self.hi = np.array([hi for _, hi in ivals] or [0], np.int64)
        self.off = np.concatenate([[0], np.cumsum([(hi - lo) * SUB_BINS for lo, hi in ivals])]).astype(np.int64)

    def array(self) -> np.ndarray:
        return np.zeros(max(int(self.off[-1]), 1), np.int64)

    def bits(self, pos: np.ndarray) -> np.ndarray:
        """float32 bit patterns of positions in the dense counts."""
        which = np.searchsorted(self.off, pos, side="right") - 1
        return first_bits(self.lo[which]) + (pos - self.off[which])


class _Lane:
    """One thread's share of every slice, for the math expert (`keys` None) or one language: its own
    sums, histogram, window counts and (a language) pair keys."""

    def __init__(self, nsums: int, dense: _Dense, nk: int, chunk: int, block: int, pairs: bool):
        self.acc = np.zeros(nsums)
        self.hist = np.zeros(NBINS, np.int64)
        self.dense = dense.array()
        self.joint = np.zeros(max(nk, 1), np.int64)
        self.keys = np.empty(PAIRS_ROOM + chunk, np.int64) if pairs else None
        self.n_keys = 0
        self.sel = np.empty(block + 1, np.int64)  # the kernels' block of selected positions

    def absorb(self, other: "_Lane") -> None:
        """Add another lane's counts for the current tensor into this one, and clear them there."""
        self.acc += other.acc
        self.hist += other.hist
        self.joint += other.joint
        other.acc[:], other.hist[:], other.joint[:] = 0.0, 0, 0
        nz = np.flatnonzero(other.dense)
        self.dense[nz] += other.dense[nz]
        other.dense[nz] = 0


class CompiledFamilyPass:
    """The main pass of base, math and N >= 2 language experts on CPU: each slice's math part (Δm's
    histogram and window entries) computed once, then each language's part (the pair's sums, by the
    same function on the same blocks as `CompiledMainPass`, Δl's histogram, window entries and pairs),
    each slice split among `lanes` threads. `handlers[i]` holds language i's results as the pair's
    `CompiledMainPass` does, to the bit."""

    def __init__(self, T: int, windows: list[dict[float, dict[str, Window]]], device, chunk: int, max_kept: int,
                 lanes: int = 1):
        self.k = kernels()
        self.handlers = [MainPass(T, w, device, chunk, max_kept) for w in windows]
        self.ks = self.handlers[0].ks
        nk, block = len(self.ks), self.k["block"]
        # the math windows come from the math expert's sample: one for every language
        self.m_dense = _Dense([windows[0][k]["math"] for k in self.ks])
        self.m_sel = self.handlers[0].lo_sel["math"]
        self.l_dense = [_Dense([w[k]["lang"] for k in self.ks]) for w in windows]
        self.wlo, self.whi = [], []  # per language, (role, k): window bins [lo, hi)
        for w in windows:
            lo, hi = np.ones((2, max(nk, 1)), np.int64), np.ones((2, max(nk, 1)), np.int64)
            for j, k in enumerate(self.ks):
                for i, r in enumerate(EXPERTS):
                    lo[i, j], hi[i, j] = w[k][r].lo, w[k][r].hi
            self.wlo.append(lo)
            self.whi.append(hi)
        self.m_lanes = [_Lane(0, self.m_dense, 0, chunk, block, False) for _ in range(lanes)]
        self.l_lanes = [[_Lane(8, d, nk, chunk, block, True) for _ in range(lanes)] for d in self.l_dense]
        self.pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="layerswap-lane") if lanes > 1 else None
        self.f32 = [np.empty(chunk, np.float32) for _ in range(2 + len(windows))]

    def chunk(self, t: int, name: str, raw, n: int) -> None:
        a, m, *ls = (_raw_array(x, buf) for x, buf in zip(raw, self.f32))  # one dtype (check_compatible)
        keep = [bool(h.windows) and not h.overflow for h in self.handlers]
        m_sel = self.m_sel if any(keep) else NBINS  # NBINS: no bin reaches it, nothing is selected
        block = self.k["block"]
        parts = min(len(self.m_lanes), max(1, n // block))
        cuts = [n * i // parts // block * block for i in range(parts)] + [n]
        md = self.m_dense

        def run(p: int) -> None:
            s, e = cuts[p], cuts[p + 1]
            ml = self.m_lanes[p]
            self.k["math"](a[s:e], m[s:e], ml.hist, m_sel, md.lo, md.hi, md.off, ml.dense, ml.sel)
            for i, x in enumerate(ls):
                ll, d, h = self.l_lanes[i][p], self.l_dense[i], self.handlers[i]
                ll.n_keys = self.k["lang"](
                    a[s:e], m[s:e], x[s:e], ll.acc, ll.hist, h.lo_sel["lang"] if keep[i] else NBINS,
                    self.wlo[i], self.whi[i], len(self.ks) if keep[i] else 0, d.lo, d.hi, d.off, ll.dense,
                    ll.joint, ll.keys, ll.n_keys, ll.sel)

        others = [self.pool.submit(run, p) for p in range(1, parts)]
        run(0)
        for f in others:
            f.result()
        for lane in self.m_lanes + [x for lanes in self.l_lanes for x in lanes]:
            if not np.isfinite(lane.acc).all():
                raise UserError(f"{name} holds NaN or infinite values in the base or an expert; the analysis needs "
                                "finite weights (check the checkpoint).")
        for i, lanes in enumerate(self.l_lanes):
            for lane in lanes:
                if lane.n_keys > PAIRS_ROOM:
                    self._compress_pairs(self.handlers[i], lane)

    @staticmethod
    def _compress_pairs(h: MainPass, lane: _Lane) -> None:
        if lane.n_keys:
            u, c = np.unique(lane.keys[: lane.n_keys], return_counts=True)
            h.pending.setdefault("pairs", []).append((u, c))
            h.pending_n += len(u)
            lane.n_keys = 0
            if h.kept + h.pending_n > h.max_kept:
                h._give_up()

    def finish(self, t: int) -> None:
        mf = self.m_lanes[0]
        for lane in self.m_lanes[1:]:
            mf.absorb(lane)
        m_hist = Hist.trim(mf.hist)
        nz = np.flatnonzero(mf.dense)
        m_own = (t, self.m_dense.bits(nz), mf.dense[nz].copy()) if len(nz) else None
        for i, h in enumerate(self.handlers):
            lf = self.l_lanes[i][0]
            for lane in self.l_lanes[i][1:]:
                lf.absorb(lane)
            h.sums[:, t] = lf.acc
            h.parts["math"][t], h.parts["lang"][t] = m_hist, Hist.trim(lf.hist)
            h.joint_def[:, t] += lf.joint[: len(self.ks)]
            lf.acc[:], lf.hist[:], lf.joint[:] = 0.0, 0, 0
            for lane in self.l_lanes[i]:
                self._compress_pairs(h, lane)
            lz = np.flatnonzero(lf.dense)
            if not h.overflow:
                for r, own in (("math", m_own), ("lang", (t, self.l_dense[i].bits(lz), lf.dense[lz].copy()))):
                    if own is not None and len(own[1]):
                        h.own[r].append(own)
                        h.kept += len(own[1])
                self._keep_pairs(t, i, h)
            lf.dense[lz] = 0
            h.pending, h.pending_n = {}, 0
            if h.kept > h.max_kept:
                h._give_up()
        mf.hist[:], mf.dense[nz] = 0, 0

    def _keep_pairs(self, t: int, i: int, h: MainPass) -> None:
        """The tensor's pair keys that window j still has to decide (not both surely in), per k."""
        pending = h.pending.get("pairs")
        if not pending:
            return
        u, c = merge_counts(pending)
        bm, bl = ((u >> 32) + 0xFFFF) >> 16, ((u & 0xFFFFFFFF) + 0xFFFF) >> 16
        wlo, whi = self.wlo[i], self.whi[i]
        for j in range(len(self.ks)):
            cand = (bm >= wlo[0, j]) & (bl >= wlo[1, j])
            cand &= ~((bm >= whi[0, j]) & (bl >= whi[1, j]))
            if cand.any():
                h.pairs[j].append((t, u[cand], c[cand]))
                h.kept += int(cand.sum())

    def absorb(self, other: "CompiledFamilyPass") -> None:
        for h, o in zip(self.handlers, other.handlers):
            h.absorb(o)

    def close(self) -> None:
        """Stop the lane threads (the pass is over)."""
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


class CompiledMergedPass(MergedPass):
    """`MergedPass` with the statistics in one compiled loop; the merged values come from `blend_into`,
    so they are the export's bits (CPU only)."""

    def __init__(self, weights: np.ndarray, device, chunk: int):
        import torch

        super().__init__(weights, device, chunk)
        self.k = kernels()
        self.np_acc = np.zeros(6)
        self.np_hist = np.zeros(NBINS, np.int64)
        self.acc32 = torch.empty(min(CPU_STEP, chunk), dtype=torch.float32)
        self.scratch = torch.empty(min(CPU_STEP, chunk), dtype=torch.float32)
        self.out: dict = {}  # dtype -> merged slice buffer
        self.f32 = [np.empty(chunk, np.float32) for _ in range(4)]

    def chunk(self, t: int, name: str, raw, n: int) -> None:
        import torch

        m = raw[1]
        if m.dtype not in self.out:
            self.out[m.dtype] = torch.empty(len(self.f32[0]), dtype=m.dtype)
        x = blend_into(self.out[m.dtype][:n], m, raw[2], float(self.weights[t]), self.acc32, self.scratch)
        arrays = [_raw_array(v, buf) for v, buf in zip([x, *raw], self.f32)]  # one dtype (check_compatible)
        self.k["merged"](*arrays, self.np_acc, self.np_hist)

    def finish(self, t: int) -> None:
        self.sums[:, t] = self.np_acc
        self.np_acc[:] = 0.0
        self.parts[t] = Hist.trim(self.np_hist)
        self.np_hist[:] = 0
