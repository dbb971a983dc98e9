"""`layerswap ask`: the same question to the math expert, the language expert and their merge."""

from __future__ import annotations

import textwrap

from layerswap.evaluation import mgsm
from layerswap.core.errors import UserError
from layerswap.cli.options import (MGSM_DIR_HELP, engine_options, models, pairing_options, plan_note, print_recipe,
                                   recipe_from, recipe_options, shots_option, test_data, workbench)


def add_parser(sub) -> None:
    s = sub.add_parser("ask", help="the same question to math expert, language expert and merged model")
    models(s)
    recipe_options(s)
    pairing_options(s)
    s.add_argument("--question", help="free-text question (prompted in --mgsm-lang's MGSM format)")
    s.add_argument("--mgsm-lang", default="en", help="MGSM language code (default en)")
    s.add_argument("--index", type=int, help="MGSM question number (0-based) in --mgsm-lang")
    s.add_argument("--mgsm-dir", help=MGSM_DIR_HELP)
    shots_option(s)
    s.add_argument("--max-new-tokens", type=int, default=mgsm.TASK.max_new_tokens)
    engine_options(s)
    s.set_defaults(fn=run)


def run(args) -> int:
    if (args.question is None) == (args.index is None):
        raise UserError("Give either --question \"...\" or --mgsm-lang XX --index N.")
    test_data(args, args.math, args.lang, args.base)
    mgsm.check_languages([args.mgsm_lang], args.mgsm_dir)  # before any model loads
    wb = workbench(args, chat_template=None)
    try:
        wb.load(args.math, args.lang, args.base, force=args.force)
        recipe = recipe_from(args, wb.num_layers)
        wb.build(recipe)
        kw = dict(source=args.mgsm_dir, shots=args.shots, max_new_tokens=args.max_new_tokens)
        if args.question is not None:
            answers = wb.ask_question(args.question, args.mgsm_lang, **kw)
        else:
            answers = wb.ask_mgsm(args.mgsm_lang, args.index, **kw)
        print_recipe(recipe, wb.num_layers, plan_note(args, wb.num_layers))
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
