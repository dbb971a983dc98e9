"""Can two experts be merged: do they share a base (a few MB of sampled weights), and the one check every merge
path makes (`check_mergeable`: headers, then the shared base), for exports, the workbench, sweeps and `inspect`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from layerswap.models.checkpoints import Checkpoint, CompatReport, check_compatible
from layerswap.core.errors import UserError


BASE_DISTANCE_THRESHOLD = 0.5


def _sample_names(ck: Checkpoint, n_layers: int = 6) -> list[str]:
    """A few 2-D tensors spread over depth (attention and MLP), plus the embeddings."""
    L = ck.num_layers
    layers = sorted({round(i * (L - 1) / max(n_layers - 1, 1)) for i in range(n_layers)})
    names = []
    for layer in layers:
        for t in ck.layer_tensors(layer):
            if len(t.shape) == 2 and t.ptype in ("q_proj", "down_proj"):
                names.append(t.name)
    names += [t.name for t in ck.tensors.values() if t.ptype == "embed" and len(t.shape) == 2]
    return names


def sampled_distance(a: Checkpoint, b: Checkpoint, rows: int = 32) -> float:
    """‖a − b‖ / ‖b‖ over the first `rows` rows of a sample of tensors (reads a few MB at most)."""
    num = den = 0.0
    for name in _sample_names(b):
        info = b.tensors[name]
        n = min(rows, info.shape[0]) * math.prod(info.shape[1:])
        xa, xb = a.read_float64(name, 0, n), b.read_float64(name, 0, n)
        num += float(np.sum((xa - xb) ** 2))
        den += float(np.sum(xb ** 2))
    return (num ** 0.5) / (den ** 0.5) if den else float("nan")


@dataclass
class Pairing:
    """Sampled distances that tell whether two experts were fine-tuned from the same base."""

    distances: dict[str, float]  # "math-base", "lang-base", or "math-lang" when no base is given
    threshold: float

    @property
    def suspicious(self) -> dict[str, float]:
        limit = lambda k: self.threshold * (2 ** 0.5 if k == "math-lang" else 1)  # noqa: E731
        return {k: v for k, v in self.distances.items() if not v <= limit(k)}

    def message(self) -> str:
        d = ", ".join(f"{k} {v:.3f}" for k, v in self.distances.items())
        if not self.suspicious:
            return f"shared base: sampled relative distances {d} (threshold {self.threshold})"
        return (f"the experts may not share a base: sampled relative distances {d} exceed the threshold "
                f"{self.threshold} (light fine-tunes of one base are usually far below it; unrelated models are "
                "near 1.4). Merging models of different bases rarely works; pass --force to run it anyway")


def check_pairing(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None = None,
                  threshold: float = BASE_DISTANCE_THRESHOLD) -> Pairing:
    """Distance of each expert from the base on sampled tensors (or between experts without one)."""
    if base is not None:
        d = {"math-base": sampled_distance(math, base), "lang-base": sampled_distance(lang, base)}
    else:
        d = {"math-lang": sampled_distance(math, lang)}
    return Pairing(d, threshold)


@dataclass
class MergeCheck:
    """Whether two experts (and their base) can be merged: the headers (`check_compatible`) and, when they
    agree, the shared-base distances (`check_pairing`; waived with `force`)."""

    report: CompatReport
    pairing: Pairing | None  # None when the headers already disagree
    force: bool = False

    def problem(self) -> str | None:
        """Why they cannot be merged, in one line (None when they can)."""
        if not self.report.ok:
            return self.report.problem()
        if self.pairing.suspicious and not self.force:
            return self.pairing.message() + "."
        return None

    def raise_if_bad(self) -> None:
        problem = self.problem()
        if problem:
            raise UserError(problem)


def check_mergeable(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None = None, *,
                    threshold: float = BASE_DISTANCE_THRESHOLD, force: bool = False) -> MergeCheck:
    """The one check before a merge (export, the workbench, sweeps, `layerswap inspect`): headers, then
    sampled distances from the base (a few MB read) when the headers agree."""
    report = check_compatible(math, lang, base)
    return MergeCheck(report, check_pairing(math, lang, base, threshold) if report.ok else None, force)
