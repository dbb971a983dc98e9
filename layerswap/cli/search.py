"""`layerswap search`: find a layer-swap plan with an evaluation in the loop, chosen on dev questions and scored on
held-out ones (`layerswap.search`); resumable from its results file. `--json` prints the result as JSON on stdout
(as every command's `--json` does, `cli.options.json_options`; the summary and progress then go to stderr),
`--json-out FILE` writes it to a file.
Over a family (`--lang CODE=L` repeated: `cli.family_search`), each language's plan on its own dev questions and
a shared plan best on average."""

from __future__ import annotations

from layerswap.core.errors import UserError
from layerswap.cli.options import (Bar, check_outputs, data_inputs, emit_json, engine_options, engine_settings,
                                   eval_options, json_options, models, ray_options, say, test_data)


def add_parser(sub) -> None:
    s = sub.add_parser("search", help="find a plan: search b, u, tb, tu (and more) on dev questions, report it on "
                                      "held-out ones with exact intervals and McNemar against the experts")
    models(s, family=True)
    s.add_argument("--force", action="store_true", help="merge even if the experts seem not to share the base")
    s.add_argument("--budget", type=int, default=40, help="plans to evaluate (default 40); exhaustive when the space "
                                                         "holds no more")
    s.add_argument("--seed", type=int, default=0, help="the split's and the optimiser's seed (default 0)")
    s.add_argument("--dev", type=int, metavar="N", help="dev questions per language (default: those the models' own "
                   "plan was chosen on, from their dev file; else 40%% of the set, at most 400)")
    s.add_argument("--test", type=int, metavar="N", help="held-out questions (default: the rest of the set, or all of "
                                                         "it when the models bring a dev file)")
    s.add_argument("--strategy", choices=("auto", "exhaustive", "tpe"), default="auto",
                   help="auto (default): every plan when the space fits the budget, else Optuna TPE")
    s.add_argument("--no-halving", action="store_true", help="score every candidate on every dev question")
    s.add_argument("--first-rung", type=int, metavar="N", help="questions of the first rung (default max(10, dev/16))")
    s.add_argument("--z", type=float, default=2.0, help="a candidate stops when behind the best by more than z paired "
                                                        "standard errors (default 2)")
    g = s.add_argument_group("the space (default: b, u, tb, tu at any depth, every transition and non-layer choice)")
    g.add_argument("--max-b", type=int, help="at most this many bottom layers")
    g.add_argument("--max-u", type=int, help="at most this many top layers")
    g.add_argument("--max-t", type=int, help="at most this many transition layers at each end")
    g.add_argument("--transitions", default="flat:0.25,flat:0.5,flat:0.75,ramp",
                   help="transition choices: flat:W (W the language weight) and/or ramp")
    g.add_argument("--non-layer-choices", default="neighbour,math,lang,avg", help="non-layer choices to try")
    g.add_argument("--module-wise", action="store_true", help="also try the map on attention only or MLP only")
    g.add_argument("--revert-ranges", action="store_true", help="also try reverting a range of layers to the base")
    eval_options(s)
    s.set_defaults(max_new_tokens=None)  # the models' own choice's answer length, else the library's (256)
    engine_options(s)
    json_options(s, "the result (plan, dev, test, baselines, evaluated, split)")
    s.add_argument("-o", "--results", metavar="FILE", help="results file (JSONL; default: one shared by every search "
                                                          "on this machine, in the cache); a rerun resumes it")
    ray_options(s, "race candidates")
    s.add_argument("--shared-top", type=int, default=3, metavar="K",
                   help="a family (--lang CODE=L repeated): each language's K best plans race on every language's "
                        "dev questions for the shared plan (default 3)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=run)


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in str(text).split(",") if x.strip())


def run(args) -> int:
    from layerswap.models.presets import portable_ref
    from layerswap.search import default_results, for_models, search

    if args.limit is not None:
        raise UserError("A search splits the set itself: use --dev N and --test N instead of --limit.")
    fam = args.family
    if fam is not None and len(fam.members) > 1:
        from layerswap.cli.family_search import run_family_search

        return run_family_search(args, lambda langs: _config(args, langs))
    if fam is not None and not args.langs:  # one --lang CODE=L: a search of that pair on CODE's questions
        args.langs = fam.codes[0]
    test_data(args, args.math, args.lang, args.base)  # the models' own set and languages when not given
    data = args.mgsm_dir
    cfg = for_models(_config(args, list(_words(args.langs))), args.math, args.lang, args.base)
    results = args.results or str(default_results())
    check_outputs([args.json_out, results], extra=(args.math, args.lang, args.base, *data_inputs(args)))
    out = say(args)  # stdout holds only the JSON with --json
    print(f"search: {', '.join(cfg.langs)} from {data or 'the MGSM set'}, budget {cfg.budget} plans, seed {cfg.seed}, "
          f"answers of {cfg.evals()['max_new_tokens']} tokens; chosen on "
          + (f"the models' own dev file {portable_ref(cfg.dev_source)}" if cfg.dev_source
             else "questions drawn from the set")
          + f"; records in {results}", file=out)
    bar = Bar(enabled=not args.quiet)
    try:  # plain prompts unless --chat-template, as the page and the organisms' cards answer
        result = search(args.math, args.lang, args.base, cfg, results=results, engine=engine_settings(args, None),
                        force=args.force, progress=bar, workers=args.ray or 0, address=args.ray_address,
                        gpus_per_worker=args.ray_gpus)
    finally:
        bar.done()
    print(result.text(), file=out)
    emit_json(args, result.to_dict())
    return 0


def _config(args, langs: list[str]):
    """The `SearchConfig` the flags say, for `langs`."""
    from layerswap.search import SearchConfig

    data = args.mgsm_dir
    return SearchConfig(langs=langs, source=str(data) if data else None, budget=args.budget,
                        seed=args.seed, dev=args.dev, test=args.test, strategy=args.strategy,
                        halving=not args.no_halving, first_rung=args.first_rung, z=args.z, shots=args.shots,
                        mode=args.mode, max_new_tokens=args.max_new_tokens, max_b=args.max_b, max_u=args.max_u,
                        max_t=args.max_t, transitions=_words(args.transitions),
                        non_layer=_words(args.non_layer_choices), module_wise=args.module_wise,
                        revert=args.revert_ranges)
