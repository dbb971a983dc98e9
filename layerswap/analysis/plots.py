"""Plotly figures: the analysis heatmaps and profile, the layer-source strip and the MGSM accuracy bars (of a pair
and of a family)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from layerswap.analysis import METRICS, PANEL_METRICS, PANELS, Analysis, MergedStats, format_value
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.recipe.sources import BASE_LABEL, Sources

LANG_COLOR = "#d95f02"
MATH_COLOR = "#1b9e77"
BASE_COLOR = "#386cb0"  # layers reverted to the base model


def _z(values: np.ndarray) -> list[list[float | None]]:
    """Plain lists (NaN as null): readable in any plotly.js and by API clients."""
    return [[None if np.isnan(v) else float(v) for v in row] for row in np.asarray(values, dtype=float)]


def layer_strip(recipe: Recipe | Plan | Sources, num_layers: int, height: int = 190) -> go.Figure:
    """One cell per layer coloured from math expert (green) to language expert (orange), as the planner
    (`layerswap.recipe.sources`; given, or made for `recipe`) says; layers taken from the base model in blue, marked B.
    Methods without a layer map touch every layer alike (shown mid-scale)."""
    src = recipe if isinstance(recipe, Sources) else Sources(recipe, num_layers)
    return layer_strips({"source": src}, num_layers, height)


def layer_strips(rows: dict[str, Sources], num_layers: int, height: int | None = None) -> go.Figure:
    """`layer_strip` with one row per entry of `rows` (label -> planner), top to bottom: a family's plan per
    language. One row hides its label."""
    labels = list(rows)[::-1]  # the heatmap's first row is drawn at the bottom
    layers = {k: rows[k].layers() for k in labels}
    x = list(range(num_layers))
    fig = go.Figure(
        go.Heatmap(
            z=[[None if s.from_base else 0.5 if s.w_lang is None else s.w_lang for s in layers[k]] for k in labels],
            x=x,
            y=labels,
            zmin=0,
            zmax=1,
            customdata=[[s.label(rows[k].method_title) for s in layers[k]] for k in labels],
            colorscale=[[0, MATH_COLOR], [1, LANG_COLOR]],
            colorbar={"title": {"text": "w lang"}, "tickvals": [0, 0.5, 1], "ticktext": ["math", "blend", "lang"]},
            hovertemplate="%{y}, layer %{x}: %{customdata} (w=%{z:.2f})<extra></extra>",
            xgap=2,
            ygap=4,
            text=[["" if s.w_lang is None else "L" if s.w_lang == 1 else "M" if s.w_lang == 0 else f"{s.w_lang:.2f}"
                   for s in layers[k]] for k in labels],
            texttemplate="%{text}",
        )
    )
    if any(rows[k].reverted for k in labels):
        fig.add_trace(go.Heatmap(
            z=[[1.0 if s.from_base else None for s in layers[k]] for k in labels], x=x,
            y=labels, colorscale=[[0, BASE_COLOR], [1, BASE_COLOR]], showscale=False, xgap=2, ygap=4,
            text=[["B" if s.from_base else "" for s in layers[k]] for k in labels], texttemplate="%{text}",
            hovertemplate=f"%{{y}}, layer %{{x}}: {BASE_LABEL}<extra></extra>", name="base"))
    fig.update_layout(
        xaxis={"title": "layer", "dtick": 1 if num_layers <= 40 else 4},
        yaxis={"showticklabels": len(labels) > 1, "type": "category"},
        height=height or 140 + 50 * len(labels),
        margin={"l": 30 if len(labels) == 1 else 50, "r": 20, "t": 20, "b": 50},
    )
    return fig


def save_figure(fig: go.Figure, out: str | os.PathLike) -> Path:
    """Write ``.html`` (self-contained, offline) or ``.png`` (needs Chrome/Chromium via kaleido)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = out.suffix.lower()
    if suffix in (".html", ".htm"):
        fig.write_html(out, include_plotlyjs=True)
    elif suffix in (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp"):
        try:
            fig.write_image(out, scale=2)
        except Exception as e:
            raise UserError(
                f"Could not render {out.name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                "Image export uses kaleido, which needs Chrome or Chromium installed; write .html instead, "
                "or install chromium."
            ) from None
    else:
        raise UserError(f"Unknown figure format {suffix!r}; use .html or .png.")
    return out


MODEL_COLORS = {"math expert": MATH_COLOR, "language expert": LANG_COLOR, "merged model": "#7570b3"}


def eval_bars(report, metric: str = "flexible", height: int = 380) -> go.Figure:
    """MGSM accuracy per language (and the average): an `evaluation.EvalReport`.

    With the merged model present, it gets the bars and the two experts are drawn as reference
    marks on each language (what the merge has to beat); otherwise one bar per model.
    """
    rows = [r for r in report.table(metric) if r["language"] != "max"]
    x = [r["language"] for r in rows]
    experts = {"math expert", "language expert"}
    reference = set(report.models) & experts if any(m not in experts for m in report.models) else set()
    fig = go.Figure()
    for m in report.models:
        hover = f"{m}<br>%{{x}}: %{{y:.1f}}%<extra></extra>"
        if m in reference:
            fig.add_trace(go.Scatter(name=f"{m} (reference)", x=x, y=[r[m] for r in rows], mode="markers",
                                     marker={"symbol": "line-ew-open", "size": 44, "color": MODEL_COLORS.get(m),
                                             "line": {"width": 3, "color": MODEL_COLORS.get(m)}},
                                     hovertemplate=hover))
        else:
            fig.add_trace(go.Bar(name=m, x=x, y=[r[m] for r in rows], marker_color=MODEL_COLORS.get(m),
                                 hovertemplate=hover))
    fig.update_layout(barmode="group", height=height, yaxis={"title": {"text": f"accuracy (%), {metric}"},
                                                             "range": [0, 100]},
                      title=f"MGSM {report.config.mode}, {report.config.shots}-shot"
                            + (" (cancelled: partial)" if report.cancelled else ""),
                      margin={"l": 60, "r": 20, "t": 50, "b": 40}, legend={"orientation": "h"})
    return fig


def family_bars(table, title: str = "MGSM", height: int = 400) -> go.Figure:
    """A family's table (`evaluation.table.FamilyTable`): per language (and the average), a bar per model with its
    exact 95 % interval as error bars; cells not evaluated yet are left out."""
    x = [*table.languages, "average"]
    fig = go.Figure()
    for m in table.models:
        cells = [table.cell(m, lang) for lang in table.languages]
        avg = table.average(m)
        y = [None if c is None else 100 * c.accuracy for c in cells] + [None if avg is None else 100 * avg]
        up = [None if c is None else 100 * (c.high - c.accuracy) for c in cells] + [None]
        down = [None if c is None else 100 * (c.accuracy - c.low) for c in cells] + [None]
        fig.add_trace(go.Bar(name=m, x=x, y=y, marker_color=MODEL_COLORS.get(m),
                             error_y={"type": "data", "array": up, "arrayminus": down, "visible": True},
                             hovertemplate=f"{m}<br>%{{x}}: %{{y:.1f}}%<extra></extra>"))
    fig.update_layout(barmode="group", height=height, title=title,
                      yaxis={"title": {"text": f"accuracy (%), {table.metric}"}, "range": [0, 100]},
                      margin={"l": 60, "r": 20, "t": 50, "b": 40}, legend={"orientation": "h"})
    return fig


# ---- the analysis heatmaps --------------------------------------------------------------------------

NORMS = {"raw": "raw values", "row": "per row (each parameter type scaled to its maximum)", "log": "log10"}
MERGED_COLOR = "#444444"
CHANGE_SCALE = "Viridis"
OVERLAP_SCALE = "RdBu_r"


def panel_metric(panel: str, metric: str, overlap_metric: str) -> str:
    """The metric a panel shows: the overlap panel has its own; vs-expert panels fall back to relative."""
    if panel == "overlap":
        return overlap_metric
    return metric if metric in PANEL_METRICS[panel] else "relative"


def _hover(an: Analysis, k: float | None, merged: MergedStats | None) -> list[str]:
    """One hover text per tensor: name, shape and every metric."""
    rows = an.rows(k, merged)
    kk = an.topk_at(k).k if an.topk else None
    out = []
    for r in rows:
        lines = [f"<b>{r['tensor']}</b>", f"shape {r['shape'].replace('x', '×')} · {r['numel']:,} entries"]
        for role, name in (("math", "math"), ("lang", "language")):
            t = f" · top-{kk:g}% share {format_value('topk', r.get(f'topk_share_{role}'))}" if kk is not None else ""
            lines.append(f"{name} vs base: rel {format_value('relative', r[f'relative_{role}'])} · "
                         f"mean|Δ| {format_value('mean_abs', r[f'mean_abs_{role}'])}{t}")
        ov = f"overlap: cosine {format_value('cosine', r['cosine'])}"
        if kk is not None:
            ov += f" · top-{kk:g}% Jaccard {format_value('jaccard', r.get('topk_jaccard'))}"
        lines.append(ov)
        lines.append(f"math vs language: rel {format_value('relative', r['relative_math_vs_lang'])}")
        if merged is not None:
            t = f" · top-{kk:g}% share ≈{format_value('topk', r.get('topk_share_merged'))}" if kk is not None else ""
            src = f"w_lang {r['w_lang']:.3g}" if r["w_lang"] is not None else r["merged_source"]
            lines.append(f"merged ({src}) vs base: "
                         f"rel {format_value('relative', r['relative_merged'])}{t}")
            lines.append(f"merged vs math: rel {format_value('relative', r['relative_merged_vs_math'])} · "
                         f"vs language: rel {format_value('relative', r['relative_merged_vs_lang'])}")
        out.append("<br>".join(lines))
    return out


def normalise(grids: dict[str, np.ndarray], norm: str) -> tuple[dict[str, np.ndarray], str]:
    """Apply a normalisation jointly to panels that share a scale; returns the grids and a unit note.

    row: each row divided by its largest absolute value over all these panels (so panels stay
    comparable); log: log10, with zeros shown at the smallest positive value present.
    """
    if norm not in NORMS:
        raise UserError(f"normalisation must be one of {', '.join(NORMS)} (got {norm!r}).")
    if norm == "raw" or not grids:
        return grids, ""
    stack = np.stack(list(grids.values()))
    if norm == "row":
        with np.errstate(all="ignore"):
            m = np.nanmax(np.abs(stack), axis=(0, 2))
        m = np.where(np.isfinite(m) & (m > 0), m, 1.0)
        return {p: g / m[:, None] for p, g in grids.items()}, "÷ row max"
    pos = stack[np.isfinite(stack) & (stack > 0)]
    floor = float(pos.min()) if pos.size else 1e-12
    with np.errstate(all="ignore"):
        return {p: np.where(np.isfinite(g), np.log10(np.maximum(g, floor)), np.nan) for p, g in grids.items()}, "log10"


def plan_cell_weights(an: Analysis, plan: Plan) -> np.ndarray:
    """w_lang per (parameter type, layer) cell, from the planner (per-module plans included); NaN for cells
    taken from the base (neither expert: the overlay draws them on their own)."""
    src = Sources(plan, an.num_layers, an.arch)
    return np.asarray([[np.nan if (w := src.source(layer, p).w_lang) is None else w
                        for layer in range(an.num_layers)] for p in an.ptypes])


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((start, i - 1))
            start = None
    return runs


def add_plan_overlay(fig: go.Figure, an: Analysis, plan: Plan, row: int, labels: list[str]) -> None:
    """Outline the cells taken from the language expert; shade the blended (transition) cells; hatch
    (dashed blue outline, blue tint) the layers reverted to the base model."""
    for a, b in _runs([s.from_base for s in Sources(plan, an.num_layers, an.arch).layers()]):
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, row=row, col=1, layer="above", fillcolor="rgba(56,108,176,0.25)",
                      line={"color": BASE_COLOR, "width": 2.5, "dash": "dash"})
    w = plan_cell_weights(an, plan)
    line = {"color": LANG_COLOR, "width": 2.5}
    shade = {"fillcolor": "rgba(120,120,120,0.30)", "line": {"width": 0}}
    if ((w == w[:1]) | np.isnan(w)).all():  # whole columns: one rectangle per run, full height
        col = w[0].tolist()
        for a, b in _runs([x == 1.0 for x in col]):
            fig.add_vrect(x0=a - 0.5, x1=b + 0.5, row=row, col=1, line=line, fillcolor="rgba(0,0,0,0)", layer="above")
        for a, b in _runs([0.0 < x < 1.0 for x in col]):
            fig.add_vrect(x0=a - 0.5, x1=b + 0.5, row=row, col=1, layer="above", **shade)
        return
    for r, lab in enumerate(labels):  # per-module plans: per row
        for a, b in _runs([x == 1.0 for x in w[r].tolist()]):
            fig.add_shape(type="rect", x0=a - 0.5, x1=b + 0.5, y0=r - 0.5, y1=r + 0.5, row=row, col=1, line=line,
                          layer="above")
        for a, b in _runs([0.0 < x < 1.0 for x in w[r].tolist()]):
            fig.add_shape(type="rect", x0=a - 0.5, x1=b + 0.5, y0=r - 0.5, y1=r + 0.5, row=row, col=1,
                          layer="above", **shade)


def analysis_heatmaps(an: Analysis, panels: Sequence[str] = ("math", "lang", "overlap"), *, metric: str = "relative",
                      overlap_metric: str = "cosine", k: float | None = None, norm: str = "raw",
                      merged: MergedStats | None = None, plan: Plan | None = None,
                      row_height: int = 24) -> go.Figure:
    """Rows: parameter types; columns: layers; one panel per comparison, change panels on one scale.

    `plan` outlines the swapped cells and shades the transition cells on every panel.
    """
    from plotly.subplots import make_subplots

    panels = [p for p in panels if p]
    if not panels:
        raise UserError("Choose at least one panel.")
    for p in panels:
        if p not in PANELS:
            raise UserError(f"Unknown panel {p!r}; choose from {', '.join(PANELS)}.")
        if p.startswith("merged") and merged is None:
            raise UserError("The merged-model panels need a plan (and the merged statistics computed for it).")
    if overlap_metric not in PANEL_METRICS["overlap"]:
        raise UserError(f"The overlap panel shows cosine or jaccard, not {overlap_metric!r}.")
    metrics = {p: panel_metric(p, metric, overlap_metric) for p in panels}
    raw = {p: an.grid(an.values(p, metrics[p], k, merged)) for p in panels}
    change = [p for p in panels if p != "overlap"]
    by_metric: dict[str, list[str]] = {}
    for p in change:
        by_metric.setdefault(metrics[p], []).append(p)
    shown: dict[str, np.ndarray] = {}
    unit: dict[str, str] = {}
    for m, ps in by_metric.items():
        g, note = normalise({p: raw[p] for p in ps}, norm)
        shown.update(g)
        unit.update({p: note for p in ps})
    if "overlap" in panels:
        if metrics["overlap"] == "cosine":  # signed: always raw, symmetric around 0
            shown["overlap"], unit["overlap"] = raw["overlap"], ""
        else:
            g, note = normalise({"overlap": raw["overlap"]}, norm)
            shown["overlap"], unit["overlap"] = g["overlap"], note
    hover = _hover(an, k, merged)
    idx = an.cell_index()
    custom = [[hover[i] if i >= 0 else "" for i in row] for row in idx]
    labels = an.row_labels
    kk = an.topk_at(k).k if (an.topk and any(m in ("topk", "jaccard") for m in metrics.values())) else None
    titles = []
    for p in panels:
        mt = METRICS[metrics[p]].replace("top-k%", f"top-{kk:g}%") if kk is not None else METRICS[metrics[p]]
        approx = " (merged top-k%: located on histograms, see hover)" if p == "merged" and metrics[p] == "topk" else ""
        titles.append(f"{PANELS[p]}: {mt}{approx}" + (f" · {unit[p]}" if unit[p] else "") + _undefined(p, metrics[p],
                                                                                                     shown[p], idx))
    n = len(panels)
    spacing = 0.35 / n if n > 1 else 0.0
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=min(spacing, 0.12), subplot_titles=titles)
    # one colour scale per metric among the change panels, and the overlap's own
    scales: dict[str, tuple[float, float]] = {}
    for p in panels:
        key = "overlap" if p == "overlap" else metrics[p]
        z = shown[p][np.isfinite(shown[p])]
        lo, hi = (float(z.min()), float(z.max())) if z.size else (0.0, 1.0)
        if key in scales:
            lo, hi = min(lo, scales[key][0]), max(hi, scales[key][1])
        scales[key] = (lo, hi)
    first_of: dict[str, int] = {}
    for i, p in enumerate(panels, 1):
        key = "overlap" if p == "overlap" else metrics[p]
        lo, hi = scales[key]
        if p == "overlap" and metrics[p] == "cosine":
            a = max(abs(lo), abs(hi), 1e-12)
            lo, hi = -a, a
        elif norm != "log":
            lo = min(lo, 0.0)
        show = key not in first_of
        first_of.setdefault(key, i)
        dom = fig.layout[f"yaxis{'' if i == 1 else i}"].domain
        fmt = ".2%" if metrics[p] in ("relative", "topk", "jaccard") and norm == "raw" else ".3g"
        fig.add_trace(
            go.Heatmap(
                z=_z(shown[p]), x=list(range(an.num_layers)), y=labels, customdata=custom,
                zmin=lo, zmax=hi if hi > lo else lo + (1.0 if fmt == ".2%" else 1e-12),  # one value: a readable scale
                colorscale=OVERLAP_SCALE if p == "overlap" and metrics[p] == "cosine" else CHANGE_SCALE,
                showscale=show, xgap=1, ygap=1,
                colorbar={"title": {"text": METRICS[metrics[p]].split(" ")[0] + (f" ({unit[p]})" if unit[p] else ""),
                                    "side": "right"}, "tickformat": fmt,
                          "y": (dom[0] + dom[1]) / 2, "len": max(dom[1] - dom[0], 0.15), "thickness": 14},
                hovertemplate=f"<b>{PANELS[p]}</b> · layer %{{x}} · %{{y}}<br>%{{customdata}}<extra></extra>",
                name=PANELS[p],
            ),
            row=i, col=1,
        )
        # every row labelled, also where no cell has a value (the grey of an undefined cell is the plot's own)
        fig.update_yaxes(type="category", categoryorder="array", categoryarray=labels, range=[len(labels) - 0.5, -0.5],
                         row=i, col=1)
        if plan is not None:
            add_plan_overlay(fig, an, plan, i, labels)
    fig.update_xaxes(title_text="layer", dtick=1 if an.num_layers <= 40 else 4, row=n, col=1)
    panel_h = row_height * len(labels) + 70
    title = "Where each expert changed"
    if plan is not None:
        title += (f"<br><sup>plan {plan.title().removeprefix('swap ')}</sup><br><sup>outlined = taken from the language "
                  "expert, shaded = blended transition" + (", dashed blue = reverted to the base" if plan.revert else "")
                  + "</sup>")
    fig.update_layout(height=panel_h * n + 150, margin={"l": 90, "r": 30, "t": 130, "b": 50}, title=title,
                      plot_bgcolor=UNDEFINED_COLOR)
    return fig


UNDEFINED_COLOR = "rgb(215,215,215)"  # a cell with no value: the plot area shows through


def _undefined(panel: str, metric: str, values: np.ndarray, idx: np.ndarray) -> str:
    """The panel title's note on cells with no value (tensors that exist, with a NaN): why they are grey."""
    undefined = (idx >= 0) & ~np.isfinite(values)
    if not undefined.any():
        return ""
    why = {"cosine": "one expert left the tensor unchanged, so the cosine of the two changes is undefined",
           "jaccard": "neither expert has an entry of the tensor among its top-k%, so there is no set to compare"
           }.get(metric, "no value")
    if undefined.sum() == (idx >= 0).sum():
        return f"<br>every cell grey: {why}" + (" (the experts changed no tensor in common)" if metric == "cosine" else "")
    return f"<br>grey: {why}"


def layer_profile(an: Analysis, metric: str = "relative", k: float | None = None, merged: MergedStats | None = None,
                  plan: Plan | None = None, norm: str = "raw", height: int = 340) -> go.Figure:
    """Per layer: how much each expert (and the merged model) changed, all parameter types together."""
    if metric not in ("relative", "mean_abs", "topk"):
        raise UserError(f"The layer profile shows relative, mean_abs or topk, not {metric!r}.")
    x = list(range(an.num_layers))
    fig = go.Figure()
    series = [("math", "math expert", MATH_COLOR, "solid"), ("lang", "language expert", LANG_COLOR, "solid")]
    if merged is not None:
        series.append(("merged", "merged model", MERGED_COLOR, "dash"))
    for panel, name, color, dash in series:
        y = an.layer_profile(panel, metric, k, merged)
        fig.add_trace(go.Scatter(x=x, y=[None if not np.isfinite(v) else float(v) for v in y], name=name,
                                 mode="lines+markers", line={"color": color, "dash": dash, "width": 2.5},
                                 hovertemplate=f"{name} · layer %{{x}}: %{{y:.4g}}<extra></extra>"))
    if plan is not None:
        layers = Sources(plan, an.num_layers, an.arch).layers()
        for a, b in _runs([s.w_lang == 1.0 for s in layers]):
            fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor=LANG_COLOR, opacity=0.10, line_width=0)
        for a, b in _runs([s.kind == "blend" for s in layers]):
            fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor="rgb(120,120,120)", opacity=0.18, line_width=0)
        for a, b in _runs([s.from_base for s in layers]):
            fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor=BASE_COLOR, opacity=0.18, line_width=0)
    kk = an.topk_at(k).k if metric == "topk" else None
    label = METRICS[metric].replace("top-k%", f"top-{kk:g}%") if kk is not None else METRICS[metric]
    fig.update_layout(
        title=f"Change by depth: {label}" + ("<br><sup>orange band: layers from the language expert; grey: "
                                               "blended</sup>" if plan is not None else ""),
        xaxis={"title": "layer", "dtick": 1 if an.num_layers <= 40 else 4, "range": [-0.5, an.num_layers - 0.5]},
        yaxis={"title": label, "type": "log" if norm == "log" else "linear",
               "tickformat": ".2%" if metric in ("relative", "topk") and norm != "log" else None},
        height=height, margin={"l": 70, "r": 20, "t": 70, "b": 50}, legend={"orientation": "h", "y": -0.25},
    )
    return fig
