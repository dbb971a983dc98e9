"""The result of an analysis: `Analysis`, its queries (values, group aggregates, tables, report), and number format."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from layerswap.models.architectures import Architecture, architecture
from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.core.roles import EXPERTS, ROLE_NAMES
from layerswap.core.runtime import Progress
from layerswap.recipe.sources import Sources
from layerswap.analysis import store
from layerswap.analysis.bins import Hist
from layerswap.analysis.merged import MergedStats, merged_stats
from layerswap.analysis.records import PANEL_METRICS, PANELS, RunInfo, TensorMeta, TopK, pick_k
from layerswap.analysis.suggest import PlanSuggestion, suggest_plan


def format_value(metric: str, v: float | None) -> str:
    """One value of `metric` for people: a percentage for relative / topk / jaccard (3 significant
    figures), signed with 3 decimals for cosine, 3 significant figures otherwise; "–" when missing."""
    if v is None or not math.isfinite(float(v)):
        return "–"
    if metric in ("relative", "topk", "jaccard"):
        return f"{100 * v:.3g}%"
    if metric == "cosine":
        return f"{v:+.3f}"
    return f"{v:.3g}"


_COLUMN_METRICS = (("relative", "relative"), ("mean_abs", "mean_abs"), ("topk_share", "topk"),
                   ("topk_jaccard", "jaccard"), ("cosine", "cosine"))


def format_row(row: dict) -> dict:
    """A row of `Analysis.rows` / `most_changed` for people: each number by its column's metric."""
    def metric(column: str) -> str:
        return next((m for prefix, m in _COLUMN_METRICS if column.startswith(prefix)), column)

    return {k: format_value(metric(k), v) if isinstance(v, float) else ("" if v is None else v) for k, v in row.items()}


@dataclass
class Analysis:
    """Per-tensor change statistics of two experts against their base (see the package docstring)."""

    refs: dict[str, str]  # base / math / lang -> reference
    fingerprints: dict[str, str]
    num_layers: int
    model_type: str  # the checkpoints' config model_type: row order and labels come from its Architecture
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
    def arch(self) -> Architecture:
        return architecture(self.model_type)

    @property
    def ptypes(self) -> list[str]:
        """The per-layer parameter types in the architecture's display order (heatmap rows)."""
        return sorted({t.ptype for t in self.tensors if t.layer is not None}, key=self.arch.sort_key)

    @property
    def row_labels(self) -> list[str]:
        return [self.arch.label(p) for p in self.ptypes]

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
        """The top-k% results for `k` (None: the k closest to 1%)."""
        return pick_k(self.topk, k)

    # ---- metrics ----------------------------------------------------------------------------
    def _parts(self, panel: str, metric: str, k: float | None, merged: MergedStats | None):
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
        if panel in EXPERTS:
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
               merged: MergedStats | None = None) -> np.ndarray:
        """One value per tensor (aligned with `tensors`)."""
        return self.aggregate(panel, metric, [[i] for i in range(len(self.tensors))], k, merged)

    def aggregate(self, panel: str, metric: str, groups: Sequence[Sequence[int]], k: float | None = None,
                  merged: MergedStats | None = None) -> np.ndarray:
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
                      merged: MergedStats | None = None) -> np.ndarray:
        """The metric per layer (all parameter types of the layer together)."""
        return self.aggregate(panel, metric, self.layer_groups(), k, merged)

    def overall(self, panel: str, metric: str, k: float | None = None, merged: MergedStats | None = None) -> float:
        return float(self.aggregate(panel, metric, [list(range(len(self.tensors)))], k, merged)[0])

    # ---- tables -----------------------------------------------------------------------------
    def rows(self, k: float | None = None, merged: MergedStats | None = None) -> list[dict]:
        """Every metric for every tensor: the CSV export and the hover texts use these."""
        cols: dict[str, np.ndarray] = {}
        for role in EXPERTS:
            cols[f"relative_{role}"] = self.values(role, "relative")
            cols[f"mean_abs_{role}"] = self.values(role, "mean_abs")
        cols["relative_math_vs_lang"] = self.values("math-lang", "relative")
        cols["mean_abs_math_vs_lang"] = self.values("math-lang", "mean_abs")
        cols["cosine"] = self.values("overlap", "cosine")
        if self.topk:
            tk = self.topk_at(k)
            for role in EXPERTS:
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
            if merged is not None:
                row["merged_source"] = merged.sources[i].label()
            out.append(row)
        return out

    def non_layer_rows(self, k: float | None = None, merged: MergedStats | None = None) -> list[dict]:
        """Embeddings, final norm and lm_head: reported apart from the layer grid."""
        return [r for r in self.rows(k, merged) if r["layer"] is None]

    def most_changed(self, n: int = 20, by: str = "relative", roles: Sequence[str] = EXPERTS,
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
        s = {f"relative_{r}": self.overall(r, "relative") for r in EXPERTS}
        s["cosine"] = self.overall("overlap", "cosine")
        if self.topk:
            tk = self.topk_at(k)
            s.update(k=tk.k, K=tk.K, N=tk.N, overlap=tk.overlap(), chance_overlap=tk.chance_overlap(self.numel),
                     threshold_math=tk.threshold["math"], threshold_lang=tk.threshold["lang"])
            for r in EXPERTS:
                s[f"topk_non_layer_{r}"] = float(tk.share(r)[self.non_layer()].sum())
        return s

    def report(self, k: float | None = None, merged: MergedStats | None = None) -> str:
        """The headline numbers as Markdown lines (the app's summary, the CLI's printout)."""
        s = self.summary(k)
        pct = lambda v: format_value("relative", v)  # noqa: E731
        lines = [f"Overall relative change: math expert {pct(s['relative_math'])}, language expert "
                 f"{pct(s['relative_lang'])}; cosine of the two task vectors {format_value('cosine', s['cosine'])}."]
        if self.topk:
            tk = self.topk_at(k)
            lines.append(f"Top-{tk.k:g}% sets: they share {pct(s['overlap'])} of their entries (chance level inside "
                         f"the same tensors: {pct(s['chance_overlap'])}). Outside the layers (embeddings, final norm, "
                         f"lm_head): {pct(s['topk_non_layer_math'])} of the math expert's set, "
                         f"{pct(s['topk_non_layer_lang'])} of the language expert's.")
            lines.append(f"Method: {self.describe_topk(k)}.")
        if merged is not None:
            p = merged.plan
            line = f"Merged model (plan {p.title().removeprefix('swap ')}): "
            if self.topk:
                kept = merged.kept(self, k)
                mt = merged.topk_at(k)
                line += (f"keeps {pct(kept['math'])} of the math expert's top-{mt.k:g}% entries and "
                         f"{pct(kept['lang'])} of the language expert's (blended tensors count by weight); its "
                         f"own top-{mt.k:g}% shares are located on the |Δ| histograms, each within ±"
                         f"{100 * mt.max_error:.2g} percentage points. ")
            line += f"Overall relative change {pct(self.overall('merged', 'relative', merged=merged))}."
            lines.append(line)
        r = self.run
        lines.append("Loaded from the cache." if r.cached else
                     f"Computed in {r.seconds:.1f} s on {r.device} ({_size(r.bytes_read)} read, "
                     f"{max((tk.passes for tk in self.topk.values()), default=1)} pass(es) over the weights).")
        return "\n\n".join(lines)

    def describe_topk(self, k: float | None = None) -> str:
        """How the top-k% numbers were computed, in one sentence (for UI and CLI)."""
        tk = self.topk_at(k)
        how = ("one pass, threshold inside the sampled window" if tk.passes == 1
               else "three passes: the sampled window missed, or no sample")
        return (f"top-{tk.k:g}% = the K = {tk.K:,} largest |Δ| of N = {tk.N:,} entries per expert, exact "
                f"(thresholds: math {tk.threshold['math']:.4g}, language {tk.threshold['lang']:.4g}; entries tied at "
                f"a threshold shared fractionally; {how})")

    # ---- plan ---------------------------------------------------------------------------------
    def suggest_plan(self, metric: str = "relative", k: float | None = None) -> PlanSuggestion:
        """Propose b, u (and tb, tu) from where the language expert's change dominates; see SUGGEST_RULE."""
        return suggest_plan(self, metric, k)

    def merged(self, plan: Plan, math: Checkpoint, lang: Checkpoint, base: Checkpoint, *, device: str = "cpu",
               progress: Progress | None = None) -> MergedStats:
        """The layer-swapped model (as `export_merge` writes it) against base and both experts; where each
        tensor comes from is the planner's answer (`layerswap.recipe.sources`), reverted layers included."""
        src = Sources(plan, self.num_layers, self.arch).of(t.name for t in self.tensors)
        sources = tuple(src[t.name] for t in self.tensors)
        if sources not in self._merged:
            self._merged[sources] = merged_stats(self, plan, list(sources), math, lang, base, device, progress)
        ms = self._merged[sources]
        ms.plan = plan
        return ms

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        return store.save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Analysis":
        return cls(**store.read(path))


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


