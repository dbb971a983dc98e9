"""The lens as figures (plotly, in the house style of `layerswap.analysis.plots`) and a self-contained HTML report.

- `lens_grid`: one panel per model, layers (rows, embeddings at the bottom) x positions (the last
  prompt token, then each token of the model's answer when answers were lensed); each cell shows
  the top decoded token, coloured by its class (target language, English, digits, other), deeper
  for higher probability, as in Wendler et al. 2024.
- `lens_curves`: P(target), P(English), cosine alignment with the English twin and linear CKA by
  layer, one line per model, with the plan's layers outlined (language expert), shaded (blends)
  or dashed blue (reverted to the base), as on the heatmaps.

The layer axis is the heatmaps' one: x = i is the state after layer (block) i, and ``emb`` (x = -1)
the embedding output; in the JSON the same state is layer i + 1 (layer 0 = embeddings).
"""

from __future__ import annotations

import html
import os
from pathlib import Path

import plotly.graph_objects as go

from layerswap.analysis.plots import BASE_COLOR, LANG_COLOR, MATH_COLOR, MODEL_COLORS, _runs
from layerswap.core.roles import ROLE_NAMES
from layerswap.recipe.sources import Sources, TensorSource
from layerswap.analysis.lens.classes import CLASSES
from layerswap.analysis.lens.run import LensResult

SUBTITLE_WIDTH = 560  # the narrowest grid figure: room for its longest note line (61 characters) at subtitle size

CLASS_COLORS = {"target": "#e7298a", "english": "#1f78b4", "digits": "#e6ab02", "other": "#999999"}
CLASS_LABELS = {"target": "target language", "english": "English", "digits": "digits", "other": "other"}
ROLE_COLORS = {"math": MATH_COLOR, "lang": LANG_COLOR, "merged": MODEL_COLORS["merged model"], "base": BASE_COLOR}


def _class_scale() -> list:
    """One band per class in CLASSES order; within a band, light (p -> 0) to full colour (p -> 1)."""
    n = len(CLASSES)
    scale = []
    for k, c in enumerate(CLASSES):
        r, g, b = (int(CLASS_COLORS[c][i:i + 2], 16) for i in (1, 3, 5))
        light = f"rgb({(r + 3 * 255) // 4},{(g + 3 * 255) // 4},{(b + 3 * 255) // 4})"
        scale += [[k / n, light], [(k + 1) / n - 1e-9 if k < n - 1 else 1.0, CLASS_COLORS[c]]]
    return scale


def _x_labels(num_layers: int) -> tuple[list[int], list[str]]:
    return list(range(-1, num_layers)), ["emb"] + [str(i) for i in range(num_layers)]


def _short(token: str, n: int) -> str:
    """A token as a cell label: stripped, cut to `n` characters, HTML-escaped (``</s>`` is text, not a tag)."""
    return html.escape(token.strip()[:n] or repr(token))


def _cell_hover(layer: int, pos: str, row) -> str:
    tops = "<br>".join(f"{html.escape(repr(t))} {p:.3f}" for t, p in row.top)
    where = "embeddings" if layer == 0 else f"after layer {layer - 1}"
    return (f"<b>{where}</b> · position {html.escape(repr(pos))}<br>{tops}<br>P(target) {row.p_target:.3f} · "
            f"P(English) {row.p_english:.3f} · P(digits) {row.p_digits:.3f}")


def lens_grid(result: LensResult, roles: list[str] | None = None, max_chars: int = 8,
              row_height: int = 22) -> go.Figure:
    """Layers x positions of top-1 tokens, one panel per model (stacked), coloured by language class."""
    from plotly.subplots import make_subplots

    roles = [r for r in (roles or list(result.models)) if r in result.models]
    L = result.num_layers
    ys, ylab = _x_labels(L)
    fig = make_subplots(rows=len(roles), cols=1, vertical_spacing=0.25 / max(len(roles), 1),
                        subplot_titles=[ROLE_NAMES[r] for r in roles])
    n = len(CLASSES)
    width = 1
    for j, role in enumerate(roles, 1):
        m = result.models[role]
        cols = m.answer.positions if m.answer is not None else [m.layers]
        inputs = m.answer.inputs if m.answer is not None else [result.last_token]
        width = max(width, len(cols))
        z, text, hover = [], [], []
        for layer in range(L + 1):
            z.append([CLASSES.index(col[layer].top_classes[0]) + min(col[layer].top[0][1], 0.999) for col in cols])
            text.append([_short(col[layer].top[0][0], max_chars) for col in cols])
            hover.append([_cell_hover(layer, inputs[k], col[layer]) for k, col in enumerate(cols)])
        xs = [f"{k}:{_short(t, max_chars)}" for k, t in enumerate(inputs)]
        fig.add_trace(go.Heatmap(
            z=z, x=xs, y=ys, text=text, texttemplate="%{text}", customdata=hover, zmin=0, zmax=n,
            colorscale=_class_scale(), showscale=j == 1, xgap=1, ygap=1,
            hovertemplate="%{customdata}<extra>" + ROLE_NAMES[role] + "</extra>",
            colorbar={"title": {"text": "top token"}, "tickvals": [k + 0.5 for k in range(n)],
                      "ticktext": [CLASS_LABELS[c] for c in CLASSES], "thickness": 14, "len": 0.5, "y": 1,
                      "yanchor": "top"}), row=j, col=1)
        fig.update_yaxes(tickvals=ys, ticktext=ylab, title_text="after layer", row=j, col=1,
                         dtick=1 if L <= 40 else 4)
        if role == "merged" and result.layer_sources is not None:
            for a, b in _runs([_from_lang(s) for s in result.layer_sources]):
                fig.add_hrect(y0=a - 0.5, y1=b + 0.5, row=j, col=1, line={"color": LANG_COLOR, "width": 2.5},
                              fillcolor="rgba(0,0,0,0)", layer="above")
    answered = any(m.answer is not None for m in result.models.values())
    notes = ["columns: the last prompt token" + (", then the model's own answer" if answered else ""),
             "colour: class of the top token (deeper = more probable)"]
    if result.layer_sources is not None:
        notes.append("outlined on the merged model: layers from the language expert")
    fig.update_layout(  # one short line per note: the figure may be as narrow as one column
        title=f"Logit lens, top token per layer · {result.language_name} prompt" + "".join(
            f"<br><sup>{n}</sup>" for n in notes),
        height=len(roles) * (row_height * (L + 1) + 70) + 120 + 18 * len(notes),
        width=min(1600, max(SUBTITLE_WIDTH, 160 + 62 * width)), margin={"l": 70, "r": 30, "t": 60 + 18 * len(notes), "b": 40})
    return fig


def _from_lang(s: TensorSource) -> bool:
    return s.kind == "copy" and s.role == "lang"


def _plan_overlay(fig: go.Figure, result: LensResult) -> None:
    layers = result.layer_sources  # through Sources: a reverted layer is the base's, never the language expert's
    if layers is None:
        return
    for a, b in _runs([_from_lang(s) for s in layers]):
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, row="all", col=1, line={"color": LANG_COLOR, "width": 2},
                      fillcolor="rgba(0,0,0,0)", layer="above")
    for a, b in _runs([s.kind == "blend" for s in layers]):
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, row="all", col=1, fillcolor="rgba(120,120,120,0.25)", line_width=0)
    for a, b in _runs([s.from_base for s in layers]):
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, row="all", col=1, fillcolor="rgba(56,108,176,0.2)",
                      line={"color": BASE_COLOR, "width": 2, "dash": "dash"})


def _mean_over_positions(m, key: str, answers: bool) -> list[float]:
    """A class mass per layer: at the last prompt position, or averaged over every lensed position of the answer."""
    if not answers or m.answer is None:
        return [getattr(x, key) for x in m.layers]
    cols = m.answer.positions
    return [sum(getattr(col[i], key) for col in cols) / len(cols) for i in range(len(m.layers))]


def lens_curves(result: LensResult, answers: bool | None = None, height: int = 760) -> go.Figure:
    """P(target), P(English), alignment (cosine) and CKA by layer, one line per model, the plan outlined.

    `answers` (default: when answers were lensed): the P curves average over the last prompt position and every
    position of each model's answer instead of the last prompt position alone."""
    from plotly.subplots import make_subplots

    if answers is None:
        answers = any(m.answer is not None for m in result.models.values())
    where = "averaged over the last prompt position and the answer" if answers else "at the last prompt position"
    b = len(result.batch_indices)
    panels = [("p_target", f"P({result.language_name} token) {where}"), ("p_english", f"P(English token) {where}"),
              ("alignment", "alignment with the English twin: cosine of mean-pooled states"),
              ("cka", f"linear CKA with English over {b} parallel question{'s' if b != 1 else ''}")]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[t for _, t in panels])
    xs, xlab = _x_labels(result.num_layers)
    for k, (key, _) in enumerate(panels, 1):
        for role, m in result.models.items():
            ys = _mean_over_positions(m, key, answers) if key.startswith("p_") else [getattr(x, key) for x in m.layers]
            fig.add_trace(go.Scatter(x=xs, y=ys, name=m.name, legendgroup=role, showlegend=k == 1, mode="lines+markers",
                                     line={"color": ROLE_COLORS[role], "width": 2.5,
                                           "dash": "dash" if role == "merged" else "solid"},
                                     hovertemplate=f"{m.name} · after layer %{{x}}: %{{y:.3f}}<extra></extra>"),
                          row=k, col=1)
        if key.startswith("p_"):
            fig.update_yaxes(range=[-0.02, 1.02], row=k, col=1)
    _plan_overlay(fig, result)
    fig.update_xaxes(tickvals=xs, ticktext=xlab, range=[-1.5, result.num_layers - 0.5])
    fig.update_xaxes(title_text="after layer (emb = embeddings)", row=len(panels), col=1)
    plan = (f"merged model: {result.recipe.title()}<br>orange outline: layers it takes from the language expert; "
            "grey: blended" if result.recipe is not None else "")
    fig.update_layout(title=f"Where each model reads {result.language_name} and where it aligns with English"
                            f"<br><sup>{plan}</sup>", height=height, margin={"l": 60, "r": 20, "t": 140, "b": 50},
                      legend={"orientation": "h", "y": -0.08})
    return fig


def _table(result: LensResult) -> str:
    heads = ["model", "layer", "top tokens", "P(target)", "P(English)", "P(digits)", "cosine", "CKA"]
    rows = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr>"]
    fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    for m in result.models.values():
        for x in m.layers:
            tops = ", ".join(f"{t!r} {p:.2f}" for t, p in x.top[:3])
            cells = [m.name, "emb" if x.layer == 0 else str(x.layer - 1), tops, fmt(x.p_target), fmt(x.p_english),
                     fmt(x.p_digits), fmt(x.alignment), fmt(x.cka)]
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(rows) + "</table>"


def write_report(result: LensResult, path: str | os.PathLike) -> Path:
    """One self-contained page (plotly.js inlined once): prompt, rule, figures, answers and the numbers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    title = f"Latent-language lens: {result.language_name}"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px}pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap}"
             "</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             f"<p><b>Prompt</b> ({'MGSM question ' + str(result.index) if result.index is not None else 'free text'}):</p>"
             f"<pre>{html.escape(result.prompt)}</pre>"]
    if result.twin:
        parts.append(f"<p><b>English twin</b>:</p><pre>{html.escape(result.twin)}</pre>")
    parts.append(f"<p><b>Token classes.</b> {html.escape(result.rule)}</p>")
    if result.recipe is not None:
        parts.append(f"<p><b>Merged model</b>: {html.escape(Sources(result.recipe, result.num_layers).describe())}</p>")
    parts.append(f"<p>Layer axis: <i>after layer i</i> (emb = the embedding output). Alignment pools each prompt's "
                 f"states over its tokens (special tokens left out); CKA runs over MGSM questions "
                 f"{result.batch_indices[0]}.. ({len(result.batch_indices)} in all) and their English twins.</p>")
    for i, fig in enumerate((lens_curves(result), lens_grid(result))):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=i == 0))
    answers = [(m.name, m.answer.text) for m in result.models.values() if m.answer is not None]
    if answers:
        parts.append("<h2>Answers (greedy)</h2>" + "".join(f"<p><b>{html.escape(n)}</b></p><pre>{html.escape(t)}</pre>"
                                                           for n, t in answers))
    parts += ["<h2>Numbers at the last prompt position</h2>", _table(result), "</body></html>"]
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
