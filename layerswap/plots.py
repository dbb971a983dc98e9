"""Plotly figures: the diff heatmap and the layer-source strip."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from .analysis import METRICS, DiffResult
from .errors import UserError
from .plans import source_label

LANG_COLOR = "#d95f02"
MATH_COLOR = "#1b9e77"


def _z(values: np.ndarray) -> list[list[float | None]]:
    """Plain lists (NaN as null): readable in any plotly.js and by API clients."""
    return [[None if np.isnan(v) else float(v) for v in row] for row in np.asarray(values, dtype=float)]


def diff_heatmap(diff: DiffResult, title: str | None = None, height: int = 380) -> go.Figure:
    """Rows: parameter types; columns: layers; hover: tensor name and value."""
    z = _z(diff.values)
    text = [[n or "" for n in row] for row in diff.names]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(diff.num_layers)),
            y=diff.row_labels,
            customdata=text,
            colorscale="Viridis",
            colorbar={"title": {"text": "rel. change"}},
            hovertemplate="layer %{x} · %{y}<br>%{customdata}<br>value %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title or f"{METRICS[diff.metric]}<br><sup>{diff.expert} vs {diff.base}</sup>",
        xaxis={"title": "layer", "dtick": 1 if diff.num_layers <= 40 else 4},
        yaxis={"title": "parameter type", "autorange": "reversed"},
        height=height,
        margin={"l": 80, "r": 20, "t": 70, "b": 50},
    )
    return fig


def layer_strip(layer_weights: list[float], height: int = 190) -> go.Figure:
    """One cell per layer coloured from math expert (green) to language expert (orange)."""
    w = [[float(x) for x in layer_weights]]
    labels = [[source_label(x) for x in layer_weights]]
    fig = go.Figure(
        go.Heatmap(
            z=w,
            x=list(range(len(layer_weights))),
            y=["source"],
            zmin=0,
            zmax=1,
            customdata=labels,
            colorscale=[[0, MATH_COLOR], [1, LANG_COLOR]],
            colorbar={"title": {"text": "w lang"}, "tickvals": [0, 0.5, 1], "ticktext": ["math", "blend", "lang"]},
            hovertemplate="layer %{x}: %{customdata} (w=%{z:.2f})<extra></extra>",
            xgap=2,
            text=[["L" if x == 1 else "M" if x == 0 else f"{x:.2f}" for x in layer_weights]],
            texttemplate="%{text}",
        )
    )
    fig.update_layout(
        xaxis={"title": "layer", "dtick": 1 if len(layer_weights) <= 40 else 4},
        yaxis={"showticklabels": False},
        height=height,
        margin={"l": 30, "r": 20, "t": 20, "b": 50},
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


def combined_diff_figure(diffs: list[DiffResult], labels: list[str], layer_weights: list[float] | None = None,
                         height_per_panel: int = 300) -> go.Figure:
    """Stacked heatmaps (one per expert) on one shared colour scale, so magnitudes compare."""
    from plotly.subplots import make_subplots

    zmax = float(np.nanmax([np.nanmax(d.values) for d in diffs])) if diffs else 1.0
    fig = make_subplots(rows=len(diffs), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[f"{lab} vs base" for lab in labels])
    for i, d in enumerate(diffs):
        fig.add_trace(
            go.Heatmap(
                z=_z(d.values), x=list(range(d.num_layers)), y=d.row_labels,
                customdata=[[n or "" for n in row] for row in d.names],
                zmin=0, zmax=zmax, colorscale="Viridis", showscale=(i == 0),
                colorbar={"title": {"text": "rel. change"}},
                hovertemplate=f"{labels[i]}<br>layer %{{x}} · %{{y}}<br>%{{customdata}}<br>value %{{z:.4g}}<extra></extra>",
            ),
            row=i + 1, col=1,
        )
        fig.update_yaxes(autorange="reversed", row=i + 1, col=1)
    fig.update_xaxes(title_text="layer", dtick=1 if diffs and diffs[0].num_layers <= 40 else 4, row=len(diffs), col=1)
    fig.update_layout(height=height_per_panel * len(diffs) + 60, margin={"l": 80, "r": 20, "t": 50, "b": 50},
                      title=METRICS[diffs[0].metric] if diffs else "")
    return fig


MODEL_COLORS = {"math expert": MATH_COLOR, "language expert": LANG_COLOR, "merged model": "#7570b3"}


def eval_bars(report, metric: str = "flexible", height: int = 380) -> go.Figure:
    """MGSM accuracy per language (and the average), one bar per model: an `evaluation.EvalReport`."""
    rows = [r for r in report.table(metric) if r["language"] != "max"]
    x = [r["language"] for r in rows]
    fig = go.Figure()
    for m in report.models:
        fig.add_trace(go.Bar(name=m, x=x, y=[r[m] for r in rows], marker_color=MODEL_COLORS.get(m),
                             hovertemplate=f"{m}<br>%{{x}}: %{{y:.1f}}%<extra></extra>"))
    fig.update_layout(barmode="group", height=height, yaxis={"title": {"text": f"accuracy (%), {metric}"},
                                                             "range": [0, 100]},
                      title=f"MGSM {report.config.mode}, {report.config.shots}-shot"
                            + (" (cancelled: partial)" if report.cancelled else ""),
                      margin={"l": 60, "r": 20, "t": 50, "b": 40}, legend={"orientation": "h"})
    return fig
