"""What an analysis is made of: the panels and metrics it offers, per-tensor metadata, top-k% counts, run details."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from layerswap.core.errors import UserError

DEFAULT_KS = (1.0,)

# What each panel compares, and the metrics it offers.
PANELS = {
    "math": "math expert vs base",
    "lang": "language expert vs base",
    "overlap": "overlap of the two experts' changes",
    "merged": "merged model vs base",
    "merged-math": "merged model vs math expert",
    "merged-lang": "merged model vs language expert",
    "math-lang": "math expert vs language expert",
}
METRICS = {
    "relative": "relative change ‖Δ‖ / ‖θ_base‖",
    "mean_abs": "mean |Δ|",
    "topk": "share of the model's top-k% most-changed entries",
    "cosine": "cosine of the two task vectors",
    "jaccard": "Jaccard index of the two top-k% sets",
}
PANEL_METRICS = {
    "math": ("relative", "mean_abs", "topk"),
    "lang": ("relative", "mean_abs", "topk"),
    "merged": ("relative", "mean_abs", "topk"),
    "overlap": ("cosine", "jaccard"),
    "merged-math": ("relative", "mean_abs"),
    "merged-lang": ("relative", "mean_abs"),
    "math-lang": ("relative", "mean_abs"),
}


@dataclass(frozen=True)
class TensorMeta:
    """One analysed tensor: a grid cell (layer, parameter type) or a non-layer tensor."""

    name: str
    layer: int | None
    ptype: str
    shape: tuple[int, ...]
    numel: int


@dataclass
class TopK:
    """The exact global top-k% of each expert's |Δ|, and how the two sets overlap, per tensor."""

    k: float  # percent
    K: int  # entries in each top set
    N: int  # entries in the model
    threshold: dict[str, float]  # role -> the K-th largest |Δ|
    n_gt: dict[str, np.ndarray]  # role -> per tensor, entries with |Δ| > threshold
    n_eq: dict[str, np.ndarray]  # role -> per tensor, entries with |Δ| == threshold
    joint: np.ndarray  # per tensor, expected size of the intersection of the two sets
    passes: int  # 1 when the sampled window held the threshold, 3 when the exact passes were needed

    def tie_fraction(self, role: str) -> float:
        gt, eq = int(self.n_gt[role].sum()), int(self.n_eq[role].sum())
        return (self.K - gt) / eq if eq else 0.0

    def count(self, role: str) -> np.ndarray:
        """Per tensor, how many of the K entries it holds (ties shared fractionally)."""
        return self.n_gt[role] + self.n_eq[role] * self.tie_fraction(role)

    def share(self, role: str) -> np.ndarray:
        return self.count(role) / self.K

    def jaccard(self) -> np.ndarray:
        union = self.count("math") + self.count("lang") - self.joint
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(union > 0, self.joint / np.where(union > 0, union, 1), np.nan)

    def overlap(self) -> float:
        """|S_math ∩ S_lang| / K over the whole model."""
        return float(self.joint.sum()) / self.K

    def chance_overlap(self, numel: np.ndarray) -> float:
        """The overlap expected if, inside every tensor, the two sets were independent."""
        return float((self.count("math") * self.count("lang") / np.maximum(numel, 1)).sum()) / self.K


@dataclass
class RunInfo:
    seconds: float
    passes: int
    bytes_read: int
    device: str
    sample_entries: int
    workers: int = 1
    cached: bool = False
    cache_file: str | None = None


def same_k(a: float, b: float) -> bool:
    """Whether two top-k percentages are the same k."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


R = TypeVar("R")


def pick_k(results: dict[float, R], k: float | None) -> R:
    """The top-k% results for `k` (None: the k closest to 1%), or a UserError saying what was computed."""
    if not results:
        raise UserError("This analysis has no top-k% results; run it with a k (e.g. ks=(1.0,)).")
    if k is None:
        return results[min(results, key=lambda x: abs(x - 1.0))]
    for kk, r in results.items():
        if same_k(kk, float(k)):
            return r
    raise UserError(f"top-k% for k={k} was not computed (have {', '.join(f'{x:g}' for x in sorted(results))}); "
                    f"analyse again with k={k} (cached per model set).")
