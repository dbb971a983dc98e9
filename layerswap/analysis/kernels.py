"""The per-slice arithmetic: float32 working slices, and the handler each pass feeds every slice to.

A handler gets ``chunk(t, name, raw, n)`` for every slice of tensor `t` (raw: base, math, lang
in their stored dtype), ``finish(t)`` after the tensor's last slice (an empty tensor gets only
that), and ``absorb(other)`` to add the results of another worker that saw other tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerswap.core.errors import UserError
from layerswap.merge.merging import blend
from layerswap.core.roles import EXPERTS
from layerswap.analysis.bins import NBINS, SUB_BINS, Hist, bin_index, first_bits


MAX_WINDOW_BINS = 16  # widest window (the compiled pass counts its entries densely: 1M patterns = 8 MiB)


@dataclass
class Window:
    """Bins [lo, hi) whose entries are kept exactly; bins >= hi are surely in the top set.

    lo == hi == 1 is the 'zero threshold' case: every nonzero entry is in the set."""

    lo: int
    hi: int


class Kernel:
    """Float32 working slices on `device`: base, |Δ_math|, |Δ_lang| and their histogram bins."""

    def __init__(self, device: torch.device, chunk: int):
        self.dev = device
        f32 = dict(dtype=torch.float32, device=device)
        self.buf = {n: torch.empty(chunk, **f32) for n in ("a", "m", "l", "dm", "dl", "tmp")}
        self.ibuf = {r: torch.empty(chunk, dtype=torch.int32, device=device) for r in EXPERTS}
        self.mask = [torch.empty(chunk, dtype=torch.bool, device=device) for _ in range(2)]

    def deltas(self, raw: list[torch.Tensor], n: int, stats: bool, name: str):
        """Fill the slices; returns (|Δm|, |Δl|, bins_m, bins_l, sums or None).

        Sums (float64): ‖θ_base‖², ‖Δm‖², ‖Δl‖², ⟨Δm, Δl⟩, Σ|Δm|, Σ|Δl|, ‖Δm − Δl‖², Σ|Δm − Δl|.
        """
        B = self.buf
        a, m, l, dm, dl, tmp = (B[x][:n] for x in ("a", "m", "l", "dm", "dl", "tmp"))
        # explicit float32 copies: a mixed-dtype sub would cast element by element, several times slower
        a.copy_(raw[0])
        m.copy_(raw[1])
        l.copy_(raw[2])
        torch.sub(m, a, out=dm)  # exact for bf16/fp16 inputs (the difference fits float32)
        torch.sub(l, a, out=dl)
        s = None
        if stats:
            # BLAS dot products over <= 2^18 floats: about 1e-6 relative error, summed in float64
            parts = [torch.dot(a, a), torch.dot(dm, dm), torch.dot(dl, dl), torch.dot(dm, dl)]
            torch.sub(dm, dl, out=tmp)
            parts.append(torch.dot(tmp, tmp))
            ml_abs = tmp.abs_().sum()
        dm.abs_()
        dl.abs_()
        if stats:
            parts = parts[:4] + [dm.sum(), dl.sum(), parts[4], ml_abs]
            s = torch.stack(parts).to(torch.float64)
            if not bool(torch.isfinite(s).all()):
                raise UserError(f"{name} holds NaN or infinite values in the base or an expert; the analysis needs "
                                "finite weights (check the checkpoint).")
        im, il = self.ibuf["math"][:n], self.ibuf["lang"][:n]
        for x, idx in ((dm, im), (dl, il)):  # bin_index, into the working buffers
            torch.add(x.view(torch.int32), 0xFFFF, out=idx)
            idx.bitwise_right_shift_(16)
        return dm, dl, im, il, s

    def select(self, im: torch.Tensor, il: torch.Tensor, lo_m: int, lo_l: int) -> torch.Tensor:
        """Positions where either expert's bin reaches its lower bound (a few % of the slice)."""
        n = len(im)
        m0, m1 = self.mask[0][:n], self.mask[1][:n]
        torch.ge(im, lo_m, out=m0)
        torch.ge(il, lo_l, out=m1)
        m0.logical_or_(m1)
        return torch.nonzero(m0).squeeze(1)


def merge_counts(pending: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and summed multiplicities (bf16 changes tie a lot: this keeps them small)."""
    if len(pending) == 1:
        return pending[0]
    keys = np.concatenate([k for k, _ in pending])
    u, inv = np.unique(keys, return_inverse=True)
    return u, np.bincount(inv, weights=np.concatenate([c for _, c in pending]), minlength=len(u)).astype(np.int64)


class MainPass:
    """Sums, exact histograms, and the entries inside the sampled windows (compressed by value)."""

    def __init__(self, T: int, windows: dict[float, dict[str, Window]], device: torch.device, chunk: int,
                 max_kept: int):
        self.T = T
        self.kern = Kernel(device, chunk)
        self.windows = windows
        self.ks = sorted(windows)
        self.sums = np.zeros((8, T))
        self.parts: dict[str, dict[int, tuple[int, np.ndarray]]] = {r: {} for r in EXPERTS}  # t -> trimmed histogram
        self.joint_def = np.zeros((len(self.ks), T), np.int64)
        self.own: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {r: [] for r in EXPERTS}  # (t, bits, count)
        self.pairs: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[] for _ in self.ks]  # (t, mbits<<32|lbits, n)
        self.pending: dict = {}  # this tensor's kept entries, per role name or k index
        self.pending_n = 0
        self.kept = 0
        self.max_kept = max_kept
        self.overflow = False
        self.acc = torch.zeros(8, dtype=torch.float64, device=device)
        self.hist = {r: torch.zeros(NBINS, dtype=torch.int64, device=device) for r in EXPERTS}
        self.lo_sel = {r: min((w[r].lo for w in windows.values()), default=1) for r in EXPERTS}

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int) -> None:
        vm, vl, im, il, s = self.kern.deltas(raw, n, True, name)
        self.acc += s
        hm, hl = torch.bincount(im, minlength=NBINS), torch.bincount(il, minlength=NBINS)
        self.hist["math"] += hm
        self.hist["lang"] += hl
        if self.windows and not self.overflow:
            # most slices hold nothing in reach of either window: their histograms say so
            if bool((hm[self.lo_sel["math"]:].sum() + hl[self.lo_sel["lang"]:].sum()) > 0):
                self._window_entries(t, vm, vl, im, il)

    def finish(self, t: int) -> None:
        self.sums[:, t] = self.acc.cpu().numpy()
        self.acc.zero_()
        for r in EXPERTS:
            self.parts[r][t] = Hist.trim(self.hist[r].cpu().numpy())
            self.hist[r].zero_()
        for key, pending in self.pending.items():  # one (values, counts) record per tensor
            if pending:
                store = self.own[key] if isinstance(key, str) else self.pairs[key]
                u, c = merge_counts(pending)
                store.append((t, u, c))
                self.kept += len(u)
        self.pending, self.pending_n = {}, 0
        if self.kept > self.max_kept:  # a badly placed window: give up on it, the exact passes follow
            self._give_up()

    def absorb(self, other: "MainPass") -> None:
        self.sums += other.sums
        for r in EXPERTS:
            self.parts[r].update(other.parts[r])
            self.own[r] += other.own[r]
        self.joint_def += other.joint_def
        for j in range(len(self.ks)):
            self.pairs[j] += other.pairs[j]
        self.kept += other.kept  # each worker kept at most its share of max_kept
        if other.overflow or self.overflow:
            self._give_up()

    def hists(self) -> dict[str, Hist]:
        return {r: Hist.from_parts([self.parts[r].get(t) for t in range(self.T)]) for r in EXPERTS}

    def _give_up(self) -> None:
        self.overflow = True
        self.own = {r: [] for r in EXPERTS}
        self.pairs = [[] for _ in self.ks]
        self.pending, self.pending_n = {}, 0

    def _keep(self, key, keys: torch.Tensor) -> None:
        u, c = torch.unique(keys, return_counts=True)
        self.pending.setdefault(key, []).append((u.cpu().numpy(), c.cpu().numpy().astype(np.int32)))
        self.pending_n += len(u)
        if self.kept + self.pending_n > self.max_kept:
            self._give_up()

    def _window_entries(self, t: int, vm: torch.Tensor, vl: torch.Tensor, im: torch.Tensor, il: torch.Tensor) -> None:
        sel = self.kern.select(im, il, self.lo_sel["math"], self.lo_sel["lang"])
        if len(sel) == 0:
            return
        bm, bl, xm, xl = im[sel], il[sel], vm[sel], vl[sel]
        for r, b, x in (("math", bm, xm), ("lang", bl, xl)):
            keep = None
            for w in self.windows.values():
                if w[r].lo < w[r].hi:
                    k = (b >= w[r].lo) & (b < w[r].hi)
                    keep = k if keep is None else keep | k
            if keep is not None and bool(keep.any()):
                self._keep(r, x[keep].view(torch.int32))
                if self.overflow:
                    return
        for j, kk in enumerate(self.ks):
            wm, wl = self.windows[kk]["math"], self.windows[kk]["lang"]
            both = (bm >= wm.lo) & (bl >= wl.lo)
            sure = both & (bm >= wm.hi) & (bl >= wl.hi)
            self.joint_def[j, t] += int(sure.sum())
            cand = both & ~sure
            if bool(cand.any()):
                key = (xm[cand].view(torch.int32).to(torch.int64) << 32) | xl[cand].view(torch.int32).to(torch.int64)
                self._keep(j, key)
                if self.overflow:
                    return


class ThresholdPass:
    """Fallback, first pass: a fine histogram inside each threshold's bin gives the threshold exactly."""

    def __init__(self, bins: dict[tuple[float, str], int], device: torch.device, chunk: int):
        self.kern = Kernel(device, chunk)
        self.bins = {key: b for key, b in bins.items() if b > 0}
        self.fine = {key: torch.zeros(SUB_BINS, dtype=torch.int64, device=device) for key in self.bins}

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int) -> None:
        vm, vl, im, il, _ = self.kern.deltas(raw, n, False, name)
        for (k, r), b in self.bins.items():
            v, idx = (vm, im) if r == "math" else (vl, il)
            sub = v.view(torch.int32)[idx == b] - first_bits(b)
            self.fine[(k, r)] += torch.bincount(sub, minlength=SUB_BINS)

    def finish(self, t: int) -> None:
        pass

    def absorb(self, other: "ThresholdPass") -> None:
        for key in self.fine:
            self.fine[key] += other.fine[key].to(self.fine[key].device)


class CountPass:
    """Fallback, second pass: with the thresholds known, count every class per tensor."""

    def __init__(self, T: int, thresholds: dict[float, dict[str, float]], device: torch.device, chunk: int):
        self.kern = Kernel(device, chunk)
        self.thr = thresholds
        self.counts = {k: np.zeros((8, T), np.int64) for k in thresholds}  # gt_m, eq_m, gt_l, eq_l, G, GE, EG, EE
        self.acc = {k: torch.zeros(8, dtype=torch.int64, device=device) for k in thresholds}

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int) -> None:
        vm, vl, _, _, _ = self.kern.deltas(raw, n, False, name)
        for k, th in self.thr.items():
            gm, em = vm > th["math"], vm == th["math"]
            gl, el = vl > th["lang"], vl == th["lang"]
            self.acc[k] += torch.stack([gm.sum(), em.sum(), gl.sum(), el.sum(), (gm & gl).sum(), (gm & el).sum(),
                                        (em & gl).sum(), (em & el).sum()])

    def finish(self, t: int) -> None:
        for k in self.thr:
            self.counts[k][:, t] = self.acc[k].cpu().numpy()
            self.acc[k].zero_()

    def absorb(self, other: "CountPass") -> None:
        for k in self.counts:
            self.counts[k] += other.counts[k]


class MergedPass:
    """The merged model's blended tensors: distance to base, math and lang, and the |θ_merged − θ_base| histogram."""

    def __init__(self, weights: np.ndarray, device: torch.device, chunk: int):
        T = len(weights)
        self.weights = weights  # per tensor, the language expert's weight
        self.sums = np.zeros((6, T))  # per reference (base, math, lang): ‖θ_merged − θ_ref‖², Σ|θ_merged − θ_ref|
        self.parts: dict[int, tuple[int, np.ndarray]] = {}
        self.acc = torch.zeros(6, dtype=torch.float64, device=device)
        self.hist = torch.zeros(NBINS, dtype=torch.int64, device=device)

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int) -> None:
        a, m, l = (x.to(torch.float32) for x in raw)
        merged = blend(raw[1], raw[2], float(self.weights[t])).to(torch.float32)
        sums = []
        for ref in (a, m, l):
            d = merged - ref
            sums += [(d * d).sum(), d.abs().sum()]
            if ref is a:
                self.hist += torch.bincount(bin_index(d.abs_()), minlength=NBINS)
        self.acc += torch.stack(sums).to(torch.float64)

    def finish(self, t: int) -> None:
        self.sums[:, t] = self.acc.cpu().numpy()
        self.parts[t] = Hist.trim(self.hist.cpu().numpy())
        self.acc.zero_()
        self.hist.zero_()

    def absorb(self, other: "MergedPass") -> None:
        self.sums += other.sums
        self.parts.update(other.parts)
