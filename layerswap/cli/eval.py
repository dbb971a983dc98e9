"""`layerswap eval`: MGSM accuracy of a model, or of both experts and their merge, per language; or of a family
(`--lang CODE=L` repeated): per language, the math expert, that language's expert, the swap and the baselines of
`--methods`, with exact intervals and paired tests against the better expert (`evaluation.table`).

Its standard output is one Markdown table (`results_table`: a row per language and extraction; for a family
`FamilyTable.markdown`: a row per model, a column per language and the average); the engine, the plan, the
protocol and what was written go to stderr, so `layerswap eval ... > table.md` holds only the table."""

from __future__ import annotations

import sys
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.core.roles import ANSWERING, ROLE_NAMES
from layerswap.cli.family import family_options
from layerswap.cli.options import (Bar, check_outputs, data_inputs, engine_options, engine_settings, eval_config,
                                   eval_options, models, pairing_options, plan_note, print_recipe, recipe_from,
                                   recipe_options, test_data, workbench)


def add_parser(sub) -> None:
    s = sub.add_parser("eval", help="MGSM accuracy of a model (or of both experts and their merge), per language")
    s.add_argument("--model", metavar="M", help="model folder or Hub id to evaluate")
    models(s, optional="instead of --model, to evaluate the experts and their merge: ", family=True)
    s.add_argument("--models", default="math,lang,merged", help="with --math/--lang: which of math,lang,merged")
    family_options(s)
    recipe_options(s)
    pairing_options(s)
    eval_options(s)
    engine_options(s)
    s.add_argument("-o", "--out", help="per-question results as JSONL")
    s.add_argument("--card", metavar="OUT_DIR",
                   help="write the results into this export's model card (README.md, layerswap.json): with --model "
                        "OUT_DIR itself; with --math/--lang, the export of the same experts and recipe")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=run)


def run(args) -> int:
    from layerswap.engines import open_engine

    if args.family is not None and not args.model:
        from layerswap.cli.family import run_family

        return run_family(args)
    given = [f for f, v in (("--methods", args.methods), ("--lang-recipe", args.lang_recipe), ("--json", args.json),
                            ("--csv", args.csv), ("--md", args.md), ("--plot", args.plot)) if v]
    if given:
        raise UserError(f"{given[0]} is for a family: give each language expert with its code, --lang CODE=L "
                        "(repeat it for more languages).")
    if args.model and (args.math or args.lang or args.family):
        raise UserError("Give either --model M, or --math M --lang L (to evaluate the experts and their merge).")
    if not args.model and not (args.math and args.lang):
        raise UserError("Give --model M, or --math M --lang L to evaluate the experts and their merge.")
    test_data(args, args.model or args.math, args.lang, args.base)
    cfg = eval_config(args)
    check_outputs([args.out], extra=(args.model, args.math, args.lang, args.base, *data_inputs(args)))
    prov = _card_target(args)
    if args.model:
        s = engine_settings(args)
        engine, note = open_engine(args.model, engine=s.engine, device=s.device, settings=s.vllm(),
                                   use_chat_template=s.chat_template)
        engines = {Path(args.model).name or args.model: engine}
    else:
        roles = [r.strip() for r in args.models.split(",") if r.strip()]
        bad = [r for r in roles if r not in ANSWERING]
        if bad or not roles:
            raise UserError(f"--models takes a comma list of math, lang, merged (got {args.models!r}).")
        wb = workbench(args)
        wb.load(args.math, args.lang, args.base, force=args.force)
        recipe = recipe_from(args, wb.num_layers)
        if prov is not None:
            from layerswap.merge.card import check_same_merge

            check_same_merge(prov, args.card, wb.checkpoints, recipe)
        if "merged" in roles:
            wb.build(recipe)
            print_recipe(recipe, wb.num_layers, plan_note(args, wb.num_layers), file=sys.stderr)
        note = wb.engine_note
        engines = {ROLE_NAMES[r]: wb.engines[r] for r in roles}
    try:
        return _run_eval(args, cfg, engines, note)
    finally:
        if args.model:
            getattr(engine, "release", lambda: None)()  # back to the engine pool
        else:
            wb.close()


def _run_eval(args, cfg, engines: dict, note: str) -> int:
    from layerswap.evaluation.run import evaluate

    print(f"engine: {note}", file=sys.stderr)
    print(f"MGSM {cfg.mode}, {cfg.shots}-shot, greedy, {cfg.max_new_tokens} new tokens; languages "
          f"{', '.join(cfg.langs)}; {'first ' + str(cfg.limit) if cfg.limit else 'all'} questions each; accuracy (%)",
          file=sys.stderr)
    bar = Bar(enabled=not args.quiet)
    report = evaluate(engines, cfg, progress=bar)
    bar.done()
    print(results_table(report))
    if args.out:
        report.write_jsonl(args.out)
        print(f"wrote {len(report.results)} per-question results to {args.out}", file=sys.stderr)
    if args.card:
        from layerswap.merge.card import attach_eval

        attach_eval(args.card, report, model=report.models[0] if args.model else ROLE_NAMES["merged"])
        print(f"wrote the MGSM results into the model card of {args.card} (README.md, layerswap.json)",
              file=sys.stderr)
    return 0


def results_table(report) -> str:
    """The accuracies (%) as one Markdown table: per language (then the average and the max), a row for each
    extraction (flexible, then strict), a column per model."""
    head = ["language", "n", "extraction", *report.models]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for metric in ("flexible", "strict"):
        for r in report.table(metric):
            r = {**r, "extraction": metric}
            lines.append(" | ".join("–" if r[h] is None else str(r[h]) for h in head))
    return "\n".join(lines)


def _card_target(args) -> dict | None:
    """The provenance of the export `--card` names, checked before anything loads."""
    if not args.card:
        return None
    from layerswap.merge.card import read_provenance

    prov = read_provenance(args.card)
    if args.model and Path(args.model).resolve() != Path(args.card).resolve():
        raise UserError(f"--card writes the results of the model evaluated: give --model {args.card} --card "
                        f"{args.card} (or evaluate the experts and their merge with --math/--lang).")
    if not args.model and "merged" not in [r.strip() for r in args.models.split(",")]:
        raise UserError("--card needs the merge evaluated: keep merged in --models.")
    return prov
