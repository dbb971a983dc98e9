"""The |Δ| histogram: a value's bin (the top 16 bits of its float32 pattern), a bin's edges, per-tensor histograms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

NBINS = 32768
SUB_BINS = 65536  # float32 bit patterns in one bin


def bin_index(values: "torch.Tensor") -> "torch.Tensor":
    """Histogram bin of non-negative float32 values: the float's top 16 bits, rounded up.

    Bin 0 is exactly the zeros; bin b >= 1 holds bit patterns ((b-1)·2^16, b·2^16]. Bins are
    ordered like the values, each about 0.8% wide (relative).
    """
    import torch

    bits = values.contiguous().view(torch.int32)
    return (bits + 0xFFFF) >> 16


def first_bits(b: int) -> int:
    """The smallest float32 bit pattern in bin `b` >= 1 (the bin holds `SUB_BINS` patterns from there)."""
    return (b - 1) * SUB_BINS + 1


def as_float32(bits) -> np.ndarray:
    """float32 values of int bit patterns."""
    return np.asarray(bits, dtype=np.int64).astype(np.int32).view(np.float32)


def bin_lower_value(b: int) -> float:
    """Smallest value in bin `b` (the bin holds values >= this and < bin_lower_value(b + 1))."""
    if b <= 0:
        return 0.0
    return float(as_float32([first_bits(b)])[0])


@dataclass
class Hist:
    """Per-tensor histograms of |Δ| on `NBINS` bins, stored from each tensor's first used bin."""

    lo: np.ndarray  # (T,) first stored bin
    offsets: np.ndarray  # (T+1,) into counts
    counts: np.ndarray  # concatenated int64 counts

    @staticmethod
    def trim(dense: np.ndarray) -> tuple[int, np.ndarray]:
        """(first used bin, counts from there to the last used bin) of one dense histogram."""
        nz = np.flatnonzero(dense)
        if not len(nz):
            return 0, np.zeros(0, np.int64)
        return int(nz[0]), np.array(dense[nz[0]:nz[-1] + 1], dtype=np.int64)

    @classmethod
    def from_parts(cls, parts: Sequence[tuple[int, np.ndarray] | None]) -> "Hist":
        """From one trimmed histogram per tensor (None: an empty one)."""
        parts = [p if p is not None else (0, np.zeros(0, np.int64)) for p in parts]
        offsets = np.concatenate([[0], np.cumsum([len(c) for _, c in parts])]).astype(np.int64)
        counts = np.concatenate([c for _, c in parts]) if parts else np.zeros(0, np.int64)
        return cls(np.asarray([lo for lo, _ in parts], np.int64), offsets, counts.astype(np.int64))

    def tensor(self, t: int) -> tuple[int, np.ndarray]:
        return int(self.lo[t]), self.counts[self.offsets[t]:self.offsets[t + 1]]

    def count_ge(self, b: int) -> np.ndarray:
        """Per tensor: entries in bins >= b."""
        out = np.zeros(len(self.lo), np.int64)
        for t in range(len(self.lo)):
            lo, c = self.tensor(t)
            out[t] = int(c[max(b - lo, 0):].sum()) if b - lo < len(c) else 0
        return out

    def count_in(self, b: int) -> np.ndarray:
        out = np.zeros(len(self.lo), np.int64)
        for t in range(len(self.lo)):
            lo, c = self.tensor(t)
            out[t] = int(c[b - lo]) if 0 <= b - lo < len(c) else 0
        return out

    def total(self) -> np.ndarray:
        """All tensors together: one dense histogram."""
        out = np.zeros(NBINS, np.int64)
        for t in range(len(self.lo)):
            lo, c = self.tensor(t)
            out[lo:lo + len(c)] += c
        return out


def boundary_bin(total: np.ndarray, K: int) -> int:
    """The bin holding the K-th largest entry of a dense histogram."""
    above = np.cumsum(total[::-1])[::-1]  # above[b] = entries in bins >= b
    return int(np.flatnonzero(above >= K)[-1])
