"""`layerswap sweep`: merge and evaluate every recipe of a sweep file (resumable), or a grid / the ablation
suite from flags; tables and plots."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.evaluation import mgsm
from layerswap.cli.options import (Bar, check_outputs, engine_options, engine_settings, eval_config, eval_options,
                                   int_list, models, pairing_options, plan_options, ray_options, recipe_from,
                                   test_data)


def add_parser(sub) -> None:
    s = sub.add_parser("sweep", help="merge and evaluate every recipe of a sweep file (resumable), or a grid / the "
                                      "ablation suite from flags; tables and plots")
    s.add_argument("file", nargs="?", metavar="SWEEP.yaml",
                   help="a sweep file (layerswap.sweeps.spec): experts, recipes or grid, test sets, settings")
    models(s, optional="flag form: ", family=True)
    s.add_argument("--suite", choices=("grid", "ablations"), default="grid",
                   help="grid: (b, u, t) swap plans; ablations: transition, location, module and baseline variants")
    s.add_argument("--b-values", default="0-3", help="grid: bottom layer counts (default 0-3)")
    s.add_argument("--u-values", default="0-2", help="grid: top layer counts (default 0-2)")
    s.add_argument("--t-values", default="0,1", help="grid: transition widths tb = tu (default 0,1)")
    plan_options(s)
    pairing_options(s)
    eval_options(s)
    s.add_argument("--no-experts", action="store_true", help="skip evaluating the experts themselves")
    engine_options(s)
    s.add_argument("-o", "--out", help="results file (JSONL: one line per finished point; a rerun resumes it). "
                                      "A .csv name writes the table instead and keeps no results file")
    ray_options(s, "run points in parallel (needs -o RESULTS.jsonl)")
    s.add_argument("--csv", action="append", help="the results table as CSV")
    s.add_argument("--html", help="a self-contained HTML page: table, statistics and figures")
    s.add_argument("--plot", action="append", help="figures (.html or .png): heatmap over (b, u), curves, bars; "
                                                   "one file per figure, suffixed -heatmap/-curves/-bars when several")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=run)


def run(args) -> int:
    from layerswap.sweeps import load_spec, run_sweep, with_eval
    from layerswap.sweeps.report import stats_table, sweep_figures, table_text, write_csv, write_html

    if args.file:
        given = [f for f in ("math", "lang", "base") if getattr(args, f)]
        if given:
            raise UserError(f"{args.file} names the experts; drop --{', --'.join(given)} (or use the flag form "
                            "without a file).")
        spec = with_eval(load_spec(args.file), limit=args.limit)
        given = {"engine": args.engine, "device": None if args.device == "auto" else args.device,
                 "tensor_parallel_size": None if args.tensor_parallel_size == 1 else args.tensor_parallel_size}
        spec.engine = {**spec.engine, **{k: v for k, v in given.items() if v}}  # the machine, not the sweep: flags win
    else:
        spec = _sweep_spec(args)
    out = args.out
    csv_out = list(args.csv or [])
    if out and out.lower().endswith(".csv"):  # the flag form's table, as before; the records stay in memory
        csv_out.append(out)
        out = None
    inputs = [ref for es in spec.expert_sets for ref in (es.math, es.lang, es.base)] + [t.path for t in spec.test_sets]
    check_outputs([out, *csv_out, args.html, *(args.plot or [])], extra=tuple(inputs))  # before any point runs
    n = len(spec.points)
    codes = [es.name for es in spec.expert_sets if es.family]
    sets = f"a family of {len(codes)} ({', '.join(codes)}: each on its own language)" if codes else \
        f"{len(spec.expert_sets)} expert set(s)"
    print(f"{spec.name}: {n} recipe{'s' if n != 1 else ''} x {sets} x "
          f"{len(spec.test_sets)} test set(s); MGSM {spec.eval.get('mode', mgsm.TASK.mode)}, "
          f"{spec.eval.get('shots', mgsm.TASK.shots)}-shot, " + ("first " + str(spec.eval['limit']) if spec.eval.get("limit") else "all")
          + " questions" + (f"; results in {out}" if out else ""))
    bar = Bar(enabled=not args.quiet)
    try:
        if args.ray:
            from layerswap.sweeps.ray import run_sweep_ray

            if not out:
                raise UserError("--ray writes to a results file: add -o RESULTS.jsonl.")
            run = run_sweep_ray(spec, out, actors=args.ray, progress=bar, gpus_per_actor=args.ray_gpus,
                                address=args.ray_address)
        else:
            run = run_sweep(spec, out, progress=bar)
    finally:
        bar.done()
    if run.repaired:
        print(f"note: {run.repaired}; that point was run again")
    for name, k in run.left_out.items():
        print(f"note: {k} grid point(s) do not fit the layers of expert set {name!r} and were left out")
    print(f"{run.ran} point(s) run now, {len(run.rows) - run.ran} already in the results file")
    print(table_text(run.rows, "flexible"))
    for row in stats_table(run.rows):
        print("  " + ", ".join(f"{k}: {v}" for k, v in row.items()))
    _best(run.rows)
    for path in csv_out:
        write_csv(run.rows, path)
        print(f"wrote {path}")
    if args.html:
        write_html(run.rows, args.html, title=spec.name)
        print(f"wrote {args.html}")
    if args.plot:
        from layerswap.analysis.plots import save_figure

        figs = dict(sweep_figures(run.rows))
        for path in args.plot:
            stem = Path(path)
            for kind, fig in figs.items():
                target = stem if len(figs) == 1 else stem.with_name(f"{stem.stem}-{kind}{stem.suffix}")
                save_figure(fig, target)
                print(f"wrote {target}")
    return 0


def _best(rows: list[dict]) -> None:
    """The merge with the best average flexible accuracy (a family's: over its languages), said to be optimistic."""
    from layerswap.sweeps.report import family_table, scores

    family = [(r, r["average"]) for r in family_table(rows) if r["kind"] == "merge" and r["average"] is not None]
    merges = family or [(r, scores(r)["average"]) for r in rows if r["kind"] == "merge"]
    if merges:
        best = max(merges, key=lambda m: m[1])[0]
        over = "the family's languages" if family else "languages"
        print(f"\nbest merge (flexible accuracy averaged over {over}; best of {len(merges)}, so optimistic): "
              f"{best['recipe'] if family else best['name']}")


def _sweep_spec(args):
    """The sweep of the flag form (`--math --lang` plus a grid or the ablation suite), as a SweepSpec."""
    from layerswap.models.adapters import open_expert
    from layerswap.sweeps import ExpertSet, SweepSpec, TestSet, ablation_suite, swap_grid
    from layerswap.sweeps.spec import set_name

    fam = args.family
    if not (args.math and (args.lang or fam)):
        raise UserError("Give a sweep file (layerswap sweep SWEEP.yaml), or --math M --lang L for a grid or the "
                        "ablation suite (--lang CODE=L repeated: a family, each language scored on its own).")
    if fam is not None and args.langs:
        raise UserError(f"A family's languages are its codes ({', '.join(fam.codes)}); drop --langs.")
    test_data(args, args.math, *([m.ref for m in fam.members] if fam else [args.lang]), args.base)
    if fam is not None:
        from layerswap.serving.family import check_test_sets

        check_test_sets(fam, args.mgsm_dir)
        args.langs = ",".join(fam.codes)
    cfg = eval_config(args)
    L = open_expert(args.math, args.base).num_layers
    if args.suite == "grid":
        points = swap_grid(L, int_list(args.b_values, "--b-values"), int_list(args.u_values, "--u-values"),
                           int_list(args.t_values, "--t-values"), transition=args.transition or "flat",
                           non_layer=args.non_layer or "neighbour")
    else:
        points = ablation_suite(L, recipe_from(args, L).plan, with_base=args.base is not None)
    sets = ([ExpertSet(m.code, args.math, m.ref, args.base, args.force, (m.code,), "family") for m in fam.members]
            if fam is not None else [ExpertSet(set_name(args.math, args.lang), args.math, args.lang, args.base,
                                               args.force)])
    return SweepSpec(
        name=f"{args.suite} sweep",
        expert_sets=sets,
        points=points, test_sets=[TestSet(Path(cfg.source).name if cfg.source else "mgsm", cfg.source, tuple(cfg.langs))],
        eval={"limit": cfg.limit, "shots": cfg.shots, "mode": cfg.mode, "max_new_tokens": cfg.max_new_tokens},
        engine=asdict(engine_settings(args)),
        include_experts=not args.no_experts)
