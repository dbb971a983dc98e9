"""`layerswap export-yaml`: a recipe as the mergekit config (linear method) that reproduces layerswap's merge."""

from __future__ import annotations

import sys

from pathlib import Path

from layerswap.cli.options import check_outputs, models, open_trio, recipe_from, recipe_options


def add_parser(sub) -> None:
    s = sub.add_parser("export-yaml", help="the plan as a mergekit config (linear method) that reproduces the merge")
    models(s)
    recipe_options(s)
    s.add_argument("-o", "--out", default="-", help="YAML file (default: stdout)")
    s.set_defaults(fn=run)


def run(args) -> int:
    from layerswap.models.checkpoints import check_compatible
    from layerswap.merge.interop import mergekit_yaml

    math, lang, base = open_trio(args)
    check_compatible(math, lang, base).raise_if_bad()
    recipe = recipe_from(args, math.num_layers)
    check_outputs([args.out], math, lang, base)
    text = mergekit_yaml(math, lang, recipe, base)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out} (run: mergekit-yaml {args.out} OUT_DIR)")
    return 0
