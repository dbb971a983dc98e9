"""Where did each expert change, do the changes overlap, and what did the merge keep?

`analyze(base, math, lang)` streams the three checkpoints once, tensor by tensor in slices
(`layerswap.stream`), and returns an `Analysis`: for every tensor (a cell of the layer x
parameter-type grid, or an embedding / final norm / lm_head tensor, reported separately)

* relative change      ‖θ_e − θ_base‖_F / ‖θ_base‖_F          for each expert e
* mean absolute change  mean |θ_e − θ_base|
* top-k share          the fraction of the model's top-k% most-changed entries (largest
                       |θ_e − θ_base| over *all* tensors) that lies in this tensor
* overlap              cosine of the two task vectors Δ_math, Δ_lang, and the Jaccard index of
                       the two experts' top-k% sets inside the tensor
* math vs language     ‖θ_math − θ_lang‖_F / ‖θ_base‖_F and mean |θ_math − θ_lang|

`Analysis.merged(plan, ...)` adds the layer-swapped model against the base and against each
expert; tensors the plan copies from an expert reuse that expert's numbers exactly, and only
blended tensors are read again.

This reconstructs the paper's "magnitude of change during SFT" analysis (Bandarkar et al., 2025,
whose exact metric and normalisation are not verifiable from its public text) as several views.

How the top-k% is exact
-----------------------
|Δ| is computed in float32 from the stored values. K = round(k/100 · N) over all N entries; the
threshold t is the K-th largest |Δ|. Entries tied at t are shared fractionally (each gets
(K − #{|Δ| > t}) / #{|Δ| = t}), so every share is exact and the shares sum to 1. This is the
expectation under random tie-breaking, which matters for bf16 checkpoints, where many
changes are a few units in the last place.

1. A sample pass reads 0.4% of the entries, at most about 2M (blocks spread over every
   tensor), and estimates a window of |Δ| values that holds t with a wide margin.
2. The main pass computes all sums, an exact per-tensor histogram of |Δ| on 32768 bins (the top
   16 bits of the float32 pattern, rounded up, so bin 0 holds exactly the zeros), and keeps the
   exact value of every entry that falls inside the window (a few percent of K entries, stored
   as distinct values with counts) plus, for the overlap, the pairs where both experts are at
   or above their windows.
3. The histograms give exact counts above the window; the kept values give t and the counts
   around it exactly. If t fell outside the window (a poor sample, or too many distinct values
   in it), two more passes finish the job exactly: the histograms locate t's bin, a 65536-bin
   histogram inside that bin gives t, and a last pass counts every class per tensor.
   `TopK.passes` says which happened (1 or 3).

The merged model's top-k share is not re-derived per entry: it is located on the histograms
(exact counts above and below the threshold's bin) and the entries of that one bin are shared
in proportion; `MergedTopK.max_error` states the largest possible error of any share.

Memory: the reader's buffers (3 checkpoints x 3 slices) plus about a dozen float32 slices of
working space, and the kept window entries; never a whole tensor. Results are cached on disk
under ``$LAYERSWAP_CACHE/analysis`` (default ``~/.cache/layerswap/analysis``), keyed by the
checkpoints' fingerprints (file names, sizes, mtimes and header bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from .architectures import architecture
from .cache import cache_dir
from .checkpoints import Checkpoint, check_compatible
from .errors import UserError
from .plans import Plan
from .stream import ChunkStream, read_range
from .tensorfile import Files

Progress = Callable[[float, str], None]

FORMAT_VERSION = 1
ROLES = ("math", "lang")
ROLE_NAMES = {"math": "math expert", "lang": "language expert", "merged": "merged model", "base": "base"}
NBINS = 32768
DEFAULT_KS = (1.0,)
CPU_CHUNK = 1 << 18  # 1 MiB float32 slices: the working set stays in cache
CUDA_CHUNK = 1 << 23

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


def cache_root() -> Path:
    return cache_dir("analysis")


# ---- binning of |Δ| -------------------------------------------------------------------------

def bin_index(values: torch.Tensor) -> torch.Tensor:
    """Histogram bin of non-negative float32 values: the float's top 16 bits, rounded up.

    Bin 0 is exactly the zeros; bin b >= 1 holds bit patterns ((b-1)·2^16, b·2^16]. Bins are
    ordered like the values, each about 0.8% wide (relative).
    """
    bits = values.contiguous().view(torch.int32)
    return (bits + 0xFFFF) >> 16


def bin_lower_value(b: int) -> float:
    """Smallest value in bin `b` (the bin holds values >= this and < bin_lower_value(b + 1))."""
    if b <= 0:
        return 0.0
    return float(np.array([(b - 1) * 65536 + 1], dtype=np.int32).view(np.float32)[0])


# ---- results ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorMeta:
    """One analysed tensor: a grid cell (layer, parameter type) or a non-layer tensor."""

    name: str
    layer: int | None
    ptype: str
    shape: tuple[int, ...]
    numel: int

    @property
    def label(self) -> str:
        return architecture("llama").label(self.ptype)


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
    def from_parts(cls, parts: Sequence[tuple[int, np.ndarray]]) -> "Hist":
        offsets = np.concatenate([[0], np.cumsum([len(c) for _, c in parts])]).astype(np.int64)
        counts = np.concatenate([c for _, c in parts]) if parts else np.zeros(0, np.int64)
        return cls(np.asarray([lo for lo, _ in parts], np.int64), offsets, counts.astype(np.int64))

    @classmethod
    def from_dense(cls, dense: Sequence[np.ndarray]) -> "Hist":
        return cls.from_parts([cls.trim(d) for d in dense])

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

    def total(self, select: Iterable[int] | None = None) -> np.ndarray:
        out = np.zeros(NBINS, np.int64)
        for t in (range(len(self.lo)) if select is None else select):
            lo, c = self.tensor(t)
            out[lo:lo + len(c)] += c
        return out


def boundary_bin(total: np.ndarray, K: int) -> int:
    """The bin holding the K-th largest entry of a dense histogram."""
    above = np.cumsum(total[::-1])[::-1]  # above[b] = entries in bins >= b
    return int(np.flatnonzero(above >= K)[-1])


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


@dataclass
class PlanSuggestion:
    """A layer-swap plan proposed from where the language expert's change dominates."""

    plan: Plan
    metric: str
    math_profile: list[float]  # per layer, normalised by the expert's own mean over layers
    lang_profile: list[float]
    lang_dominant: list[bool]
    rule: str
    note: str = ""

    def markdown(self) -> str:
        marks = "".join("L" if d else "·" for d in self.lang_dominant)
        out = (f"**Suggested plan: b={self.plan.b}, u={self.plan.u}, tb={self.plan.tb}, tu={self.plan.tu}** "
               f"(from {METRICS[self.metric]})  \nlanguage-dominated layers (bottom → top): `{marks}`  \n"
               f"*Rule:* {self.rule}")
        return out + (f"  \n*Note:* {self.note}" if self.note else "")


SUGGEST_RULE = (
    "per layer, each expert's change is divided by that expert's mean over all layers, so both are on their own "
    "scale; a layer is language-dominated when the language expert's normalised change is larger. b = the run of "
    "language-dominated layers from the bottom, u = the run from the top; one flat transition layer follows each "
    "swapped block when there is room, and at least one layer stays with the math expert."
)


@dataclass
class Analysis:
    """Per-tensor change statistics of two experts against their base (see the module docstring)."""

    refs: dict[str, str]  # base / math / lang -> reference
    fingerprints: dict[str, str]
    num_layers: int
    tensors: list[TensorMeta]
    base_sq: np.ndarray  # ‖θ_base‖² per tensor
    sq: dict[str, np.ndarray]  # role -> ‖Δ‖²
    abs_sum: dict[str, np.ndarray]  # role -> Σ|Δ|
    dot: np.ndarray  # ⟨Δ_math, Δ_lang⟩
    ml_sq: np.ndarray  # ‖θ_math − θ_lang‖²
    ml_abs: np.ndarray  # Σ|θ_math − θ_lang|
    hist: dict[str, Hist]
    topk: dict[float, TopK]
    run: RunInfo
    _merged: dict = field(default_factory=dict, repr=False)

    # ---- layout ---------------------------------------------------------------------------
    @property
    def numel(self) -> np.ndarray:
        return np.asarray([t.numel for t in self.tensors], dtype=np.int64)

    @property
    def N(self) -> int:
        return int(self.numel.sum())

    @property
    def ks(self) -> list[float]:
        return sorted(self.topk)

    @property
    def ptypes(self) -> list[str]:
        return sorted({t.ptype for t in self.tensors if t.layer is not None}, key=architecture("llama").sort_key)

    @property
    def row_labels(self) -> list[str]:
        return [architecture("llama").label(p) for p in self.ptypes]

    def index(self, name: str) -> int:
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(name)

    def cell_index(self) -> np.ndarray:
        """(ptypes x layers) array of tensor indices, -1 where the model has no such tensor."""
        rows = {p: r for r, p in enumerate(self.ptypes)}
        out = np.full((len(rows), self.num_layers), -1, dtype=np.int64)
        for i, t in enumerate(self.tensors):
            if t.layer is not None:
                out[rows[t.ptype], t.layer] = i
        return out

    def non_layer(self) -> list[int]:
        return [i for i, t in enumerate(self.tensors) if t.layer is None]

    def grid(self, values: np.ndarray) -> np.ndarray:
        """Per-tensor values arranged as (parameter types x layers), NaN for missing cells."""
        idx = self.cell_index()
        out = np.full(idx.shape, np.nan)
        out[idx >= 0] = np.asarray(values, dtype=float)[idx[idx >= 0]]
        return out

    def topk_at(self, k: float | None) -> TopK:
        if not self.topk:
            raise UserError("This analysis has no top-k% results; run it with a k (e.g. ks=(1.0,)).")
        if k is None:
            return self.topk[min(self.topk, key=lambda x: abs(x - 1.0))]
        for kk, r in self.topk.items():
            if math.isclose(kk, float(k)):
                return r
        raise UserError(f"top-k% for k={k} was not computed (have {', '.join(f'{x:g}' for x in self.ks)}); "
                        f"analyse again with k={k} (cached per model set).")

    # ---- metrics ----------------------------------------------------------------------------
    def _parts(self, panel: str, metric: str, k: float | None, merged: "MergedStats | None"):
        """Additive numerator/denominator per tensor, so that any group aggregates correctly."""
        if metric not in PANEL_METRICS.get(panel, ()):
            if panel not in PANEL_METRICS:
                raise UserError(f"Unknown panel {panel!r}; choose from {', '.join(PANEL_METRICS)}.")
            raise UserError(f"The {PANELS[panel]} panel shows {' / '.join(PANEL_METRICS[panel])}, not {metric!r}.")
        numel = self.numel.astype(float)
        if panel.startswith("merged"):
            if merged is None:
                raise UserError("The merged-model panels need a plan: pass one (merged = analysis.merged(plan, ...)).")
            vs = {"merged": "base", "merged-math": "math", "merged-lang": "lang"}[panel]
            if metric == "relative":
                return "sqrt", merged.sq[vs], self.base_sq
            if metric == "mean_abs":
                return "ratio", merged.abs_sum[vs], numel
            tk = merged.topk_at(k)
            return "share", tk.count, float(tk.K)
        if panel in ROLES:
            if metric == "relative":
                return "sqrt", self.sq[panel], self.base_sq
            if metric == "mean_abs":
                return "ratio", self.abs_sum[panel], numel
            tk = self.topk_at(k)
            return "share", tk.count(panel), float(tk.K)
        if panel == "math-lang":
            if metric == "relative":
                return "sqrt", self.ml_sq, self.base_sq
            return "ratio", self.ml_abs, numel
        # overlap
        if metric == "cosine":
            return "cosine", self.dot, (self.sq["math"], self.sq["lang"])
        tk = self.topk_at(k)
        return "jaccard", tk.joint, (tk.count("math"), tk.count("lang"))

    def values(self, panel: str, metric: str, k: float | None = None,
               merged: "MergedStats | None" = None) -> np.ndarray:
        """One value per tensor (aligned with `tensors`)."""
        return self.aggregate(panel, metric, [[i] for i in range(len(self.tensors))], k, merged)

    def aggregate(self, panel: str, metric: str, groups: Sequence[Sequence[int]], k: float | None = None,
                  merged: "MergedStats | None" = None) -> np.ndarray:
        """The metric over groups of tensors (e.g. one group per layer), aggregated exactly:
        relative change of a group is ‖Δ‖ over ‖θ_base‖ of all its tensors together, mean |Δ| is
        over all its entries, top-k shares add up, cosine and Jaccard use the group's sums."""
        kind, num, den = self._parts(panel, metric, k, merged)
        out = np.full(len(groups), np.nan)
        for g, idx in enumerate(groups):
            idx = list(idx)
            if not idx:
                continue
            if kind == "sqrt":
                d = float(np.sum(den[idx]))
                out[g] = math.sqrt(max(float(np.sum(num[idx])), 0.0) / d) if d > 0 else np.nan
            elif kind == "share":  # shares of one global K add up
                out[g] = float(np.sum(num[idx])) / den
            elif kind == "ratio":
                d = float(np.sum(den[idx]))
                out[g] = float(np.sum(num[idx])) / d if d > 0 else np.nan
            elif kind == "cosine":
                a, b = float(np.sum(den[0][idx])), float(np.sum(den[1][idx]))
                out[g] = float(np.sum(num[idx])) / math.sqrt(a * b) if a > 0 and b > 0 else np.nan
            else:  # jaccard
                j = float(np.sum(num[idx]))
                union = float(np.sum(den[0][idx])) + float(np.sum(den[1][idx])) - j
                out[g] = j / union if union > 0 else np.nan
        return out

    def layer_groups(self) -> list[list[int]]:
        groups: list[list[int]] = [[] for _ in range(self.num_layers)]
        for i, t in enumerate(self.tensors):
            if t.layer is not None:
                groups[t.layer].append(i)
        return groups

    def layer_profile(self, panel: str, metric: str = "relative", k: float | None = None,
                      merged: "MergedStats | None" = None) -> np.ndarray:
        """The metric per layer (all parameter types of the layer together)."""
        return self.aggregate(panel, metric, self.layer_groups(), k, merged)

    def overall(self, panel: str, metric: str, k: float | None = None, merged: "MergedStats | None" = None) -> float:
        return float(self.aggregate(panel, metric, [list(range(len(self.tensors)))], k, merged)[0])

    # ---- tables -----------------------------------------------------------------------------
    def rows(self, k: float | None = None, merged: "MergedStats | None" = None) -> list[dict]:
        """Every metric for every tensor: the CSV export and the hover texts use these."""
        cols: dict[str, np.ndarray] = {}
        for role in ROLES:
            cols[f"relative_{role}"] = self.values(role, "relative")
            cols[f"mean_abs_{role}"] = self.values(role, "mean_abs")
        cols["relative_math_vs_lang"] = self.values("math-lang", "relative")
        cols["mean_abs_math_vs_lang"] = self.values("math-lang", "mean_abs")
        cols["cosine"] = self.values("overlap", "cosine")
        if self.topk:
            tk = self.topk_at(k)
            for role in ROLES:
                cols[f"topk_share_{role}"] = tk.share(role)
            cols["topk_jaccard"] = tk.jaccard()
        if merged is not None:
            cols["w_lang"] = merged.weights
            for panel, short in (("merged", "merged"), ("merged-math", "merged_vs_math"),
                                 ("merged-lang", "merged_vs_lang")):
                cols[f"relative_{short}"] = self.values(panel, "relative", merged=merged)
                cols[f"mean_abs_{short}"] = self.values(panel, "mean_abs", merged=merged)
            if self.topk:
                cols["topk_share_merged"] = self.values("merged", "topk", k, merged)
        out = []
        for i, t in enumerate(self.tensors):
            row = {"tensor": t.name, "layer": t.layer, "ptype": t.ptype, "shape": "x".join(map(str, t.shape)),
                   "numel": t.numel}
            row.update({c: _num(v[i]) for c, v in cols.items()})
            out.append(row)
        return out

    def non_layer_rows(self, k: float | None = None, merged: "MergedStats | None" = None) -> list[dict]:
        """Embeddings, final norm and lm_head: reported apart from the layer grid."""
        return [r for r in self.rows(k, merged) if r["layer"] is None]

    def most_changed(self, n: int = 20, by: str = "relative", roles: Sequence[str] = ROLES,
                     k: float | None = None) -> list[dict]:
        """The `n` most-changed tensors by `by` (relative, mean_abs or topk), over `roles`."""
        base_rows = self.rows(k)
        scored = []
        for role in roles:
            vals = self.values(role, by, k)
            for i, v in enumerate(vals):
                if np.isfinite(v):
                    scored.append((float(v), role, i))
        scored.sort(key=lambda s: -s[0])
        out = []
        for rank, (v, role, i) in enumerate(scored[:n], 1):
            r = base_rows[i]
            out.append({"rank": rank, "expert": ROLE_NAMES[role], "tensor": r["tensor"], "layer": r["layer"],
                        "ptype": r["ptype"], "shape": r["shape"], by: v,
                        **{c: r[c] for c in (f"relative_{role}", f"mean_abs_{role}", f"topk_share_{role}",
                                             "cosine", "topk_jaccard") if c in r and c != by}})
        return out

    def summary(self, k: float | None = None) -> dict:
        s = {f"relative_{r}": self.overall(r, "relative") for r in ROLES}
        s["cosine"] = self.overall("overlap", "cosine")
        if self.topk:
            tk = self.topk_at(k)
            s.update(k=tk.k, K=tk.K, N=tk.N, overlap=tk.overlap(), chance_overlap=tk.chance_overlap(self.numel),
                     threshold_math=tk.threshold["math"], threshold_lang=tk.threshold["lang"])
            for r in ROLES:
                s[f"topk_non_layer_{r}"] = float(tk.share(r)[self.non_layer()].sum())
        return s

    def report(self, k: float | None = None, merged: "MergedStats | None" = None) -> str:
        """The headline numbers as Markdown lines (the app's summary, the CLI's printout)."""
        s = self.summary(k)
        lines = [f"Overall relative change: math expert {100 * s['relative_math']:.3g}%, language expert "
                 f"{100 * s['relative_lang']:.3g}%; cosine of the two task vectors {s['cosine']:+.3f}."]
        if self.topk:
            tk = self.topk_at(k)
            lines.append(f"Top-{tk.k:g}% sets: they share {100 * s['overlap']:.3g}% of their entries (chance level "
                         f"inside the same tensors: {100 * s['chance_overlap']:.3g}%). Outside the layers (embeddings, "
                         f"final norm, lm_head): {100 * s['topk_non_layer_math']:.3g}% of the math expert's set, "
                         f"{100 * s['topk_non_layer_lang']:.3g}% of the language expert's.")
            lines.append(f"Method: {self.describe_topk(k)}.")
        if merged is not None:
            p = merged.plan
            line = f"Merged model (plan b={p.b} u={p.u} tb={p.tb} tu={p.tu}, non-layer={p.non_layer}): "
            if self.topk:
                kept = merged.kept(self, k)
                mt = merged.topk_at(k)
                line += (f"keeps {100 * kept['math']:.3g}% of the math expert's top-{mt.k:g}% entries and "
                         f"{100 * kept['lang']:.3g}% of the language expert's (blended tensors count by weight); its "
                         f"own top-{mt.k:g}% shares are located on the |Δ| histograms, each within ±"
                         f"{100 * mt.max_error:.2g} percentage points. ")
            line += f"Overall relative change {100 * self.overall('merged', 'relative', merged=merged):.3g}%."
            lines.append(line)
        r = self.run
        lines.append("Loaded from the cache." if r.cached else
                     f"Computed in {r.seconds:.1f} s on {r.device} ({_size(r.bytes_read)} read, "
                     f"{max((tk.passes for tk in self.topk.values()), default=1)} pass(es) over the weights).")
        return "\n\n".join(lines)

    def describe_topk(self, k: float | None = None) -> str:
        """How the top-k% numbers were computed, in one sentence (for UI and CLI)."""
        tk = self.topk_at(k)
        return (f"top-{tk.k:g}% = the K = {tk.K:,} largest |Δ| of N = {tk.N:,} entries per expert, exact "
                f"(thresholds: math {tk.threshold['math']:.4g}, language {tk.threshold['lang']:.4g}; entries tied at "
                f"a threshold shared fractionally; {'one pass, threshold inside the sampled window' if tk.passes == 1 else 'three passes: the sampled window missed, or no sample'})")

    # ---- plan ---------------------------------------------------------------------------------
    def suggest_plan(self, metric: str = "relative", k: float | None = None) -> PlanSuggestion:
        """Propose b, u (and tb, tu) from where the language expert's change dominates; see SUGGEST_RULE."""
        if metric not in ("relative", "mean_abs", "topk"):
            raise UserError(f"suggest_plan compares relative, mean_abs or topk, not {metric!r}.")
        L = self.num_layers
        prof = {}
        for role in ROLES:
            p = np.nan_to_num(self.layer_profile(role, metric, k), nan=0.0)
            m = float(p.mean())
            prof[role] = p / m if m > 0 else p
        dom = [bool(prof["lang"][i] > prof["math"][i]) for i in range(L)]
        b = next((i for i, d in enumerate(dom) if not d), L)
        u = next((i for i, d in enumerate(reversed(dom)) if not d), L)
        note = ""
        if b == L:
            b, u = L - 1, 0
            note = "the language expert dominates every layer; one layer is left to the math expert."
        elif b + u > L - 1:
            u = max(L - 1 - b, 0)
        if not any(dom):
            note = "the math expert dominates every layer: nothing to swap by this rule."
        tb = 1 if b > 0 else 0
        tu = 1 if u > 0 else 0
        while b + tb + tu + u > L - 1 and (tb or tu):
            if tu:
                tu = 0
            else:
                tb = 0
        plan = Plan(b=b, u=u, tb=tb, tu=tu)
        return PlanSuggestion(plan, metric, [float(x) for x in prof["math"]], [float(x) for x in prof["lang"]],
                              dom, SUGGEST_RULE, note)

    def merged(self, plan: Plan, math: Checkpoint, lang: Checkpoint, base: Checkpoint, *, device: str = "cpu",
               progress: Progress | None = None) -> "MergedStats":
        """The layer-swapped model (as `export_merge` writes it) against base and both experts."""
        L = self.num_layers
        lw = plan.layer_weights(L)
        weights = np.asarray([plan.tensor_weight(t.layer, t.ptype, lw) for t in self.tensors], dtype=float)
        key = tuple(weights.tolist())
        if key not in self._merged:
            self._merged[key] = _merged_stats(self, plan, weights, math, lang, base, device, progress)
        ms = self._merged[key]
        ms.plan = plan
        return ms

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT_VERSION, "refs": self.refs, "fingerprints": self.fingerprints,
            "num_layers": self.num_layers,
            "tensors": [[t.name, t.layer, t.ptype, list(t.shape), t.numel] for t in self.tensors],
            "topk": [{"k": tk.k, "K": tk.K, "N": tk.N, "threshold": tk.threshold, "passes": tk.passes}
                     for tk in self.topk.values()],
            "run": {k: v for k, v in vars(self.run).items() if k not in ("cached", "cache_file")},
        }
        arrays = {"base_sq": self.base_sq, "dot": self.dot, "ml_sq": self.ml_sq, "ml_abs": self.ml_abs}
        for r in ROLES:
            arrays[f"sq_{r}"], arrays[f"abs_{r}"] = self.sq[r], self.abs_sum[r]
            h = self.hist[r]
            arrays[f"hist_lo_{r}"], arrays[f"hist_off_{r}"], arrays[f"hist_{r}"] = h.lo, h.offsets, h.counts
        for j, tk in enumerate(self.topk.values()):
            arrays[f"topk{j}_joint"] = tk.joint
            for r in ROLES:
                arrays[f"topk{j}_gt_{r}"], arrays[f"topk{j}_eq_{r}"] = tk.n_gt[r], tk.n_eq[r]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Analysis":
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError("old cache format")
            a = {k: z[k] for k in z.files if k != "meta"}
        tensors = [TensorMeta(n, layer, p, tuple(s), int(c)) for n, layer, p, s, c in meta["tensors"]]
        topk = {}
        for j, d in enumerate(meta["topk"]):
            topk[float(d["k"])] = TopK(float(d["k"]), int(d["K"]), int(d["N"]),
                                       {r: float(v) for r, v in d["threshold"].items()},
                                       {r: a[f"topk{j}_gt_{r}"] for r in ROLES}, {r: a[f"topk{j}_eq_{r}"] for r in ROLES},
                                       a[f"topk{j}_joint"], int(d["passes"]))
        return cls(
            refs=meta["refs"], fingerprints=meta["fingerprints"], num_layers=int(meta["num_layers"]), tensors=tensors,
            base_sq=a["base_sq"], sq={r: a[f"sq_{r}"] for r in ROLES}, abs_sum={r: a[f"abs_{r}"] for r in ROLES},
            dot=a["dot"], ml_sq=a["ml_sq"], ml_abs=a["ml_abs"],
            hist={r: Hist(a[f"hist_lo_{r}"], a[f"hist_off_{r}"], a[f"hist_{r}"]) for r in ROLES},
            topk=topk, run=RunInfo(**meta["run"], cached=True, cache_file=str(path)),
        )


def write_csv(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """Rows of dicts (as `Analysis.rows` / `most_changed` give them) as a CSV file."""
    import csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return path


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _num(v) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


# ---- the merged model ------------------------------------------------------------------------

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
        if not self.topk:
            raise UserError("No top-k% results for the merged model: analyse with a k first.")
        if k is None:
            return self.topk[min(self.topk, key=lambda x: abs(x - 1.0))]
        for kk, r in self.topk.items():
            if math.isclose(kk, float(k)):
                return r
        raise UserError(f"top-k% for k={k} was not computed for this analysis.")

    def kept(self, analysis: Analysis, k: float | None = None) -> dict[str, float]:
        """Share of each expert's top-k% entries in tensors the merge takes from that expert
        (blended tensors count by their weight)."""
        tk = analysis.topk_at(k)
        return {"math": float((tk.share("math") * (1 - self.weights)).sum()),
                "lang": float((tk.share("lang") * self.weights).sum())}


def _merged_stats(an: Analysis, plan: Plan, weights: np.ndarray, math_ck: Checkpoint, lang_ck: Checkpoint,
                  base_ck: Checkpoint, device: str, progress: Progress | None) -> MergedStats:
    from .merging import blend

    _same_models(an, base_ck, math_ck, lang_ck)
    T = len(an.tensors)
    sq = {v: np.zeros(T) for v in ("base", "math", "lang")}
    ab = {v: np.zeros(T) for v in ("base", "math", "lang")}
    parts: list[tuple[int, np.ndarray] | None] = [None] * T  # trimmed |θ_merged − θ_base| histograms
    blended = [i for i in range(T) if weights[i] not in (0.0, 1.0)]
    for i in range(T):
        w = weights[i]
        if w == 0.0:
            src, other = "math", "lang"
        elif w == 1.0:
            src, other = "lang", "math"
        else:
            continue
        sq["base"][i], ab["base"][i] = an.sq[src][i], an.abs_sum[src][i]
        sq[other][i], ab[other][i] = an.ml_sq[i], an.ml_abs[i]
        parts[i] = an.hist[src].tensor(i)
    names = [an.tensors[i].name for i in blended]
    if names:
        dev = _device(device)
        chunk = CUDA_CHUNK if dev.type == "cuda" else CPU_CHUNK
        total = sum(an.tensors[i].numel for i in blended)
        done = 0
        acc = torch.zeros(6, dtype=torch.float64, device=dev)
        h = torch.zeros(NBINS, dtype=torch.int64, device=dev)
        with ChunkStream([base_ck, math_ck, lang_ck], names, chunk_elems=chunk, device=str(dev)) as s:
            for c in s:
                i = blended[c.index]
                a, m, l = (x.to(torch.float32) for x in c.tensors)
                merged = blend(c.tensors[1], c.tensors[2], float(weights[i])).to(torch.float32)
                sums = []
                for ref in (a, m, l):
                    d = merged - ref
                    sums += [(d * d).sum(), d.abs().sum()]
                    if ref is a:
                        h += torch.bincount(bin_index(d.abs_()), minlength=NBINS)
                acc += torch.stack(sums).to(torch.float64)
                if c.last:
                    v = acc.cpu().numpy()
                    for j, vs in enumerate(("base", "math", "lang")):
                        sq[vs][i], ab[vs][i] = v[2 * j], v[2 * j + 1]
                    parts[i] = Hist.trim(h.cpu().numpy())
                    acc.zero_()
                    h.zero_()
                done += c.n
                if progress:
                    progress(done / max(total, 1), f"merged: {c.name}")
    hist = Hist.from_parts([p if p is not None else (0, np.zeros(0, np.int64)) for p in parts])
    topk = {}
    for kk, tk in an.topk.items():
        tot = hist.total()
        b = boundary_bin(tot, tk.K)
        topk[kk] = MergedTopK(kk, tk.K, hist.count_ge(b + 1), hist.count_in(b), b)
    return MergedStats(plan, weights, sq, ab, hist, topk, names)


def _same_models(an: Analysis, base: Checkpoint, math_ck: Checkpoint, lang_ck: Checkpoint) -> None:
    now = {"base": base.fingerprint(), "math": math_ck.fingerprint(), "lang": lang_ck.fingerprint()}
    if now != an.fingerprints:
        raise UserError("These checkpoints are not the ones this analysis was computed on (or they changed on "
                        "disk since): analyse them again.")


def _device(device: str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for, but torch sees no CUDA GPU; use 'cpu'.")
    if d.type not in ("cpu", "cuda"):
        raise UserError(f"The analysis runs on cpu or cuda, not {device!r}.")
    return d


# ---- the streaming computation ------------------------------------------------------------------

@dataclass
class _Window:
    """Bins [lo, hi) whose entries are kept exactly; bins >= hi are surely in the top set.

    lo == hi == 1 is the 'zero threshold' case: every nonzero entry is in the set."""

    lo: int
    hi: int


class _Kernel:
    """Float32 working slices on `device`: base, |Δ_math|, |Δ_lang| and their histogram bins."""

    def __init__(self, device: torch.device, chunk: int):
        self.dev = device
        f32 = dict(dtype=torch.float32, device=device)
        self.buf = {n: torch.empty(chunk, **f32) for n in ("a", "m", "l", "dm", "dl", "tmp")}
        self.ibuf = {r: torch.empty(chunk, dtype=torch.int32, device=device) for r in ROLES}
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
        for x, idx in ((dm, im), (dl, il)):
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


def _merge_counts(pending: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and summed multiplicities (bf16 changes tie a lot: this keeps them small)."""
    if len(pending) == 1:
        return pending[0]
    keys = np.concatenate([k for k, _ in pending])
    u, inv = np.unique(keys, return_inverse=True)
    return u, np.bincount(inv, weights=np.concatenate([c for _, c in pending]), minlength=len(u)).astype(np.int64)


class _MainPass:
    """Sums, exact histograms, and the entries inside the sampled windows (compressed by value)."""

    def __init__(self, T: int, windows: dict[float, dict[str, _Window]], device: torch.device, chunk: int,
                 max_kept: int):
        self.T = T
        self.kern = _Kernel(device, chunk)
        self.windows = windows
        self.ks = sorted(windows)
        self.sums = np.zeros((8, T))
        self.parts: dict[str, dict[int, tuple[int, np.ndarray]]] = {r: {} for r in ROLES}  # t -> trimmed histogram
        self.joint_def = np.zeros((len(self.ks), T), np.int64)
        self.own: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {r: [] for r in ROLES}  # (t, bits, count)
        self.pairs: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[] for _ in self.ks]  # (t, mbits<<32|lbits, n)
        self.pending: dict = {}  # this tensor's kept entries, per role name or k index
        self.pending_n = 0
        self.kept = 0
        self.max_kept = max_kept
        self.overflow = False
        self.acc = torch.zeros(8, dtype=torch.float64, device=device)
        self.hist = {r: torch.zeros(NBINS, dtype=torch.int64, device=device) for r in ROLES}
        self.lo_sel = {r: min((w[r].lo for w in windows.values()), default=1) for r in ROLES}

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int, last: bool) -> None:
        vm, vl, im, il, s = self.kern.deltas(raw, n, True, name)
        self.acc += s
        hm, hl = torch.bincount(im, minlength=NBINS), torch.bincount(il, minlength=NBINS)
        self.hist["math"] += hm
        self.hist["lang"] += hl
        if self.windows and not self.overflow:
            # most slices hold nothing in reach of either window: their histograms say so
            if bool((hm[self.lo_sel["math"]:].sum() + hl[self.lo_sel["lang"]:].sum()) > 0):
                self._window_entries(t, vm, vl, im, il)
        if last:
            self.finish(t)

    def finish(self, t: int) -> None:
        self.sums[:, t] = self.acc.cpu().numpy()
        self.acc.zero_()
        for r in ROLES:
            self.parts[r][t] = Hist.trim(self.hist[r].cpu().numpy())
            self.hist[r].zero_()
        for key, pending in self.pending.items():  # one (values, counts) record per tensor
            if pending:
                store = self.own[key] if isinstance(key, str) else self.pairs[key]
                u, c = _merge_counts(pending)
                store.append((t, u, c))
                self.kept += len(u)
        self.pending, self.pending_n = {}, 0
        if self.kept > self.max_kept:  # a badly placed window: give up on it, the exact passes follow
            self._give_up()

    def absorb(self, other: "_MainPass") -> None:
        """Add another worker's results (it saw other tensors)."""
        self.sums += other.sums
        for r in ROLES:
            self.parts[r].update(other.parts[r])
            self.own[r] += other.own[r]
        self.joint_def += other.joint_def
        for j in range(len(self.ks)):
            self.pairs[j] += other.pairs[j]
        self.kept += other.kept  # each worker kept at most its share of max_kept
        if other.overflow or self.overflow:
            self._give_up()

    def hists(self, T: int) -> dict[str, Hist]:
        return {r: Hist.from_parts([self.parts[r].get(t, (0, np.zeros(0, np.int64))) for t in range(T)])
                for r in ROLES}

    def _give_up(self) -> None:
        self.overflow = True
        self.own = {r: [] for r in ROLES}
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


class _ThresholdPass:
    """Fallback, first pass: a 65536-bin histogram inside each threshold's bin gives it exactly."""

    def __init__(self, bins: dict[tuple[float, str], int], device: torch.device, chunk: int):
        self.kern = _Kernel(device, chunk)
        self.bins = {key: b for key, b in bins.items() if b > 0}
        self.fine = {key: torch.zeros(65536, dtype=torch.int64, device=device) for key in self.bins}

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int, last: bool) -> None:
        vm, vl, im, il, _ = self.kern.deltas(raw, n, False, name)
        for (k, r), b in self.bins.items():
            v, idx = (vm, im) if r == "math" else (vl, il)
            sub = v.view(torch.int32)[idx == b] - ((b - 1) * 65536 + 1)
            self.fine[(k, r)] += torch.bincount(sub, minlength=65536)

    def absorb(self, other: "_ThresholdPass") -> None:
        for key in self.fine:
            self.fine[key] += other.fine[key].to(self.fine[key].device)


class _CountPass:
    """Fallback, second pass: with the thresholds known, count every class per tensor."""

    def __init__(self, T: int, thresholds: dict[float, dict[str, float]], device: torch.device, chunk: int):
        self.kern = _Kernel(device, chunk)
        self.thr = thresholds
        self.counts = {k: np.zeros((8, T), np.int64) for k in thresholds}  # gt_m, eq_m, gt_l, eq_l, G, GE, EG, EE
        self.acc = {k: torch.zeros(8, dtype=torch.int64, device=device) for k in thresholds}

    def chunk(self, t: int, name: str, raw: list[torch.Tensor], n: int, last: bool) -> None:
        vm, vl, _, _, _ = self.kern.deltas(raw, n, False, name)
        for k, th in self.thr.items():
            gm, em = vm > th["math"], vm == th["math"]
            gl, el = vl > th["lang"], vl == th["lang"]
            self.acc[k] += torch.stack([gm.sum(), em.sum(), gl.sum(), el.sum(), (gm & gl).sum(), (gm & el).sum(),
                                        (em & gl).sum(), (em & el).sum()])
            if last:
                self.counts[k][:, t] = self.acc[k].cpu().numpy()
                self.acc[k].zero_()

    def absorb(self, other: "_CountPass") -> None:
        for k in self.counts:
            self.counts[k] += other.counts[k]


def _split(tensors: list[TensorMeta], workers: int) -> list[list[int]]:
    """Tensor indices in `workers` groups of about equal size, each in file order."""
    groups: list[list[int]] = [[] for _ in range(max(1, workers))]
    load = [0] * len(groups)
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].numel):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += tensors[i].numel
    return [sorted(g) for g in groups if g]


def _stream(cks: list[Checkpoint], tensors: list[TensorMeta], make_handler, device: torch.device, chunk: int,
            progress: Progress | None, label: str, p0: float, p1: float, workers: int = 1):
    """Feed every slice of every tensor (base, math, lang) to a handler's `chunk`.

    With several workers, each thread takes its own share of the tensors with its own reader and
    working memory (torch releases the GIL inside each operation), and the handlers are merged.
    Returns (handler, bytes read).
    """
    total = sum(t.numel for t in tensors) or 1
    groups = _split(tensors, workers)
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
                             read_bytes=max(1 << 20, (8 << 20) // len(groups))) as s:
                for c in s:
                    t = idx[c.index]
                    if c.n:
                        h.chunk(t, c.name, c.tensors, c.n, c.last)
                    elif c.last and hasattr(h, "finish"):  # an empty tensor
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

    if len(groups) == 1:
        work(0, True)
    else:
        import threading

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


def _sample(cks: list[Checkpoint], tensors: list[TensorMeta], fraction: float, max_entries: int,
            block: int = 8192) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, int]:
    """Histograms of each expert's |Δ| at sampled positions (blocks spread over every tensor).

    Returns, per role, the estimated count of the whole model in each bin (each sampled entry
    stands for numel/sampled entries of its tensor) and the raw sampled counts; then the bytes
    read and the number of entries sampled.
    """
    N = sum(t.numel for t in tensors)
    f = min(fraction, max_entries / max(N, 1))
    est = {r: np.zeros(NBINS) for r in ROLES}
    raw = {r: np.zeros(NBINS, np.int64) for r in ROLES}
    files = Files()
    nbytes = sampled = 0
    try:
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
            counts = {r: np.zeros(NBINS, np.int64) for r in ROLES}
            for start, count in ranges:
                a, m, l = (read_range(ck, t.name, start, count, files) for ck in cks)
                a = a.to(torch.float32)
                nbytes += 3 * count * size
                for r, x in (("math", m), ("lang", l)):
                    counts[r] += torch.bincount(bin_index((x - a).abs_()), minlength=NBINS).numpy()
            for r in ROLES:
                raw[r] += counts[r]
                est[r] += counts[r] * (t.numel / got)
            sampled += got
    finally:
        files.close()
    return est, raw, nbytes, sampled


def _window_from_sample(est: np.ndarray, raw: np.ndarray, K: int, max_kept: int) -> _Window:
    """Bins around the sample's estimate of the bin of the K-th largest |Δ|, with a generous margin.

    The margin is 3% of K plus 4 standard errors of a binomial count of the sampled top set (the
    sample is drawn in blocks, so its real error is larger; a miss only costs the exact passes).
    """
    above_est = np.cumsum(est[::-1])[::-1]  # estimated entries in bins >= b
    above_raw = np.cumsum(raw[::-1])[::-1]
    if above_raw[0] == 0:
        return _Window(1, 1)
    b_star = np.flatnonzero(above_est >= K)
    m = int(above_raw[b_star[-1]]) if len(b_star) else int(above_raw[0])  # sampled entries in the top set
    delta = 0.03 + 4.0 / math.sqrt(max(m, 1))
    delta = min(delta, 0.5, max(max_kept / (4.0 * K), 0.002))
    ge_hi = np.flatnonzero(above_est >= K * (1 - delta))
    ge_lo = np.flatnonzero(above_est >= K * (1 + delta))
    hi = int(ge_hi[-1]) + 1 if len(ge_hi) else 1
    lo = int(ge_lo[-1]) if len(ge_lo) else 1
    hi, lo = max(hi, 1), max(lo, 1)
    return _Window(min(lo, hi), hi)


def _gather(store: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not store:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    ts = np.concatenate([np.full(len(u), t) for t, u, _ in store])
    return ts, np.concatenate([u for _, u, _ in store]), np.concatenate([c for _, _, c in store])


def _f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.int64).astype(np.int32).view(np.float32)


def _resolve(ps: _MainPass, hists: dict[str, Hist], numel: np.ndarray, k: float, K: int, N: int) -> TopK | None:
    """Exact thresholds, counts and intersections for one k from the main pass, or None if a window missed."""
    if ps.overflow:
        return None
    j = ps.ks.index(k)
    T = len(numel)
    thr, n_gt, n_eq = {}, {}, {}
    for r in ROLES:
        w = ps.windows[k][r]
        above = hists[r].count_ge(w.hi)
        if w.lo == w.hi:  # zero-threshold window: right only if fewer than K entries are nonzero
            if w.hi != 1 or int(above.sum()) >= K:
                return None
            thr[r], n_gt[r], n_eq[r] = 0.0, above, numel - above
            continue
        ts, bits, cnt = _gather(ps.own[r])
        vals = _f32(bits)
        bins = (bits + 0xFFFF) >> 16
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
        vm, vl = _f32(keys >> 32), _f32(keys & 0xFFFFFFFF)
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
    f = {}
    for r in ROLES:
        gt, eq = int(n_gt[r].sum()), int(n_eq[r].sum())
        f[r] = (K - gt) / eq if eq else 0.0
    joint = G + f["lang"] * GE + f["math"] * EG + f["math"] * f["lang"] * EE
    return TopK(k, K, N, thr, n_gt, n_eq, np.asarray(joint, dtype=float), passes)


def _fallback(cks, tensors, hists, ks, Ks, N, dev, chunk, progress, workers) -> tuple[dict[float, TopK], int]:
    """Exact top-k% in two more passes: locate each threshold inside its bin, then count."""
    bins, need = {}, {}
    for k in ks:
        for r in ROLES:
            tot = hists[r].total()
            b = boundary_bin(tot, Ks[k])
            bins[(k, r)] = b
            need[(k, r)] = Ks[k] - int(tot[b + 1:].sum())
    tp = _ThresholdPass(bins, dev, chunk)
    nbytes = 0
    if tp.bins:
        tp, nb = _stream(cks, tensors, lambda: _ThresholdPass(bins, dev, chunk), dev, chunk, progress,
                         "locating the top-k% thresholds", 0.95, 0.97, workers)
        nbytes += nb
    thr: dict[float, dict[str, float]] = {k: {} for k in ks}
    for (k, r), b in bins.items():
        if b == 0:
            thr[k][r] = 0.0
            continue
        fine = tp.fine[(k, r)].cpu().numpy()
        from_top = np.cumsum(fine[::-1])
        sub = 65535 - int(np.searchsorted(from_top, need[(k, r)]))
        thr[k][r] = float(_f32(np.array([(b - 1) * 65536 + 1 + sub]))[0])
    cp, nb = _stream(cks, tensors, lambda: _CountPass(len(tensors), thr, dev, chunk), dev, chunk, progress,
                     "counting the top-k% sets", 0.97, 1.0, workers)
    nbytes += nb
    out = {}
    for k in ks:
        c = cp.counts[k]
        n_gt, n_eq = {"math": c[0], "lang": c[2]}, {"math": c[1], "lang": c[3]}
        out[k] = _topk(k, Ks[k], N, thr[k], n_gt, n_eq, c[4].astype(float), c[5].astype(float),
                       c[6].astype(float), c[7].astype(float), 3)
    return out, nbytes


def analyze(base: Checkpoint, math: Checkpoint, lang: Checkpoint, *, ks: Sequence[float] = DEFAULT_KS,
            device: str = "cpu", cache: bool | str | os.PathLike = True, progress: Progress | None = None,
            chunk_elems: int | None = None, sample_fraction: float = 1 / 256,
            sample_max_entries: int = 1 << 21, sample_block: int = 8192, max_kept: int = 1 << 22,
            workers: int = 1) -> Analysis:
    """Stream base, math and language expert once and compute every statistic (module docstring).

    `ks`: top-k percentages to compute exactly (0 < k <= 100). `cache`: True (the default
    folder), a folder, or False. `sample_fraction=0` skips the sample and always locates the
    thresholds with two more exact passes. `max_kept` bounds the window entries kept in memory
    (distinct values per tensor); past it the window is dropped for the exact passes.
    `workers`: threads that each stream their own share of the tensors (CPU: use one per free
    core, with torch's own threads at 1, e.g. OMP_NUM_THREADS=1, or the two oversubscribe).
    Results do not depend on it.
    """
    if workers < 1:
        raise UserError(f"workers must be at least 1 (got {workers}).")
    ks = sorted({float(k) for k in ks})
    for k in ks:
        if not 0 < k <= 100:
            raise UserError(f"k is a percentage in (0, 100]; got {k}.")
    dev = _device(device)
    rep = check_compatible(math, lang, base)
    if not rep.ok:
        raise UserError(f"Cannot analyse these models: {rep.errors[0].what}: {rep.errors[0].detail}.")
    fps = {"base": base.fingerprint(), "math": math.fingerprint(), "lang": lang.fingerprint()}
    refs = {"base": base.ref, "math": math.ref, "lang": lang.ref}
    cache_file = None
    if cache:
        folder = cache_root() if cache is True else Path(cache)
        key = hashlib.sha256(json.dumps({"v": FORMAT_VERSION, "fp": fps}, sort_keys=True).encode()).hexdigest()[:24]
        cache_file = folder / f"{key}.npz"
        hit = None
        if cache_file.exists():
            try:
                hit = Analysis.load(cache_file)
            except Exception:  # unreadable or older format: recompute and overwrite
                hit = None
        if hit is not None and hit.fingerprints == fps:
            if all(any(math_isclose(k, x) for x in hit.ks) for k in ks):
                hit.refs = refs
                if progress:
                    progress(1.0, "loaded from the cache")
                return hit
            ks = sorted(set(ks) | set(hit.ks))  # keep every k computed so far
    t0 = time.perf_counter()
    cks = [base, math, lang]
    infos = sorted((info for info in base.tensors.values() if info.torch_dtype.is_floating_point),
                   key=lambda i: (str(i.file), i.start))
    if not infos:
        raise UserError(f"{base.ref} holds no floating-point tensors to compare.")
    tensors = [TensorMeta(i.name, i.layer, i.ptype, tuple(i.shape), i.numel) for i in infos]
    numel = np.asarray([t.numel for t in tensors], np.int64)
    N = int(numel.sum())
    Ks = {k: min(N, max(1, round(k / 100 * N))) for k in ks}
    chunk = chunk_elems or (CUDA_CHUNK if dev.type == "cuda" else CPU_CHUNK)
    nbytes, sample_n = 0, 0
    windows: dict[float, dict[str, _Window]] = {}
    if ks and sample_fraction > 0:
        if progress:
            progress(0.0, "sampling |Δ| to place the top-k% window")
        est, raw, nb, sample_n = _sample(cks, tensors, sample_fraction, sample_max_entries, sample_block)
        nbytes += nb
        windows = {k: {r: _window_from_sample(est[r], raw[r], Ks[k], max_kept) for r in ROLES} for k in ks}
    ps, nb = _stream(cks, tensors, lambda: _MainPass(len(tensors), windows, dev, chunk, max(1, max_kept // workers)),
                     dev, chunk, progress, "statistics", 0.02, 0.95 if ks else 1.0, workers)
    ps.max_kept = max_kept
    nbytes += nb
    hists = ps.hists(len(tensors))
    topk: dict[float, TopK] = {}
    for k in windows:
        r = _resolve(ps, hists, numel, k, Ks[k], N)
        if r is not None:
            topk[k] = r
    missing = [k for k in ks if k not in topk]
    passes = 3 if missing else 1
    if missing:
        more, nb = _fallback(cks, tensors, hists, missing, Ks, N, dev, chunk, progress, workers)
        nbytes += nb
        topk.update(more)
    s = ps.sums
    an = Analysis(
        refs=refs, fingerprints=fps, num_layers=math.num_layers,
        tensors=tensors, base_sq=s[0], sq={"math": s[1], "lang": s[2]}, abs_sum={"math": s[4], "lang": s[5]},
        dot=s[3], ml_sq=s[6], ml_abs=s[7], hist=hists, topk={k: topk[k] for k in ks},
        run=RunInfo(time.perf_counter() - t0, passes, nbytes, str(dev), sample_n, workers),
    )
    if cache_file is not None:
        try:
            an.save(cache_file)
            an.run.cache_file = str(cache_file)
            _prune(cache_file.parent)
        except OSError:
            pass  # a read-only cache folder only costs the next run its speed
    if progress:
        progress(1.0, "done")
    return an


CACHE_KEEP = 32


def _prune(folder: Path, keep: int = CACHE_KEEP) -> None:
    """Keep the `keep` most recently written analyses (a few MB each for an 8B model)."""
    files = sorted(folder.glob("*.npz"), key=lambda f: f.stat().st_mtime, reverse=True)
    for f in files[keep:]:
        f.unlink(missing_ok=True)


def math_isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
