"""Sweeps in memory: every point merged and evaluated with a workbench's loaded experts (`loop.measure`, as every
sweep and search evaluates), nothing on disk (`evaluate_points`), with the per-question reports kept, for scripts.

Picking the best of many points on one test set is optimistic: report it as such, or select on
held-out questions (`EvalConfig.limit` / a separate split) and report on the rest.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from layerswap.core.errors import UserError
from layerswap.evaluation import mgsm
from layerswap.evaluation.run import EvalConfig, EvalReport
from layerswap.core.roles import EXPERTS
from layerswap.core.runtime import Progress, no_progress
from layerswap.sweeps import loop
from layerswap.sweeps.spec import SweepPoint


@dataclass
class SweepRow:
    name: str
    kind: str  # "expert" or "merge"
    recipe: dict
    accuracy: dict[str, dict[str, float]]  # metric -> lang -> accuracy (0..1)
    n: dict[str, int]
    layer_weights: list[float] | None = None
    report: EvalReport | None = field(default=None, repr=False)  # per-question outputs of this row

    def mean(self, metric: str = "flexible") -> float:
        vals = list(self.accuracy[metric].values())
        return sum(vals) / len(vals) if vals else float("nan")


@dataclass
class SweepResult:
    config: EvalConfig
    rows: list[SweepRow] = field(default_factory=list)
    cancelled: bool = False

    def merges(self) -> list[SweepRow]:
        return [r for r in self.rows if r.kind == "merge"]

    def best(self, metric: str = "flexible", lang: str | None = None) -> SweepRow:
        """The merge with the highest accuracy (mean over languages, or on `lang`). Optimistic."""
        merges = self.merges()
        if not merges:
            raise UserError("The sweep holds no merges yet.")
        return max(merges, key=lambda r: r.accuracy[metric][lang] if lang else r.mean(metric))

    def table(self, metric: str = "flexible") -> list[dict]:
        out = []
        for r in self.rows:
            row = {"recipe": r.name, "kind": r.kind}
            row.update({lang: round(100 * a, 1) for lang, a in r.accuracy[metric].items()})
            row["mean"] = round(100 * r.mean(metric), 1)
            row["n"] = sum(r.n.values())
            out.append(row)
        return out

    def table_text(self, metric: str = "flexible") -> str:
        rows = self.table(metric)
        head = ["recipe", *self.config.langs, "mean", "n"]
        lines = [" | ".join(head), " | ".join("---" for _ in head)]
        for r in rows:
            lines.append(" | ".join(str(r.get(h, "–")) for h in head))
        n = self.rows[0].n if self.rows else {}
        lines.append(f"(accuracy %, {metric} extraction; one standard error at 50% is "
                     + ", ".join(f"{lang} ±{50 / math.sqrt(max(c, 1)):.1f}" for lang, c in n.items()) + ")")
        return "\n".join(lines)


def _row(name: str, kind: str, recipe: dict, report: EvalReport, model: str, lw=None) -> SweepRow:
    acc = {m: {lang: report.accuracy(model, lang, m) or 0.0 for lang in report.config.langs}
           for m in mgsm.TASK.metric_names}
    n = {lang: report.counts(model, lang) for lang in report.config.langs}
    return SweepRow(name, kind, recipe, acc, n, lw, report)


def evaluate_points(wb, points: list[SweepPoint], config: EvalConfig, *, include_experts: bool = True,
                    progress: Progress | None = None, cancel: threading.Event | None = None) -> SweepResult:
    """Merge and evaluate every point with the workbench's loaded experts, in memory (nothing on disk)."""
    config.validate()
    p = progress or no_progress
    result = SweepResult(config)
    steps = len(points) + (2 if include_experts else 0)
    step = 0

    def sub(f: float, d: str) -> None:
        p((step + f) / steps, d)

    for role in EXPERTS if include_experts else ():
        m = loop.measure(wb, role, config, progress=sub, cancel=cancel)
        result.rows.append(_row(m.model, "expert", {"model": role}, m.report, m.model))
        step += 1
        if m.cancelled:
            result.cancelled = True
            return result
    for pt in points:
        if cancel is not None and cancel.is_set():
            result.cancelled = True
            break
        m = loop.measure(wb, pt.recipe, config, progress=lambda f, d, n=pt.name: sub(f, f"{n}: {d}"), cancel=cancel)
        result.rows.append(_row(pt.name, "merge", pt.to_dict(), m.report, m.model, m.layer_weights))
        step += 1
        if m.cancelled:
            result.cancelled = True
            break
    p(1.0, "cancelled" if result.cancelled else "done")
    return result
