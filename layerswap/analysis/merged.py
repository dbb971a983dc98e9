"""The merged model's statistics: against the base and each expert, reading again only the tensors a plan blends.

Each tensor's source is the planner's (`layerswap.recipe.sources`): a copy of an expert reuses that expert's
numbers, a copy of the base (a reverted layer) is zero change from the base and the expert's own change
from each expert, both exactly; only blends are streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.core.runtime import Progress, resolve_device
from layerswap.recipe.sources import TensorSource
from layerswap.analysis.bins import Hist, boundary_bin
from layerswap.analysis.records import pick_k
from layerswap.analysis.stream import default_chunk


@dataclass
class MergedTopK:
    """The merged model's top-k% share per tensor, located on the |Δ| histograms.

    Entries above the threshold's bin are counted exactly; the `in_bin` entries of that one bin
    (about 0.8% wide) are shared in proportion. Any tensor's share is within `max_error` of the
    truth (the bin's entries are all in or all out of the set, at worst).
    """

    k: float
    K: int
    above: np.ndarray  # per tensor, entries in bins above the threshold's bin
    in_bin: np.ndarray  # per tensor, entries in the threshold's bin
    bin: int

    @property
    def count(self) -> np.ndarray:
        need = self.K - int(self.above.sum())
        total = int(self.in_bin.sum())
        return self.above + (self.in_bin * (need / total) if total else 0.0)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.above / self.K, (self.above + self.in_bin) / self.K

    @property
    def max_error(self) -> float:
        """Largest possible error of any tensor's share (as a fraction of K)."""
        lo, hi = self.bounds()
        est = self.count / self.K
        return float(np.max(np.maximum(est - lo, hi - est))) if len(est) else 0.0


@dataclass
class MergedStats:
    """The merged model against the base (vs='base') and each expert (vs='math' / 'lang')."""

    plan: Plan
    sources: list[TensorSource]  # per tensor, where the merge takes it from
    sq: dict[str, np.ndarray]  # vs -> ‖θ_merged − θ_vs‖²
    abs_sum: dict[str, np.ndarray]
    hist: Hist  # |θ_merged − θ_base|
    topk: dict[float, MergedTopK]
    streamed: list[str]  # tensors that were read again (blended ones)

    @property
    def weights(self) -> np.ndarray:
        """Per tensor, the language expert's weight (NaN for tensors taken from the base)."""
        return np.asarray([np.nan if s.w_lang is None else s.w_lang for s in self.sources], dtype=float)

    def topk_at(self, k: float | None) -> MergedTopK:
        return pick_k(self.topk, k)

    def kept(self, analysis, k: float | None = None) -> dict[str, float]:
        """Share of each expert's top-k% entries (in `analysis`) in tensors the merge takes from that
        expert (blended tensors count by their weight; tensors from the base count for neither)."""
        tk = analysis.topk_at(k)
        w = self.weights
        expert = ~np.isnan(w)
        return {"math": float((tk.share("math")[expert] * (1 - w[expert])).sum()),
                "lang": float((tk.share("lang")[expert] * w[expert]).sum())}


def merged_stats(an, plan: Plan, sources: list[TensorSource], math_ck: Checkpoint, lang_ck: Checkpoint,
                 base_ck: Checkpoint, device: str, progress: Progress | None) -> MergedStats:
    """`MergedStats` of the merge whose tensors come from `sources` (an `Analysis` of these checkpoints gives
    the rest). Copies are known exactly from the analysis; only the blended tensors are streamed (through
    the analysis's reader and driver)."""
    now = {"base": base_ck.fingerprint(), "math": math_ck.fingerprint(), "lang": lang_ck.fingerprint()}
    if now != an.fingerprints:
        raise UserError("These checkpoints are not the ones this analysis was computed on (or they changed on "
                        "disk since): analyse them again.")
    T = len(an.tensors)
    sq = {v: np.zeros(T) for v in ("base", "math", "lang")}
    ab = {v: np.zeros(T) for v in ("base", "math", "lang")}
    parts: list[tuple[int, np.ndarray] | None] = [None] * T  # trimmed |θ_merged − θ_base| histograms
    blended = [i for i in range(T) if sources[i].kind == "blend"]
    for i, s in enumerate(sources):
        if s.from_base:  # zero change from the base; from each expert, its own change
            for vs in ("math", "lang"):
                sq[vs][i], ab[vs][i] = an.sq[vs][i], an.abs_sum[vs][i]
            parts[i] = (0, np.asarray([an.tensors[i].numel], np.int64))  # every |Δ| is 0: bin 0
        elif s.kind == "copy":
            src, other = s.role, "lang" if s.role == "math" else "math"
            sq["base"][i], ab["base"][i] = an.sq[src][i], an.abs_sum[src][i]
            sq[other][i], ab[other][i] = an.ml_sq[i], an.ml_abs[i]
            parts[i] = an.hist[src].tensor(i)
        elif s.kind != "blend":
            raise UserError(f"Merged-model statistics are computed for layer maps; {s.label()} is not one.")
    if blended:
        from layerswap.analysis import compiled  # torch: loaded when there is something to compute
        from layerswap.analysis.kernels import MergedPass
        from layerswap.analysis.passes import run_pass

        dev = resolve_device(device, allowed=("cpu", "cuda"))
        chunk = default_chunk(dev)
        weights = np.asarray([sources[i].w for i in blended])
        entries = sum(an.tensors[i].numel for i in blended)
        kind = compiled.CompiledMergedPass if compiled.use_compiled(dev, entries) else MergedPass
        mp, _ = run_pass([base_ck, math_ck, lang_ck], [an.tensors[i] for i in blended],
                         lambda: kind(weights, dev, chunk), dev, chunk, progress, "merged", 0.0, 1.0)
        for j, i in enumerate(blended):
            for r, vs in enumerate(("base", "math", "lang")):
                sq[vs][i], ab[vs][i] = mp.sums[2 * r, j], mp.sums[2 * r + 1, j]
            parts[i] = mp.parts[j]
    hist = Hist.from_parts(parts)
    tot = hist.total()
    topk = {}
    for kk, tk in an.topk.items():
        b = boundary_bin(tot, tk.K)
        topk[kk] = MergedTopK(kk, tk.K, hist.count_ge(b + 1), hist.count_in(b), b)
    return MergedStats(plan, sources, sq, ab, hist, topk, [an.tensors[i].name for i in blended])
