"""The command line's commands: each turns parsed options into library calls and prints the result."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from ..errors import UserError
from ..recipes import Recipe
from ..roles import ANSWERING, ROLE_NAMES
from ..sources import Sources
from .options import Bar, eval_config, int_list, parse_size, recipe_from


def _open(ref: str | None):
    from ..checkpoints import Checkpoint

    return Checkpoint.open(ref) if ref else None


def _open_trio(args):
    """Open base first, so adapters given as experts merge into it."""
    from ..adapters import open_expert

    base = _open(args.base)
    return open_expert(args.math, args.base), open_expert(args.lang, args.base), base


def _check_files(outs, *checkpoints, extra=()) -> None:
    """Refuse file outputs that are, or sit inside, an input, before any long work starts."""
    from ..outputs import check_output_file, input_paths

    inputs = input_paths(*checkpoints, extra=extra)
    for out in outs:
        if out and out != "-":
            check_output_file(out, inputs)


def _mgsm_dir(args) -> tuple:
    source = getattr(args, "mgsm_dir", None)
    return (source,) if source and Path(source).is_dir() else ()


def cmd_inspect(args) -> int:
    from ..checkpoints import check_compatible, check_pairing

    math, lang, base = _open_trio(args)
    rep = check_compatible(math, lang, base)
    print(rep.summary())
    if rep.ok:
        pairing = check_pairing(math, lang, base, args.base_distance_threshold)
        print(("  warning: " if pairing.suspicious else "  ") + pairing.message())
        return 1 if pairing.suspicious else 0
    return 1


def cmd_merge(args) -> int:
    from ..merging import export_merge

    if args.push_to:  # a bad repo id or no network is said before a long merge, not after
        from ..hub import hub_reachable
        from ..publish import check_repo_id

        check_repo_id(args.push_to)
        if not hub_reachable():
            raise UserError("--push-to needs the Hugging Face Hub, which is not reachable from this machine; "
                            "merge without it now and run `layerswap push` later.")
    math, lang, base = _open_trio(args)
    recipe = recipe_from(args, math.num_layers)
    _print_recipe(recipe, math.num_layers)
    bar = Bar(enabled=not args.quiet)
    s = export_merge(math, lang, recipe, args.out, base=base, device=args.device,
                     overwrite=args.overwrite, shard_bytes=parse_size(args.out_shard_size), force=args.force,
                     base_distance_threshold=args.base_distance_threshold, progress=bar,
                     languages=args.languages.split(",") if args.languages else None)
    bar.done()
    if s.pairing is not None and s.pairing.suspicious:
        print("warning (--force): " + s.pairing.message().replace("; pass --force to run it anyway", ""))
    print(f"wrote {s.out} ({s.n_tensors} tensors: {s.n_copied} copied, {s.n_blended} computed; "
          f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard{'s' if s.shards > 1 else ''})")
    if args.push_to:
        _push(s.out, args.push_to, private=args.private, revision=None, overwrite=False, quiet=args.quiet)
    return 0


def _push(folder, repo_id: str, *, private: bool, revision: str | None, overwrite: bool, quiet: bool) -> None:
    from ..publish import push

    bar = Bar(enabled=not quiet)
    r = push(folder, repo_id, token=None, allow_ambient_token=True, private=private, revision=revision, overwrite=overwrite, progress=bar)
    bar.done()
    print(f"pushed {folder} to {r.url}: {len(r.uploaded)} files sent ({r.bytes_sent / 1e6:.1f} MB), "
          f"{len(r.unchanged)} unchanged" + (f"; commit {r.commit_url}" if r.commit_url else "; nothing new to commit"))


def cmd_push(args) -> int:
    _push(args.folder, args.repo_id, private=args.private, revision=args.revision, overwrite=args.overwrite,
          quiet=args.quiet)
    return 0


def _print_recipe(recipe: Recipe, num_layers: int) -> None:
    if recipe.plan is not None:
        print(f"plan: {recipe.plan.title()} ({num_layers} layers)")
        print(textwrap.indent(Sources(recipe, num_layers).describe(), "  "))
    else:
        print(f"method: {recipe.method.describe()}")


def cmd_export_yaml(args) -> int:
    from ..checkpoints import check_compatible
    from ..interop import mergekit_yaml

    math, lang, base = _open_trio(args)
    check_compatible(math, lang, base).raise_if_bad()
    recipe = recipe_from(args, math.num_layers)
    _check_files([args.out], math, lang, base)
    text = mergekit_yaml(math, lang, recipe, base)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out} (run: mergekit-yaml {args.out} OUT_DIR)")
    return 0


def cmd_diff(args) -> int:
    from ..analysis import METRICS, PANEL_METRICS, PANELS, analyze, format_value, write_csv
    from ..checkpoints import check_compatible
    from ..plots import analysis_heatmaps, layer_profile, save_figure

    math, lang, base = _open(args.math), _open(args.lang), _open(args.base)
    check_compatible(math, lang, base).raise_if_bad()
    _check_files([*args.out, *args.profile, args.csv, args.top_csv], math, lang, base)
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
    print(f"\nsuggested plan: b={s.plan.b} u={s.plan.u} tb={s.plan.tb} tu={s.plan.tu}  (layers dominated by the "
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


def _workbench(args, chat_template: bool | None = False):
    """The session behind ask, eval and sweep, from the engine options (`chat_template`: the default
    when --chat-template is not given; None uses the tokenizer's template when it has one)."""
    from ..engines import VLLMSettings
    from ..workbench import Workbench

    return Workbench(device=args.device, engine=args.engine, serving=args.serving,
                     vllm=VLLMSettings(max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size),
                     chat_template=True if args.chat_template else chat_template)


def cmd_ask(args) -> int:
    if (args.question is None) == (args.index is None):
        raise UserError("Give either --question \"...\" or --mgsm-lang XX --index N.")
    wb = _workbench(args, chat_template=None)
    try:
        wb.load(args.math, args.lang, args.base, force=args.force)
        recipe = recipe_from(args, wb.num_layers)
        wb.build(recipe)
        kw = dict(source=args.mgsm_dir, shots=args.shots, max_new_tokens=args.max_new_tokens)
        if args.question is not None:
            answers = wb.ask_question(args.question, args.mgsm_lang, **kw)
        else:
            answers = wb.ask_mgsm(args.mgsm_lang, args.index, **kw)
        _print_recipe(recipe, wb.num_layers)
        print(f"engine: {wb.engine_note or answers[0].engine}")
    finally:
        wb.close()
    print("prompt:\n" + textwrap.indent(answers[0].prompt, "  | "))
    if answers[0].gold is not None:
        print(f"gold answer: {answers[0].gold}")
    for a in answers:
        mark = "" if a.gold is None else ("  ✓" if a.scored.flexible_correct else "  ✗")
        print(f"\n== {a.model} ({a.seconds:.1f}s) — strict: {a.scored.strict}  flexible: {a.scored.flexible}{mark}")
        print(textwrap.indent(a.scored.output.strip() or "(empty)", "  "))
    return 0


def cmd_eval(args) -> int:
    from ..engines import VLLMSettings, open_engine

    if args.model and (args.math or args.lang):
        raise UserError("Give either --model M, or --math M --lang L (to evaluate the experts and their merge).")
    if not args.model and not (args.math and args.lang):
        raise UserError("Give --model M, or --math M --lang L to evaluate the experts and their merge.")
    cfg = eval_config(args)
    _check_files([args.out], extra=(args.model, args.math, args.lang, args.base, *_mgsm_dir(args)))
    prov = _card_target(args)
    if args.model:
        engine, note = open_engine(args.model, engine=args.engine, device=args.device,
                                   settings=VLLMSettings(max_model_len=args.max_model_len,
                                                         tensor_parallel_size=args.tensor_parallel_size),
                                   use_chat_template=bool(args.chat_template))
        engines = {Path(args.model).name or args.model: engine}
    else:
        roles = [r.strip() for r in args.models.split(",") if r.strip()]
        bad = [r for r in roles if r not in ANSWERING]
        if bad or not roles:
            raise UserError(f"--models takes a comma list of math, lang, merged (got {args.models!r}).")
        wb = _workbench(args)
        wb.load(args.math, args.lang, args.base, force=args.force)
        recipe = recipe_from(args, wb.num_layers)
        if prov is not None:
            from ..card import check_same_merge

            check_same_merge(prov, args.card, wb.checkpoints, recipe)
        if "merged" in roles:
            wb.build(recipe)
            _print_recipe(recipe, wb.num_layers)
        note = wb.engine_note
        engines = {ROLE_NAMES[r]: wb.engines[r] for r in roles}
    try:
        return _run_eval(args, cfg, engines, note)
    finally:
        if args.model:
            getattr(engine, "release", lambda: None)()  # back to the engine pool
        else:
            wb.close()


def _sweep_spec(args):
    """The sweep of the flag form (`--math --lang` plus a grid or the ablation suite), as a SweepSpec."""
    from ..adapters import open_expert
    from ..sweeps import ExpertSet, SweepSpec, TestSet, ablation_suite, swap_grid

    if not (args.math and args.lang):
        raise UserError("Give a sweep file (layerswap sweep SWEEP.yaml), or --math M --lang L for a grid or the "
                        "ablation suite.")
    cfg = eval_config(args)
    L = open_expert(args.math, args.base).num_layers
    if args.suite == "grid":
        points = swap_grid(L, int_list(args.b_values, "--b-values"), int_list(args.u_values, "--u-values"),
                           int_list(args.t_values, "--t-values"), transition=args.transition or "flat",
                           non_layer=args.non_layer or "neighbour")
    else:
        points = ablation_suite(L, recipe_from(args, L).plan, with_base=args.base is not None)
    return SweepSpec(
        name=f"{args.suite} sweep", expert_sets=[ExpertSet("experts", args.math, args.lang, args.base, args.force)],
        points=points, test_sets=[TestSet(Path(cfg.source).name if cfg.source else "mgsm", cfg.source, tuple(cfg.langs))],
        eval={"limit": cfg.limit, "shots": cfg.shots, "mode": cfg.mode, "max_new_tokens": cfg.max_new_tokens},
        engine={"engine": args.engine, "device": args.device, "serving": args.serving,
                "chat_template": bool(args.chat_template), "max_model_len": args.max_model_len,
                "tensor_parallel_size": args.tensor_parallel_size},
        include_experts=not args.no_experts)


def cmd_sweep(args) -> int:
    from ..sweeps import load_spec, run_sweep, with_eval
    from ..sweeps.report import stats_table, sweep_figures, table_text, write_csv, write_html

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
    _check_files([out, *csv_out, args.html, *(args.plot or [])], extra=tuple(inputs))  # before any point runs
    n = len(spec.points)
    print(f"{spec.name}: {n} recipe{'s' if n != 1 else ''} x {len(spec.expert_sets)} expert set(s) x "
          f"{len(spec.test_sets)} test set(s); MGSM {spec.eval.get('mode', 'native_cot')}, "
          f"{spec.eval.get('shots', 0)}-shot, " + ("first " + str(spec.eval['limit']) if spec.eval.get("limit") else "all")
          + " questions" + (f"; results in {out}" if out else ""))
    bar = Bar(enabled=not args.quiet)
    try:
        if args.ray:
            from ..sweeps.ray import run_sweep_ray

            if not out:
                raise UserError("--ray writes to a results file: add -o RESULTS.jsonl.")
            run = run_sweep_ray(spec, out, actors=args.ray, progress=bar, gpus_per_actor=args.ray_gpus)
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
    merges = [r for r in run.rows if r["kind"] == "merge"]
    if merges:
        from ..sweeps.report import scores

        best = max(merges, key=lambda r: scores(r)["average"])
        print(f"\nbest merge (average flexible accuracy; best of {len(merges)}, so optimistic): {best['name']}")
    for path in csv_out:
        write_csv(run.rows, path)
        print(f"wrote {path}")
    if args.html:
        write_html(run.rows, args.html, title=spec.name)
        print(f"wrote {args.html}")
    if args.plot:
        from ..plots import save_figure

        figs = dict(sweep_figures(run.rows))
        for path in args.plot:
            stem = Path(path)
            for kind, fig in figs.items():
                target = stem if len(figs) == 1 else stem.with_name(f"{stem.stem}-{kind}{stem.suffix}")
                save_figure(fig, target)
                print(f"wrote {target}")
    return 0


def cmd_lm_eval(args) -> int:
    from ..lmeval import LmEvalConfig, evaluate_model, evaluate_recipe
    from ..sweeps.records import experts_identity, lm_eval_record
    from ..runtime import resolve_device

    cfg = LmEvalConfig(tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], include_path=args.include_path,
                       limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                       backend=args.backend, device=resolve_device(args.device, ("cpu", "cuda")))
    cfg.validate()
    target = Path(args.target)
    if target.suffix.lower() in (".yaml", ".yml", ".json") and target.is_file():
        if not (args.math and args.lang):
            raise UserError(f"{args.target} is a recipe: give --math and --lang (and --base) to merge it first.")
        math, lang, base = _open_trio(args)
        recipe = Recipe.load(target)
        recipe.validate(math.num_layers)
        _print_recipe(recipe, math.num_layers)
        metrics = evaluate_recipe(math, lang, base, recipe, cfg, force=args.force, keep=args.keep)
        cks = {"math": math, "lang": lang, **({"base": base} if base is not None else {})}
        rec = lm_eval_record(experts_identity(cks), recipe.to_dict(), args.name or target.stem, cfg.settings(),
                             metrics, args.force)
    else:
        if args.math or args.lang:
            raise UserError(f"{args.target} is a model; --math/--lang are for a recipe file.")
        metrics = evaluate_model(args.target, cfg)
        rec = lm_eval_record(experts_identity({"model": _open(args.target)}), None, args.name or target.name,
                             cfg.settings(), metrics)
    for task, ms in metrics.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in ms.items()))
    if args.out:
        import json

        Path(args.out).write_text(json.dumps(metrics, indent=2))
        print(f"wrote {args.out}")
    if args.sweep_results:
        from ..sweeps.log import ResultsLog

        with ResultsLog(args.sweep_results) as log:
            log.append(rec)
        print(f"appended to {args.sweep_results} (joined to the same recipe's row in its table)")
    return 0


def _run_eval(args, cfg, engines: dict, note: str) -> int:
    from ..evaluation import evaluate

    print(f"engine: {note}")
    print(f"MGSM {cfg.mode}, {cfg.shots}-shot, greedy, {cfg.max_new_tokens} new tokens; languages "
          f"{', '.join(cfg.langs)}; {'first ' + str(cfg.limit) if cfg.limit else 'all'} questions each")
    bar = Bar(enabled=not args.quiet)
    report = evaluate(engines, cfg, progress=bar)
    bar.done()
    for metric in ("flexible", "strict"):
        print(f"\naccuracy (%), {metric} extraction:")
        print(report.table_text(metric))
    if args.out:
        report.write_jsonl(args.out)
        print(f"\nwrote {len(report.results)} per-question results to {args.out}")
    if args.card:
        from ..card import attach_eval

        attach_eval(args.card, report, model=report.models[0] if args.model else ROLE_NAMES["merged"])
        print(f"wrote the MGSM results into the model card of {args.card} (README.md, layerswap.json)")
    return 0


def _card_target(args) -> dict | None:
    """The provenance of the export `--card` names, checked before anything loads."""
    if not args.card:
        return None
    from ..card import read_provenance

    prov = read_provenance(args.card)
    if args.model and Path(args.model).resolve() != Path(args.card).resolve():
        raise UserError(f"--card writes the results of the model evaluated: give --model {args.card} --card "
                        f"{args.card} (or evaluate the experts and their merge with --math/--lang).")
    if not args.model and "merged" not in [r.strip() for r in args.models.split(",")]:
        raise UserError("--card needs the merge evaluated: keep merged in --models.")
    return prov


def cmd_app(args) -> int:
    from ..ui.launch import run

    return run(args)
