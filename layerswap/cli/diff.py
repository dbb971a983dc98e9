"""`layerswap diff`: where each expert changed: heatmaps, depth profile, most-changed tensors, a suggested plan."""

from __future__ import annotations

import textwrap

from layerswap.core.errors import UserError
from layerswap.cli.options import Bar, check_outputs, DEVICE_HELP, models, open_checkpoint, plan_options, recipe_from


def add_parser(sub) -> None:
    s = sub.add_parser("diff", help="where each expert changed: heatmaps, profile, top tensors, suggested plan")
    models(s, base_required=True)
    plan_options(s)
    s.add_argument("--no-plan", action="store_true", help="no plan overlay and no merged-model panels")
    s.add_argument("-o", "--out", action="append", default=[],
                   help="heatmap figure: .html or .png (repeat for both)")
    s.add_argument("--profile", action="append", default=[], help="per-layer profile figure: .html or .png")
    s.add_argument("--panels", default="math,lang,overlap,merged",
                   help="comma-separated: math, lang, overlap, merged, merged-math, merged-lang, math-lang "
                        "(default math,lang,overlap,merged)")
    s.add_argument("--metric", choices=["relative", "mean_abs", "topk"], default="relative",
                   help="relative change, mean |Δ|, or share of the top-k%% most-changed entries (default relative)")
    s.add_argument("--overlap-metric", choices=["cosine", "jaccard"], default="cosine",
                   help="overlap panel: cosine of the task vectors or Jaccard of the top-k%% sets (default cosine)")
    s.add_argument("--k", type=float, action="append",
                   help="top-k%% to compute exactly (repeat for several; the first is shown; default 1)")
    s.add_argument("--norm", choices=["raw", "row", "log"], default="raw",
                   help="colour normalisation: raw, per row (parameter type), or log10 (default raw)")
    s.add_argument("--csv", help="every metric of every tensor as CSV")
    s.add_argument("--top", type=int, default=10, help="print the N most-changed tensors (default 10; 0: none)")
    s.add_argument("--top-csv", help="all tensors ranked by --metric, both experts, as CSV")
    s.add_argument("--device", default="auto", help=f"where the arithmetic runs: {DEVICE_HELP}")
    s.add_argument("--workers", type=int, default=1,
                   help="threads streaming their own share of the tensors (CPU: one per free core, with "
                        "OMP_NUM_THREADS=1; default 1)")
    s.add_argument("--cache-dir", help="analysis cache folder (default $LAYERSWAP_CACHE/analysis)")
    s.add_argument("--no-cache", action="store_true", help="neither read nor write the analysis cache")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=run)


def run(args) -> int:
    from layerswap.analysis import METRICS, PANEL_METRICS, PANELS, analyze, format_value, write_csv
    from layerswap.models.checkpoints import check_compatible
    from layerswap.analysis.plots import analysis_heatmaps, layer_profile, save_figure

    math, lang, base = open_checkpoint(args.math), open_checkpoint(args.lang), open_checkpoint(args.base)
    check_compatible(math, lang, base).raise_if_bad()
    check_outputs([*args.out, *args.profile, args.csv, args.top_csv], math, lang, base)
    panels = [p.strip() for p in args.panels.split(",") if p.strip()]
    for p in panels:
        if p not in PANELS:
            raise UserError(f"Unknown panel {p!r}; choose from {', '.join(PANELS)}.")
    L = math.num_layers
    plan = None if args.no_plan else recipe_from(args, L).plan  # diff has the plan flags only: layer swapping
    if plan is None:
        panels = [p for p in panels if not p.startswith("merged")]
    ks = args.k or [1.0]
    bar = Bar(enabled=not args.quiet)
    cache = False if args.no_cache else (args.cache_dir or True)
    an = analyze(base, math, lang, ks=ks, device=args.device, cache=cache, progress=bar, workers=args.workers)
    bar.done()
    k = ks[0]
    merged = an.merged(plan, math, lang, base, device=args.device) if plan is not None else None
    print(an.report(k, merged).replace("\n\n", "\n"))
    if plan is not None:
        print(f"plan overlay: b={plan.b} u={plan.u} tb={plan.tb} tu={plan.tu} ({L} layers)")
    metric = args.metric
    prof_metric = metric if metric in PANEL_METRICS["math"] else "relative"
    print(f"\n{METRICS[prof_metric].replace('top-k%', f'top-{k:g}%')}, per layer (bottom to top):")
    profiles = [("math", "math expert"), ("lang", "language expert")] + ([("merged", "merged")] if merged else [])
    for panel, name in profiles:
        vals = an.layer_profile(panel, prof_metric, k, merged)
        print(f"  {name:>16}: " + " ".join(format_value(prof_metric, v) for v in vals))
    print("\noutside the layers:")
    for r in an.non_layer_rows(k, merged):
        extra = (f", top-{k:g}% share math {format_value('topk', r['topk_share_math'])} lang "
                 f"{format_value('topk', r['topk_share_lang'])}") if an.topk else ""
        print(f"  {r['tensor']}: relative change math {format_value('relative', r['relative_math'])} lang "
              f"{format_value('relative', r['relative_lang'])}{extra}")
    ranked = an.most_changed(2 * len(an.tensors), by=prof_metric, k=k)
    if args.top:
        print(f"\nmost-changed tensors by {METRICS[prof_metric].replace('top-k%', f'top-{k:g}%')}:")
        for r in ranked[:args.top]:
            print(f"  {r['rank']:>3}. {r['expert']:<16} {r['tensor']:<48} {format_value(prof_metric, r[prof_metric])}")
    s = an.suggest_plan(prof_metric, k)
    print(f"\nthe weight-diff prior: b={s.plan.b} u={s.plan.u} tb={s.plan.tb} tu={s.plan.tu}  (layers dominated by the "
          f"language expert: {''.join('L' if d else '.' for d in s.lang_dominant)})")
    print(textwrap.fill(f"rule: {s.rule}", 100, initial_indent="  ", subsequent_indent="  "))
    if s.note:
        print(f"  note: {s.note}")
    if args.out:
        fig = analysis_heatmaps(an, panels, metric=metric, overlap_metric=args.overlap_metric, k=k, norm=args.norm,
                                merged=merged, plan=plan)
        for out in args.out:
            save_figure(fig, out)
            print(f"wrote {out}")
    if args.profile:
        fig = layer_profile(an, prof_metric, k, merged, plan, args.norm)
        for out in args.profile:
            save_figure(fig, out)
            print(f"wrote {out}")
    if args.csv:
        write_csv(an.rows(k, merged), args.csv)
        print(f"wrote {args.csv} (every metric of every tensor)")
    if args.top_csv:
        write_csv(ranked, args.top_csv)
        print(f"wrote {args.top_csv} (tensors ranked by {prof_metric}, both experts)")
    return 0
