"""Sweep results as tables and figures: accuracy per language with exact intervals, average and max; an
accuracy heatmap over (b, u), bars per recipe with the experts as reference lines, curves for one-dimensional
sweeps; paired comparisons of two points; CSV and a self-contained HTML page. Everything reads the records of a
results file (`layerswap.sweeps.log.load_results`, or `SweepRun.rows`).

Each language's accuracy comes with its binomial standard error and its exact 95 % interval (Clopper-Pearson,
`layerswap.core.stats`), which stays honest at 0/n and n/n. The average over languages gets the standard error of
the per-question mean when the record holds per-question results of equal length (MGSM's languages are
translations of the same questions, so a model's outcomes are correlated across them), else
``sqrt(sum se_i^2) / k``. The max over languages is reported without one (it is a selection).
`paired_comparison` compares two points on the same questions (difference, its SE, exact McNemar p).
"""

from __future__ import annotations

import csv
import html
import json
import math
import os
from pathlib import Path
from typing import Sequence

import plotly.graph_objects as go

from layerswap.core.errors import UserError
from layerswap.evaluation import mgsm
from layerswap.analysis.plots import LANG_COLOR, MATH_COLOR
from layerswap.core.stats import clopper_pearson, mcnemar, paired_difference, paired_mean_se

EXPERT_COLORS = {"math": MATH_COLOR, "lang": LANG_COLOR}
MERGE_COLOR = "#7570b3"


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def _correct(r: dict, metric: str) -> dict[str, list[bool]] | None:
    """Per-question correctness per language (flexible only: the records keep it), or None."""
    stored = r.get("correct_flexible") if metric == "flexible" else None
    langs = r["eval"]["langs"]
    if not stored or any(len(stored.get(lang, "")) != r["n"][lang] for lang in langs):
        return None
    return {lang: [c == "1" for c in stored[lang]] for lang in langs}


def scores(r: dict, metric: str = "flexible") -> dict:
    """Accuracy (%), standard error and exact 95 % interval per language; the average (with its error) and max."""
    langs = r["eval"]["langs"]
    acc = {lang: r["accuracy"][metric][lang] for lang in langs}
    se = {lang: _se(acc[lang], r["n"][lang]) for lang in langs}
    ci = {lang: tuple(100 * x for x in clopper_pearson(round(acc[lang] * r["n"][lang]), r["n"][lang]))
          if r["n"][lang] else (float("nan"), float("nan")) for lang in langs}
    per_q = _correct(r, metric)
    same_questions = per_q is not None and len({len(v) for v in per_q.values()}) == 1 and len(langs) > 1
    avg_se = paired_mean_se(list(per_q.values())) if same_questions else \
        math.sqrt(sum(v * v for v in se.values())) / len(langs)
    return {"acc": {k: 100 * v for k, v in acc.items()}, "se": {k: 100 * v for k, v in se.items()}, "ci": ci,
            "average": 100 * sum(acc.values()) / len(langs), "average_se": 100 * avg_se,
            "average_paired": same_questions, "max": 100 * max(acc.values()), "n": sum(r["n"].values())}


def paired_comparison(a: dict, b: dict, lang: str) -> dict:
    """Record `a` minus record `b` on the same questions of `lang` (flexible): difference and SE in points, z,
    the questions only `a` / only `b` got right, and the exact McNemar p."""
    ca, cb = _correct(a, "flexible"), _correct(b, "flexible")
    if ca is None or cb is None or len(ca[lang]) != len(cb[lang]):
        raise UserError(f"{a['name']} and {b['name']} have no per-question results on the same {lang} questions.")
    d, m = paired_difference(ca[lang], cb[lang]), mcnemar(ca[lang], cb[lang])
    return {"diff": 100 * d.diff, "se": 100 * d.se, "z": d.z, "only_a": m.only_a, "only_b": m.only_b, "p": m.p}


def evaluated(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if r["kind"] in ("expert", "merge")]


def _join_key(r: dict) -> str:
    """Same experts (by fingerprint) and same recipe (None: the model itself)."""
    fps = {k: v["fingerprint"] for k, v in r.get("experts", {}).items()}
    return json.dumps({"experts": fps, "recipe": r.get("recipe"), "role": r.get("role")}, sort_keys=True)


def results_table(rows: Sequence[dict], metric: str = "flexible") -> list[dict]:
    """One row per evaluated point: set, recipe, test set, then per language accuracy and ±, average ±, max, n;
    lm-eval records (`layerswap.sweeps.lmeval`) add their metrics to the row of the same experts and recipe (or a row
    of their own)."""
    mgsm.TASK.check_metric(metric)
    extra: dict[str, dict] = {}
    for r in rows:
        if r["kind"] == "lm-eval":
            extra.setdefault(_join_key(r), {"set": r["set"], "recipe": r["name"], "kind": "lm-eval"}).update(
                {k: round(v, 4) for k, v in r["metrics"].items()})
    out = []
    for r in rows:
        if r["kind"] == "not run":  # a recipe these experts cannot take: the row says why
            out.append({"set": r["set"], "recipe": f"{r['name']}: not run ({r['message'].split(':')[0][:120]})",
                        "kind": "not run", "test set": r["test_set"]["name"], "n": 0})
            continue
        if r["kind"] not in ("expert", "merge"):
            continue
        s = scores(r, metric)
        row = {"set": r["set"], "recipe": r["name"], "kind": r["kind"], "test set": r["test_set"]["name"],
               **({"family": r["family"]} if r.get("family") else {})}
        for lang in r["eval"]["langs"]:
            row[lang] = round(s["acc"][lang], 1)
            row[f"{lang} ±"] = round(s["se"][lang], 1)
            row[f"{lang} 95% CI"] = "[{:.1f}, {:.1f}]".format(*s["ci"][lang])
        row.update({"average": round(s["average"], 1), "average ±": round(s["average_se"], 1),
                    "max": round(s["max"], 1), "n": s["n"]})
        row.update({f"var {k}": v for k, v in r.get("vars", {}).items()})
        joined = extra.pop(_join_key(r), None)
        if joined:
            row.update({k: v for k, v in joined.items() if k not in ("set", "recipe", "kind")})
        out.append(row)
    return out + list(extra.values())


def stats_table(rows: Sequence[dict], metric: str = "flexible") -> list[dict]:
    """Per expert set: each expert's distance from the base next to the experts' and merges' accuracy
    (the average over languages; merges: their mean and best)."""
    out = []
    for st in (r for r in rows if r["kind"] in ("stats", "refused")):
        mine = [r for r in evaluated(rows) if r["set"] == st["set"]]
        row: dict = {"set": st["set"]}
        if st["kind"] == "refused":
            row["refused"] = st["message"]
            out.append(row)
            continue
        for k, v in st["pairing"]["distances"].items():
            row[f"sampled {k}"] = round(v, 4)
        for k, v in (st.get("relative_change") or {}).items():
            row[f"relative change {k}"] = round(v, 4)
        for role in ("math", "lang"):
            e = [r for r in mine if r.get("role") == role]
            if e:
                row[f"{role} expert avg %"] = round(scores(e[0], metric)["average"], 1)
        merges = [scores(r, metric)["average"] for r in mine if r["kind"] == "merge"]
        if merges:
            row["merges mean avg %"] = round(sum(merges) / len(merges), 1)
            row["best merge avg %"] = round(max(merges), 1)
        out.append(row)
    return out


def _headers(rows: Sequence[dict]) -> list[str]:
    heads: list[str] = []
    for r in rows:
        heads += [k for k in r if k not in heads]
    return heads


def table_text(rows: Sequence[dict], metric: str = "flexible") -> str:
    """The results table as Markdown: each language's accuracy with its exact 95 % interval, ``a [lo, hi]`` (%),
    the average as ``a ± se``; a family's points as its own table (`family_table`), after the others'."""
    family = family_table(rows, metric)
    table = [r for r in results_table(rows, metric) if not r.get("family")]
    if not table and not family:
        return "(no evaluated points yet)"
    parts = [_markdown(table, "set", ["max"]) if table else "",
             _markdown(family, "family", []) if family else ""]
    return "\n\n".join(p for p in parts if p)


def _markdown(table: list[dict], group: str, extra: list[str]) -> str:
    langs = [h for h in _headers(table) if f"{h} ±" in _headers(table) and h != "average"]
    multi_set = len({r[group] for r in table}) > 1
    multi_test = len({r["test set"] for r in table}) > 1
    head = ([group] if multi_set else []) + ["recipe"] + (["test set"] if multi_test else []) + langs + \
        ["average", *extra, "n"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        cells = []
        for h in head:
            if h in langs:
                cells.append("–" if r.get(h) is None else f"{r[h]:.1f} {r[f'{h} 95% CI']}")
            elif h == "average":
                cells.append("–" if r.get(h) is None else f"{r[h]:.1f} ± {r[f'{h} ±']:.1f}")
            else:
                cells.append(str(r.get(h, "–")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def family_table(rows: Sequence[dict], metric: str = "flexible") -> list[dict]:
    """A family's points (`spec` ``family:``) in the paper's layout: per family and test set a row per model (the
    math expert, the language experts, each recipe), a column per language (each scored in its own expert set), and
    the average over the family's languages once every one has the row (± sqrt(sum se^2) / k: each language's
    models differ, so their errors are independent)."""
    members = [r for r in evaluated(rows) if r.get("family")]
    codes: dict[str, list[str]] = {}
    for r in members:
        codes.setdefault(r["family"], []).extend(x for x in r["eval"]["langs"] if x not in codes[r["family"]])
    out: dict[tuple, dict] = {}
    for r in members:
        s = scores(r, metric)
        row = out.setdefault((r["family"], r["test_set"]["name"], r["kind"], r["name"]), {
            "family": r["family"], "recipe": r["name"], "kind": r["kind"], "test set": r["test_set"]["name"], "n": 0})
        for lang in r["eval"]["langs"]:
            row.update({lang: round(s["acc"][lang], 1), f"{lang} ±": round(s["se"][lang], 1),
                        f"{lang} 95% CI": "[{:.1f}, {:.1f}]".format(*s["ci"][lang])})
            row.setdefault("_exact", {})[lang] = (s["acc"][lang], s["se"][lang])
        row["n"] += s["n"]
        row.update({f"var {k}": v for k, v in r.get("vars", {}).items()})
    for row in out.values():
        got, langs = row.pop("_exact"), codes[row["family"]]
        done = all(x in got for x in langs)
        row["average"] = round(sum(got[x][0] for x in langs) / len(langs), 1) if done else None
        row["average ±"] = round(math.sqrt(sum(got[x][1] ** 2 for x in langs)) / len(langs), 1) if done else None
    return list(out.values())


def write_csv(rows: Sequence[dict], path: str | os.PathLike, metric: str = "flexible") -> Path:
    path = Path(path)
    table = results_table(rows, metric)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=_headers(table) or ["recipe"])
        w.writeheader()
        w.writerows(table)
    return path


# ---- figures ------------------------------------------------------------------------------------------

def _value(r: dict, metric: str, lang: str | None) -> tuple[float, float]:
    s = scores(r, metric)
    return (s["acc"][lang], s["se"][lang]) if lang else (s["average"], s["average_se"])


def accuracy_heatmap(rows: Sequence[dict], metric: str = "flexible", lang: str | None = None) -> go.Figure:
    """Accuracy over (b, u) for the grid points that vary b and u; one panel per other setting."""
    from plotly.subplots import make_subplots

    pts = [r for r in evaluated(rows) if r["kind"] == "merge" and {"b", "u"} <= set(r.get("vars", {}))]
    if not pts:
        raise UserError("The heatmap needs grid points that vary b and u.")
    groups: dict[str, list[dict]] = {}
    for r in pts:
        rest = ", ".join(f"{k}={v}" for k, v in r["vars"].items() if k not in ("b", "u"))
        label = " · ".join(x for x in (r["set"] if len({p["set"] for p in pts}) > 1 else "", r["test_set"]["name"]
                                        if len({p["test_set"]["name"] for p in pts}) > 1 else "", rest) if x)
        groups.setdefault(label or "grid", []).append(r)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=list(groups), horizontal_spacing=0.08)
    for i, (label, rs) in enumerate(groups.items(), 1):
        bs = sorted({r["vars"]["b"] for r in rs})
        us = sorted({r["vars"]["u"] for r in rs})
        z = [[None] * len(bs) for _ in us]
        text = [[""] * len(bs) for _ in us]
        for r in rs:
            v, se = _value(r, metric, lang)
            z[us.index(r["vars"]["u"])][bs.index(r["vars"]["b"])] = v
            text[us.index(r["vars"]["u"])][bs.index(r["vars"]["b"])] = f"{v:.1f}±{se:.1f}"
        fig.add_trace(go.Heatmap(z=z, x=bs, y=us, text=text, texttemplate="%{text}", colorscale="Viridis",
                                 zmin=0, showscale=i == 1, colorbar={"title": {"text": "accuracy %"}},
                                 hovertemplate="b=%{x} u=%{y}: %{text}%<extra></extra>"), row=1, col=i)
        fig.update_xaxes(title_text="b (bottom layers from the language expert)", dtick=1, row=1, col=i)
        fig.update_yaxes(title_text="u (top layers)" if i == 1 else None, dtick=1, row=1, col=i)
    fig.update_layout(title=f"MGSM accuracy % ({metric}, {lang or 'average over languages'})",
                      height=420, width=max(520, 440 * len(groups)))
    return fig


def recipe_bars(rows: Sequence[dict], metric: str = "flexible", lang: str | None = None) -> go.Figure:
    """Horizontal bars with standard errors, one per merge; the experts as dotted lines (one expert set) or as
    ticks on their own set's bars (several sets)."""
    merges = [r for r in evaluated(rows) if r["kind"] == "merge"]
    if not merges:
        raise UserError("No merges in these results yet.")
    multi = len({r["set"] for r in merges}) > 1 or len({r["test_set"]["name"] for r in merges}) > 1
    names = [(f"{r['set']} · {r['test_set']['name']} · " if multi else "") + r["name"] for r in merges]
    vals = [_value(r, metric, lang) for r in merges]
    fig = go.Figure(go.Bar(x=[v for v, _ in vals], y=names, orientation="h", marker_color=MERGE_COLOR,
                           error_x={"type": "data", "array": [e for _, e in vals]},
                           hovertemplate="%{y}: %{x:.1f}%<extra></extra>", name="merges"))
    experts = [r for r in evaluated(rows) if r["kind"] == "expert"]
    for r in experts if not multi else ():  # one expert set: its experts as dotted lines across every bar
        fig.add_vline(x=_value(r, metric, lang)[0], line_dash="dot", annotation_text=r["name"],
                      line_color=EXPERT_COLORS.get(r.get("role"), "#555"), annotation_position="top")
    for role in dict.fromkeys(r.get("role") for r in experts) if multi else ():
        # several sets: each set's experts as ticks on that set's own bars (lines across all would mix sets)
        ref = {(r["set"], r["test_set"]["name"]): _value(r, metric, lang)[0] for r in experts if r.get("role") == role}
        pts = [(ref[(m["set"], m["test_set"]["name"])], y) for m, y in zip(merges, names)
               if (m["set"], m["test_set"]["name"]) in ref]
        name = next(r["name"] for r in experts if r.get("role") == role)
        tick = {"symbol": "line-ns", "size": 18, "line": {"width": 3, "color": EXPERT_COLORS.get(role, "#555")}}
        fig.add_trace(go.Scatter(x=[x for x, _ in pts], y=[y for _, y in pts], mode="markers", name=name, marker=tick,
                                 hovertemplate=f"{name} of this set: %{{x:.1f}}%<extra></extra>"))
    fig.update_layout(height=160 + 26 * len(merges), xaxis_title=f"MGSM accuracy % ({metric}, {lang or 'average'})",
                      xaxis={"range": [0, 104]}, yaxis={"autorange": "reversed"}, showlegend=multi,
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
                      margin={"l": 280, "r": 40, "t": 60, "b": 50})
    return fig


def sweep_curves(rows: Sequence[dict], metric: str = "flexible") -> go.Figure:
    """Accuracy against the one varied setting (a 1-D grid), a line per language and the average;
    the experts' averages as dotted lines."""
    pts = [r for r in evaluated(rows) if r["kind"] == "merge" and len(r.get("vars", {})) == 1]
    if not pts:
        raise UserError("Curves need grid points that vary one setting.")
    var = next(iter(pts[0]["vars"]))
    pts = sorted((r for r in pts if var in r["vars"]), key=lambda r: r["vars"][var])
    xs = [r["vars"][var] for r in pts]
    fig = go.Figure()
    for lang in [*pts[0]["eval"]["langs"], None]:
        vals = [_value(r, metric, lang) for r in pts]
        fig.add_trace(go.Scatter(x=xs, y=[v for v, _ in vals], error_y={"type": "data", "array": [e for _, e in vals]},
                                 mode="lines+markers", name=lang or "average",
                                 line={"width": 3 if lang is None else 1.5}))
    for r in (r for r in evaluated(rows) if r["kind"] == "expert"):
        fig.add_hline(y=_value(r, metric, None)[0], line_dash="dot", annotation_text=f"{r['name']} (average)",
                      line_color=EXPERT_COLORS.get(r.get("role"), "#555"))
    fig.update_layout(xaxis_title=var, yaxis_title=f"MGSM accuracy % ({metric})", height=400)
    return fig


def sweep_figures(rows: Sequence[dict], metric: str = "flexible") -> list[tuple[str, go.Figure]]:
    """The figures that fit these results: heatmap for (b, u) grids, curves for 1-D grids, bars always."""
    figs = []
    merges = [r for r in evaluated(rows) if r["kind"] == "merge"]
    if any({"b", "u"} <= set(r.get("vars", {})) for r in merges):
        figs.append(("heatmap", accuracy_heatmap(rows, metric)))
    if any(len(r.get("vars", {})) == 1 for r in merges):
        figs.append(("curves", sweep_curves(rows, metric)))
    if merges:
        figs.append(("bars", recipe_bars(rows, metric)))
    return figs


def write_html(rows: Sequence[dict], path: str | os.PathLike, title: str = "Sweep results",
               metric: str = "flexible") -> Path:
    """One self-contained page (plotly.js inlined once): the table, the model-level statistics, the figures."""
    path = Path(path)
    table = results_table(rows, metric)
    stats = stats_table(rows, metric)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>", f"<p>accuracy %, {metric} extraction, ± one binomial standard error</p>",
             _html_table(table)]
    family = family_table(rows, metric)
    if family:
        parts += ["<h2>The family: a column per language, each scored in its own expert set</h2>",
                  _html_table(family)]
    if stats:
        parts += ["<h2>Experts</h2>", _html_table(stats)]
    for i, (_, fig) in enumerate(sweep_figures(rows, metric)):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=i == 0))
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _html_table(rows: Sequence[dict]) -> str:
    heads = _headers(rows)
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(r.get(h, '')))}</td>" for h in heads) + "</tr>")
    return "\n".join(out) + "</table>"
