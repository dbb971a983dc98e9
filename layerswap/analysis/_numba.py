"""The compiled loops behind `compiled` (imported only when numba is installed and the CPU computes)."""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

NBINS = 32768  # bins.NBINS (not imported: this module stays a leaf numba can cache)
BLOCK = 8192  # entries per block: a block of the three slices stays in cache between the two loops


def f32(x):
    """A stored value as float32 (bf16 arrives as its uint16 bit pattern)."""
    raise NotImplementedError  # only called from compiled code


@overload(f32, inline="always")
def _f32(x):
    if isinstance(x, types.Integer):
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    return lambda x: np.float32(x)


@njit(inline="always")
def _bin(v):
    """bins.bin_index of one non-negative float32, clamped to the last bin (NaN and inf are refused later)."""
    return min((np.uint32(v.view(np.uint32)) + np.uint32(0xFFFF)) >> np.uint32(16), np.uint32(NBINS - 1))


@njit(inline="always")
def _count(bits, b, lo, hi, off, dense):
    for q in range(lo.size):
        if lo[q] <= b < hi[q]:
            dense[off[q] + bits - ((lo[q] - 1) * 65536 + 1)] += 1
            return


@njit(inline="always")
def _add(acc, sums):
    for j in range(len(sums)):
        acc[j] += sums[j]


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def _sums(a, m, l):
    """‖a‖², ‖Δm‖², ‖Δl‖², ⟨Δm, Δl⟩, Σ|Δm|, Σ|Δl|, ‖Δm − Δl‖², Σ|Δm − Δl|, in float64
    (reassociated: summed in vector lanes; a loop over a whole array vectorizes, one over a range does not)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    for i in range(a.size):
        fa = f32(a[i])
        xa, xm, xl = np.float64(fa), np.float64(f32(m[i]) - fa), np.float64(f32(l[i]) - fa)
        e = xm - xl
        s0 += xa * xa
        s1 += xm * xm
        s2 += xl * xl
        s3 += xm * xl
        s4 += abs(xm)
        s5 += abs(xl)
        s6 += e * e
        s7 += abs(e)
    return s0, s1, s2, s3, s4, s5, s6, s7


@njit(nogil=True, cache=True, boundscheck=False)
def _bins(a, x, out):
    """`out[i]` = the bin of |x[i] − a[i]| (a loop without stores to the histogram, so it vectorizes)."""
    for i in range(a.size):
        out[i] = _bin(np.float32(abs(f32(x[i]) - f32(a[i]))))  # exact for bf16 / fp16 inputs


@njit(nogil=True, cache=True, boundscheck=False)
def _hist(a, m, l, h0, h1, sel0, sel1, sel, bins):
    """Adds every entry's bin to the histograms; writes the positions whose bin reaches `sel0` (math) or
    `sel1` (lang) to `sel` (branch-free) and returns how many. `bins` is (2, block) scratch: the bins are
    computed first in vector lanes, then counted."""
    bm, bl = bins[0], bins[1]
    _bins(a, m, bm)
    _bins(a, l, bl)
    ns = 0
    for i in range(a.size):
        h0[bm[i]] += 1
        h1[bl[i]] += 1
        sel[ns] = i
        ns += (bm[i] >= sel0) | (bl[i] >= sel1)
    return ns


@njit(nogil=True, cache=True)
def main_slice(a, m, l, acc, hist, lo_sel, wlo, whi, nk, lo0, hi0, off0, dense0, lo1, hi1, off1, dense1,
               joint, keys, nkeys, sel):
    """One slice of base `a`, math `m`, lang `l`: adds to the sums `acc` (see `_sums`) and the
    histograms `hist` (2, NBINS) of |Δm| and |Δl|; entries at or above `lo_sel` (per role) are
    counted in the dense window arrays, pairs sure to be in both of window j's top sets in
    ``joint[j]``, and other pairs where both reach window j appended to `keys` (math bits << 32 |
    lang bits) from `nkeys`. Returns the new key count. Works in blocks that stay in cache; `sel`
    is scratch of the block size + 1."""
    sel0, sel1 = np.uint32(lo_sel[0]), np.uint32(lo_sel[1])
    h0, h1 = hist[0], hist[1]
    n = a.size
    bins = np.empty((2, BLOCK), np.uint32)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        _add(acc, _sums(a[start:stop], m[start:stop], l[start:stop]))
        ns = _hist(a[start:stop], m[start:stop], l[start:stop], h0, h1, sel0, sel1, sel, bins)
        for s in range(ns):
            i = start + sel[s]
            fa = f32(a[i])
            vm = np.float32(abs(f32(m[i]) - fa))
            vl = np.float32(abs(f32(l[i]) - fa))
            bm, bl = np.int64(_bin(vm)), np.int64(_bin(vl))
            im, il = np.int64(vm.view(np.int32)), np.int64(vl.view(np.int32))
            _count(im, bm, lo0, hi0, off0, dense0)
            _count(il, bl, lo1, hi1, off1, dense1)
            cand = False
            for j in range(nk):
                if bm >= wlo[0, j] and bl >= wlo[1, j]:
                    if bm >= whi[0, j] and bl >= whi[1, j]:
                        joint[j] += 1
                    else:
                        cand = True
            if cand:
                keys[nkeys] = (im << 32) | il
                nkeys += 1
    return nkeys


@njit(nogil=True, cache=True, boundscheck=False)
def _hist1(a, x, h, lo, sel, bins):
    """Adds every entry's bin of |x − a| to `h`; writes the positions whose bin reaches `lo` to `sel`
    (branch-free) and returns how many (`bins`: block scratch, as in `_hist`)."""
    _bins(a, x, bins)
    ns = 0
    for i in range(a.size):
        h[bins[i]] += 1
        sel[ns] = i
        ns += bins[i] >= lo
    return ns


@njit(nogil=True, cache=True)
def math_slice(a, m, hist, lo_sel, lo0, hi0, off0, dense0, sel):
    """The math expert's part of a slice of a family (N >= 2 languages), shared by every language: adds
    |Δm| to the histogram `hist` and counts the entries at or above `lo_sel` in the dense window arrays.
    In blocks that stay in cache; `sel` is scratch of the block size + 1."""
    n = a.size
    bins = np.empty(BLOCK, np.uint32)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        ns = _hist1(a[start:stop], m[start:stop], hist, np.uint32(lo_sel), sel, bins)
        for s in range(ns):
            i = start + sel[s]
            vm = np.float32(abs(f32(m[i]) - f32(a[i])))
            _count(np.int64(vm.view(np.int32)), np.int64(_bin(vm)), lo0, hi0, off0, dense0)


@njit(nogil=True, cache=True)
def lang_slice(a, m, l, acc, hist, lo_sel, wlo, whi, nk, lo1, hi1, off1, dense1, joint, keys, nkeys, sel):
    """One language expert's part of a slice of a family: adds every sum of `_sums` to `acc` (the same
    function on the same blocks as `main_slice`, so the same floats as the pair's) and |Δl| to `hist`; entries at or above `lo_sel` are counted in the dense window arrays,
    pairs sure to be in both of window j's top sets in ``joint[j]``, and other pairs where both reach
    window j appended to `keys` (math bits << 32 | lang bits) from `nkeys` (a pair reaches a window
    only where the language does, so the language's selection finds them all). Returns the new key count."""
    n = a.size
    bins = np.empty(BLOCK, np.uint32)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        _add(acc, _sums(a[start:stop], m[start:stop], l[start:stop]))
        ns = _hist1(a[start:stop], l[start:stop], hist, np.uint32(lo_sel), sel, bins)
        for s in range(ns):
            i = start + sel[s]
            fa = f32(a[i])
            vm = np.float32(abs(f32(m[i]) - fa))
            vl = np.float32(abs(f32(l[i]) - fa))
            bm, bl = np.int64(_bin(vm)), np.int64(_bin(vl))
            im, il = np.int64(vm.view(np.int32)), np.int64(vl.view(np.int32))
            _count(il, bl, lo1, hi1, off1, dense1)
            cand = False
            for j in range(nk):
                if bm >= wlo[0, j] and bl >= wlo[1, j]:
                    if bm >= whi[0, j] and bl >= whi[1, j]:
                        joint[j] += 1
                    else:
                        cand = True
            if cand:
                keys[nkeys] = (im << 32) | il
                nkeys += 1
    return nkeys


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def _merged_sums(x, a, m, l):
    """‖x − a‖², Σ|x − a|, ‖x − m‖², Σ|x − m|, ‖x − l‖², Σ|x − l| (float32 differences, float64 sums)."""
    s0 = s1 = s2 = s3 = s4 = s5 = 0.0
    for i in range(x.size):
        fx = f32(x[i])
        da, dm, dl = np.float64(fx - f32(a[i])), np.float64(fx - f32(m[i])), np.float64(fx - f32(l[i]))
        s0 += da * da
        s1 += abs(da)
        s2 += dm * dm
        s3 += abs(dm)
        s4 += dl * dl
        s5 += abs(dl)
    return s0, s1, s2, s3, s4, s5


@njit(nogil=True, cache=True, boundscheck=False)
def _merged_hist(x, a, h, bins):
    _bins(a, x, bins)
    for i in range(x.size):
        h[bins[i]] += 1


@njit(nogil=True, cache=True)
def merged_slice(x, a, m, l, acc, hist):
    """One slice of the merged model `x` against base `a`, math `m`, lang `l`: the sums (see
    `_merged_sums`) into `acc` and the |x − a| histogram into `hist`, in blocks that stay in cache."""
    n = x.size
    bins = np.empty(BLOCK, np.uint32)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        _add(acc, _merged_sums(x[start:stop], a[start:stop], m[start:stop], l[start:stop]))
        _merged_hist(x[start:stop], a[start:stop], hist, bins)
