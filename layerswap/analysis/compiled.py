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
        from layerswap.analysis._numba import BLOCK, main_slice, merged_slice

        _KERNELS.update(main=main_slice, merged=merged_slice, block=BLOCK)
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


class _Lane:
    """One thread's share of every slice: its own sums, histograms, window counts and pair keys."""

    def __init__(self, nk: int, dense_sizes: list[int], chunk: int, block: int):
        self.acc = np.zeros(8)
        self.hist = np.zeros((2, NBINS), np.int64)
        self.dense = [np.zeros(max(n, 1), np.int64) for n in dense_sizes]
        self.joint = np.zeros(max(nk, 1), np.int64)
        self.keys = np.empty(PAIRS_ROOM + chunk, np.int64)
        self.n_keys = 0
        self.sel = np.empty(block + 1, np.int64)  # main_slice's block of selected positions


class CompiledMainPass(MainPass):
    """`MainPass` with the per-slice work in one compiled loop, each slice split among `lanes` threads
    (same results; CPU only)."""

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
        self.lanes = [_Lane(nk, [int(o[-1]) for o in self.ival_off], chunk, self.k["block"]) for _ in range(lanes)]
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

    def _compress_pairs(self, lane: _Lane) -> None:
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
