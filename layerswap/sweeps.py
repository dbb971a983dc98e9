"""Sweeps: run many merge recipes through one loaded pair of experts, evaluate each, tabulate.

    wb = Workbench(); wb.load("math/", "lang/", base="base/")
    points = swap_grid(wb.num_layers, b=range(0, 4), u=range(0, 3), t=(0, 1))
    result = run_sweep(wb, points, EvalConfig(langs=["sw"], limit=100, source="mgsm/"))
    print(result.table_text()); result.best().name

Each recipe is merged in memory (or refreshed into the serving vLLM engine) with the experts
loaded once, so a grid costs one merge and one evaluation per point. The experts themselves
are evaluated once as reference rows. `ablation_suite` builds the ablations reviewers asked for
(transition zone on/off and its weighting, middle / random / alternating / one-sided swaps,
attention- or MLP-only swaps, and the soup / TIES / task-arithmetic / DARE baselines).

Picking the best of many points on one test set is optimistic: report it as such, or select on
held-out questions (`EvalConfig.limit` / a separate split) and report on the rest.
"""

from __future__ import annotations

import csv
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .errors import UserError
from .evaluation import EvalConfig, EvalReport
from .methods import MethodConfig
from .plans import Plan, default_plan
from .recipes import Recipe
from .roles import EXPERTS, ROLE_NAMES
from .runtime import Progress, no_progress


@dataclass(frozen=True)
class SweepPoint:
    name: str
    recipe: Recipe

    def to_dict(self) -> dict:
        return {"name": self.name, **self.recipe.to_dict()}


def swap_grid(num_layers: int, b: Iterable[int], u: Iterable[int], t: Iterable[int] = (0, 1),
              transition: str = "flat", non_layer: str = "neighbour") -> list[SweepPoint]:
    """(b, u, tb = tu = t) swap plans that fit `num_layers`; (0, 0, 0) is the math expert itself."""
    points = []
    for bb in b:
        for uu in u:
            for tt in t:
                p = Plan(b=bb, u=uu, tb=tt, tu=tt, transition=transition, non_layer=non_layer)
                if bb + uu + 2 * tt <= num_layers and not (bb == uu == 0 and tt > 0):
                    points.append(SweepPoint(f"swap b={bb} u={uu} t={tt}", Recipe(plan=p)))
    if not points:
        raise UserError(f"No (b, u, t) in the grid fits the model's {num_layers} layers.")
    return points


def ablation_suite(num_layers: int, plan: Plan | None = None, seeds: Iterable[int] = (0, 1, 2),
                   with_base: bool = True) -> list[SweepPoint]:
    """The reviewers' ablations around `plan` (default: `default_plan`), plus the baselines."""
    p = plan or default_plan(num_layers)
    p.validate(num_layers)
    k = p.b + p.u  # swap as many layers elsewhere as the plan swaps at the ends
    pts = [
        SweepPoint(f"plan ({p.title()})", Recipe(plan=p)),
        SweepPoint("no transition zone", Recipe(plan=p.with_(tb=0, tu=0))),
        SweepPoint("transition: ramp", Recipe(plan=p.with_(transition="ramp"))),
        SweepPoint("transition: math only", Recipe(plan=p.with_(transition_weight=0.0))),
        SweepPoint("transition: language only", Recipe(plan=p.with_(transition_weight=1.0))),
        SweepPoint("bottom only", Recipe(plan=p.with_(u=0, tu=0))),
        SweepPoint("top only", Recipe(plan=p.with_(b=0, tb=0))),
        SweepPoint("attention only", Recipe(plan=p.with_(modules="attention"))),
        SweepPoint("MLP only", Recipe(plan=p.with_(modules="mlp"))),
        SweepPoint(f"middle {k} layers", Recipe(plan=Plan(kind="middle", k=k, non_layer="math"))),
        SweepPoint("inverse (language middle, math outer)",
                   Recipe(plan=Plan(kind="middle", k=num_layers - k, non_layer="math"))),
        SweepPoint("alternating", Recipe(plan=Plan(kind="alternating", non_layer="math"))),
    ]
    pts += [SweepPoint(f"random {k} layers, seed {s}", Recipe(plan=Plan(kind="random", k=k, seed=s, non_layer="math")))
            for s in seeds]
    pts.append(SweepPoint("soup 50/50", Recipe(MethodConfig("soup", weight=0.5))))
    if with_base:
        pts += [SweepPoint("task arithmetic", Recipe(MethodConfig("task_arithmetic"))),
                SweepPoint("TIES (density 0.2)", Recipe(MethodConfig("ties", density=0.2))),
                SweepPoint("DARE-TIES (drop 0.9)", Recipe(MethodConfig("dare_ties", drop_rate=0.9)))]
    return [pt for pt in pts if _fits(pt, num_layers)]


def _fits(pt: SweepPoint, num_layers: int) -> bool:
    try:
        pt.recipe.validate(num_layers)
        return True
    except UserError:
        return False


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

    def write_csv(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["recipe", "kind", "metric", *self.config.langs, "mean", "n", "layer_weights"])
            for r in self.rows:
                for metric in ("flexible", "strict"):
                    w.writerow([r.name, r.kind, metric, *(r.accuracy[metric].get(lang, "") for lang in self.config.langs),
                                r.mean(metric), sum(r.n.values()),
                                "" if r.layer_weights is None else " ".join(f"{x:g}" for x in r.layer_weights)])
        return path


def _row(name: str, kind: str, recipe: dict, report: EvalReport, model: str, lw=None) -> SweepRow:
    acc = {m: {lang: report.accuracy(model, lang, m) or 0.0 for lang in report.config.langs}
           for m in ("flexible", "strict")}
    n = {lang: report.counts(model, lang) for lang in report.config.langs}
    return SweepRow(name, kind, recipe, acc, n, lw, report)


def run_sweep(wb, points: list[SweepPoint], config: EvalConfig, *, include_experts: bool = True,
              progress: Progress | None = None, cancel: threading.Event | None = None) -> SweepResult:
    """Merge and evaluate every point with the workbench's loaded experts."""
    config.validate()
    p = progress or no_progress
    result = SweepResult(config)
    steps = len(points) + (2 if include_experts else 0)
    step = 0

    def sub(f: float, d: str) -> None:
        p((step + f) / steps, d)

    if include_experts:
        rep = wb.evaluate(config, roles=EXPERTS, progress=lambda f, d: p(2 * f / steps, d), cancel=cancel)
        for role in EXPERTS:
            result.rows.append(_row(ROLE_NAMES[role], "expert", {"model": role}, rep, ROLE_NAMES[role]))
        step = 2
        if rep.cancelled:
            result.cancelled = True
            return result
    for pt in points:
        if cancel is not None and cancel.is_set():
            result.cancelled = True
            break
        sub(0.0, f"merging: {pt.name}")
        lw = wb.build(pt.recipe)
        rep = wb.evaluate(config, roles=("merged",), progress=lambda f, d, n=pt.name: sub(f, f"{n}: {d}"),
                          cancel=cancel)
        result.rows.append(_row(pt.name, "merge", pt.to_dict(), rep, ROLE_NAMES["merged"], lw))
        step += 1
        if rep.cancelled:
            result.cancelled = True
            break
    p(1.0, "cancelled" if result.cancelled else "done")
    return result


def sweep_figure(result: SweepResult, metric: str = "flexible", lang: str | None = None):
    """Horizontal bars: every recipe's accuracy (on `lang`, or the mean), experts marked as lines."""
    import plotly.graph_objects as go

    rows = result.rows
    label = lang or "mean over languages"
    vals = [100 * (r.accuracy[metric][lang] if lang else r.mean(metric)) for r in rows]
    colors = ["#7f7f7f" if r.kind == "expert" else "#d95f02" for r in rows]
    fig = go.Figure(go.Bar(x=vals, y=[r.name for r in rows], orientation="h", marker_color=colors,
                           hovertemplate="%{y}: %{x:.1f}%<extra></extra>"))
    for r in rows:
        if r.kind == "expert":
            x = 100 * (r.accuracy[metric][lang] if lang else r.mean(metric))
            fig.add_vline(x=x, line_dash="dot", line_color="#555", annotation_text=r.name)
    fig.update_layout(height=120 + 22 * len(rows), xaxis_title=f"MGSM accuracy % ({metric}, {label})",
                      yaxis={"autorange": "reversed"}, margin={"l": 260, "r": 30, "t": 40, "b": 50})
    return fig
