"""`layerswap eval` over a family: `--math M --base B --lang CODE=L ... --methods swap,soup,ta,ties`.

Per language: the math expert, that language's expert, the swap and each baseline of `--methods`, on that
language's MGSM test set (`serving.family.evaluate_family`), as one table (`evaluation.table`) on stdout and in
`--json`, `--csv`, `--md` and `--plot` (rewritten after every language, so what is done is kept). The swap's plan
is shared: the plan flags (or `--recipe FILE`), with the values not given from each pair's recommended plan
(`organisms.opening_plan`); `--lang-recipe CODE=FILE` gives one language its own. Baselines take the method flags
(`--weight`, `--lambda`, `--density`, `--drop-rate`, `--expert-weights`, `--seed`). Everything cheap is checked
first (`serving.family.preflight`: cap, codes, test sets, every member's compatibility; recipes, outputs, data)."""

from __future__ import annotations

import sys

from layerswap.core.errors import UserError
from layerswap.models.family import split_spec
from layerswap.recipe.fields import FIELDS
from layerswap.recipe.recipes import Recipe

OUTPUTS = (("json", "--json"), ("csv", "--csv"), ("md", "--md"))
DEFAULT_METHODS = "swap,soup,ties"  # the paper's table: souping, TIES and the swap beside both experts


def family_options(p) -> None:
    g = p.add_argument_group("a family (--lang CODE=L repeated): the table per language")
    g.add_argument("--methods", help=f"the merges per language: a comma list of swap, soup, ta (task arithmetic), "
                   f"ties, dare (dare_linear), dare_ties (default {DEFAULT_METHODS}); ta, ties and dare need --base")
    g.add_argument("--lang-recipe", action="append", metavar="CODE=FILE",
                   help="this language's swap from a recipe file (a layer_swap recipe), instead of the shared plan; "
                        "repeatable")
    g.add_argument("--metric", choices=("flexible", "strict"), default="flexible",
                   help="the extraction the table scores (default flexible)")
    g.add_argument("--json", metavar="F", help="the table as JSON: per language and model n, correct, accuracy, "
                   "interval, p vs the better expert; the average; the recipes and the protocol")
    g.add_argument("--csv", metavar="F", help="the table as CSV (a row per model and language)")
    g.add_argument("--md", metavar="F", help="the table as Markdown (what stdout shows)")
    g.add_argument("--plot", metavar="F", help="the table as bars with intervals: .html or .png")


def _refuse_pair_options(args) -> None:
    if args.card:
        raise UserError("--card writes one merge's results; a family has a merge per language: drop --card.")
    if args.models != "math,lang,merged":
        raise UserError("A family evaluates both experts and the merges of --methods; drop --models.")
    if args.method is not None:
        raise UserError("A family's merges are --methods (e.g. --methods swap,soup,ties); drop --method.")
    if args.langs:
        raise UserError(f"A family's languages are its codes ({', '.join(args.family.codes)}); drop --langs.")
    if args.plot and not args.plot.lower().endswith((".html", ".htm", ".png")):
        raise UserError(f"--plot {args.plot}: give a file ending in .html or .png.")


def lang_recipes(args, codes: tuple[str, ...]) -> dict[str, Recipe]:
    """--lang-recipe CODE=FILE, each code a member's, once; each file a layer_swap recipe."""
    out: dict[str, Recipe] = {}
    for spec in args.lang_recipe or []:
        code, path = split_spec(spec)
        if code not in codes:
            raise UserError(f"--lang-recipe {spec}: write CODE=FILE with CODE one of the family's "
                            f"({', '.join(codes)}).")
        if code in out:
            raise UserError(f"--lang-recipe gives {code} twice; keep one.")
        out[code] = _swap_file(path, f"--lang-recipe {code}=")
    return out


def _swap_file(path: str, flag: str) -> Recipe:
    r = Recipe.load(path)
    if r.method.name != "layer_swap":
        raise UserError(f"{flag}{path} is a {r.method.name} recipe; it gives the swap, so it must be a layer_swap "
                        "recipe (the baselines are --methods).")
    return r


def family_recipes(args, num_layers: int, methods: list[tuple[str, str]]) -> dict[str, dict[str, Recipe]]:
    """Per code, the recipe of each --methods entry (label as given): the swap from --lang-recipe, --recipe or
    the plan flags over the pair's recommended plan; the baselines from the method flags."""
    from layerswap.shipped.organisms import opening_plan

    fam = args.family
    given = {f.name: getattr(args, f.dest) for f in FIELDS if getattr(args, f.dest, None) is not None}
    plan_given = [f.flag for f in FIELDS if f.plan and f.name in given and not f.method]
    if args.recipe and plan_given:
        raise UserError(f"--recipe {args.recipe} already says the swap's plan; drop {', '.join(plan_given)}.")
    own = lang_recipes(args, fam.codes)
    shared = _swap_file(args.recipe, "--recipe ") if args.recipe else None
    out = {}
    for m in fam.members:
        recipes = {}
        for label, name in methods:
            if name != "layer_swap":
                recipes[label] = Recipe.from_values(num_layers=num_layers, **{**given, "method": name})
            elif m.code in own or shared is not None:
                recipes[label] = own.get(m.code) or shared
            else:
                opening = opening_plan((fam.base or "", fam.math, m.ref), num_layers)
                recipes[label] = Recipe.from_values(num_layers=num_layers, defaults=opening.plan, **given)
        out[m.code] = recipes
    return out


def run_family(args) -> int:
    from layerswap.cli.options import Bar, check_outputs, data_inputs, engine_settings, eval_config, test_data
    from layerswap.models.presets import portable_ref
    from layerswap.recipe.methods import method_list
    from layerswap.serving.family import check_recipes, evaluate_family, preflight

    fam = args.family
    _refuse_pair_options(args)
    methods = method_list(args.methods or DEFAULT_METHODS)
    test_data(args, fam.math, *(m.ref for m in fam.members), fam.base)
    args.langs = ",".join(fam.codes)
    refs = (fam.math, fam.base, *(m.ref for m in fam.members))
    outs = [args.out, args.json, args.csv, args.md, args.plot]
    check_outputs(outs, extra=(*refs, *data_inputs(args)))
    checked = preflight(fam, args.mgsm_dir, force=args.force, threshold=args.base_distance_threshold)
    cfg = eval_config(args)  # every test set read and its prompts built: data errors before any model loads
    recipes = family_recipes(args, checked.num_layers, methods)
    check_recipes(fam, recipes, checked.num_layers, have_base=bool(fam.base))
    for code, line in checked.lines.items():
        print(f"{code}: {line}", file=sys.stderr)
    print(f"MGSM {cfg.mode}, {cfg.shots}-shot, greedy, {cfg.max_new_tokens} new tokens; "
          f"{'first ' + str(cfg.limit) if cfg.limit else 'all'} questions per language; {args.metric} accuracy (%) "
          "[exact 95% interval], p: exact McNemar against the better expert", file=sys.stderr)
    extra = {"protocol": {"mode": cfg.mode, "shots": cfg.shots, "max_new_tokens": cfg.max_new_tokens,
                          "limit": cfg.limit},
             "family": {"math": portable_ref(fam.math), "base": fam.base and portable_ref(fam.base),
                        "languages": {m.code: portable_ref(m.ref) for m in fam.members}},
             "recipes": {c: {label: r.to_dict() for label, r in rs.items()} for c, rs in recipes.items()}}

    def write(report):
        from layerswap.evaluation.table import family_table

        table = family_table(report, args.metric)
        for fmt, flag in OUTPUTS:
            path = getattr(args, fmt)
            if path:
                table.write(path, fmt, extra)
        if args.out:
            report.write_jsonl(args.out)
        return table

    bar = Bar(enabled=not args.quiet)
    report = evaluate_family(fam, recipes, cfg, engine_settings(args), force=args.force, progress=bar,
                             on_language=write, note=lambda text: print(text, file=sys.stderr))
    bar.done()
    table = write(report)
    print(table.markdown())
    if args.plot:
        from layerswap.analysis.plots import family_bars, save_figure

        save_figure(family_bars(table, title=f"MGSM {cfg.mode}, {cfg.shots}-shot: the family's table"), args.plot)
    written = [p for p in (args.json, args.csv, args.md, args.plot, args.out) if p]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0
