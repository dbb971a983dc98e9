"""The merged model's statistics: against the base and each expert, reading again only the tensors a plan blends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checkpoints import Checkpoint
from ..errors import UserError
from ..plans import Plan
from ..runtime import Progress, resolve_device
from .bins import Hist, boundary_bin
from .records import pick_k
from .stream import default_chunk


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
    weights: np.ndarray  # per tensor, the language expert's weight
    sq: dict[str, np.ndarray]  # vs -> ‖θ_merged − θ_vs‖²
    abs_sum: dict[str, np.ndarray]
    hist: Hist  # |θ_merged − θ_base|
    topk: dict[float, MergedTopK]
    streamed: list[str]  # tensors that were read again (blended ones)

    def topk_at(self, k: float | None) -> MergedTopK:
        return pick_k(self.topk, k)

    def kept(self, analysis, k: float | None = None) -> dict[str, float]:
        """Share of each expert's top-k% entries (in `analysis`) in tensors the merge takes from that
        expert (blended tensors count by their weight)."""
        tk = analysis.topk_at(k)
        return {"math": float((tk.share("math") * (1 - self.weights)).sum()),
                "lang": float((tk.share("lang") * self.weights).sum())}


def merged_stats(an, plan: Plan, weights: np.ndarray, math_ck: Checkpoint, lang_ck: Checkpoint, base_ck: Checkpoint,
                 device: str, progress: Progress | None) -> MergedStats:
    """`MergedStats` of the merge with per-tensor `weights` (an `Analysis` of these checkpoints gives the rest).

    Tensors copied from an expert (weight 0 or 1) reuse that expert's numbers exactly; only the
    blended ones are streamed (through the analysis's reader and driver).
    """
    now = {"base": base_ck.fingerprint(), "math": math_ck.fingerprint(), "lang": lang_ck.fingerprint()}
    if now != an.fingerprints:
        raise UserError("These checkpoints are not the ones this analysis was computed on (or they changed on "
                        "disk since): analyse them again.")
    T = len(an.tensors)
    sq = {v: np.zeros(T) for v in ("base", "math", "lang")}
    ab = {v: np.zeros(T) for v in ("base", "math", "lang")}
    parts: list[tuple[int, np.ndarray] | None] = [None] * T  # trimmed |θ_merged − θ_base| histograms
    blended = [i for i in range(T) if weights[i] not in (0.0, 1.0)]
    for i in range(T):
        if weights[i] in (0.0, 1.0):
            src, other = ("math", "lang") if weights[i] == 0.0 else ("lang", "math")
            sq["base"][i], ab["base"][i] = an.sq[src][i], an.abs_sum[src][i]
            sq[other][i], ab[other][i] = an.ml_sq[i], an.ml_abs[i]
            parts[i] = an.hist[src].tensor(i)
    if blended:
        from . import compiled  # torch: loaded when there is something to compute
        from .kernels import MergedPass
        from .passes import run_pass

        dev = resolve_device(device, allowed=("cpu", "cuda"))
        chunk = default_chunk(dev)
        entries = sum(an.tensors[i].numel for i in blended)
        kind = compiled.CompiledMergedPass if compiled.use_compiled(dev, entries) else MergedPass
        mp, _ = run_pass([base_ck, math_ck, lang_ck], [an.tensors[i] for i in blended],
                         lambda: kind(weights[blended], dev, chunk), dev, chunk, progress, "merged", 0.0, 1.0)
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
    return MergedStats(plan, weights, sq, ab, hist, topk, [an.tensors[i].name for i in blended])
