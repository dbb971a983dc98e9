"""`layerswap lens`: the latent-language lens of math expert, language expert, merged model and base on one prompt.

    layerswap lens --math M --lang L [--base B] [plan flags | --recipe F] (--mgsm-lang sw --index 3 |
                   --mgsm-lang sw --question TEXT [--twin TEXT]) [--batch 32] [--answer-tokens N]
                   [--forward auto|memory|stream] -o lens.html [--json] [--json-out lens.json] [--plot lens.png]

`--json` prints the numbers as JSON on stdout and nothing else there (the rest goes to stderr), as every command's
`--json` does (`options.json_options`); `--json-out FILE` writes them to FILE.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.analysis.lens.run import FORWARD_CHOICES
from layerswap.cli import options as o


def add_parser(sub) -> None:
    s = sub.add_parser("lens", help="logit lens and cross-lingual alignment of each model, layer by layer, on one "
                                    "prompt (streamed from the files when the models do not fit in memory)")
    o.models(s)
    o.recipe_options(s)
    g = s.add_argument_group("prompt")
    g.add_argument("--mgsm-lang", required=True, metavar="XX", help="target language (MGSM code, e.g. sw; not en)")
    g.add_argument("--index", type=int, help="MGSM question number (0-based); its English twin is the same number")
    g.add_argument("--question", help="free-text question instead (prompted in --mgsm-lang's MGSM format)")
    g.add_argument("--twin", help="with --question: its English version, for the cosine alignment")
    g.add_argument("--mgsm-dir", help="with English beside the language: " + o.MGSM_DIR_HELP)
    o.mode_option(g)
    g.add_argument("--chat-template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    g = s.add_argument_group("lens")
    g.add_argument("--batch", type=int, default=32, help="parallel questions for CKA, from the question on (default 32)")
    g.add_argument("--answer-tokens", type=int, default=0, metavar="N",
                   help="also lens each position of each model's greedy answer, up to N tokens (default 0)")
    g.add_argument("--top", type=int, default=5, help="top tokens per layer (default 5)")
    g.add_argument("--models", default="math,lang,merged,base",
                   help="comma list of math, lang, merged, base (base only with --base; default all)")
    g.add_argument("--forward", choices=FORWARD_CHOICES, default="auto",
                   help="memory, or stream block by block from the files (auto: stream when the experts do not fit)")
    g.add_argument("--device", default="auto", help=o.DEVICE_HELP)
    s.add_argument("-o", "--out", help="HTML report (figures, rule, numbers)")
    o.json_options(s, "the numbers (issue 22's schema)")
    s.add_argument("--plot", action="append", default=[],
                   help="figures (.png or .html), suffixed -curves and -grid (repeat for several)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from layerswap.analysis.lens import ROLES, LensConfig, lens_curves, lens_grid, run_lens, write_report
    from layerswap.analysis.plots import save_figure

    if (args.question is None) == (args.index is None):
        raise UserError("Give either --index N (an MGSM question) or --question \"...\".")
    roles = tuple(r.strip() for r in args.models.split(",") if r.strip())
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise UserError(f"--models takes a comma list of {', '.join(ROLES)} (got {args.models!r}).")
    o.test_data(args, args.math, args.lang, args.base)
    config = LensConfig(args.mgsm_lang, index=args.index, question=args.question, twin=args.twin, batch=args.batch,
                        answer_tokens=args.answer_tokens, source=args.mgsm_dir, mode=args.mode,
                        chat_template=args.chat_template, top=args.top)
    config.validate()  # a language the set does not hold is refused here, before any model loads
    math, lang, base = o.open_trio(args)
    plots = [Path(p) for p in args.plot]
    for p in [args.out, args.json_out, *args.plot]:
        if p and Path(p).suffix.lower() not in (".html", ".htm", ".json", ".png", ".svg", ".pdf"):
            raise UserError(f"{p}: write the report as .html, the numbers as .json and figures as .png or .html.")
    o.check_outputs([args.out, args.json_out, *args.plot], math, lang, base,
                    extra=o.data_inputs(args))
    recipe = o.recipe_from(args, math.num_layers)
    say = o.say(args)  # stdout holds only the JSON with --json
    o.print_recipe(recipe, math.num_layers, o.plan_note(args, math.num_layers), file=say)
    bar = o.Bar(enabled=not args.quiet)
    try:
        res = run_lens(math, lang, recipe, base=base, config=config, device=args.device, forward=args.forward,
                       roles=roles, progress=bar)
    finally:
        bar.done()
    print(f"{res.language_name} prompt" + (f" (MGSM question {res.index})" if res.index is not None else "") + ":",
          file=say)
    print("  " + res.prompt.replace("\n", "\n  "), file=say)
    print(f"token classes: {res.rule}", file=say)
    print("layer: top token (p) | P(target) P(English) P(digits) | cosine CKA   (layer: after layer; emb = embeddings)",
          file=say)
    fmt = lambda v: "  -  " if v is None else f"{v:.3f}"  # noqa: E731
    for m in res.models.values():
        how = "streamed" if m.streamed else "in memory"
        print(f"\n== {m.name} ({how}, {m.seconds:.1f} s)" + (f": answers {m.answer.text!r}" if m.answer else ""),
              file=say)
        for x in m.layers:
            tok, p = x.top[0]
            print(f"  {'emb' if x.layer == 0 else x.layer - 1:>4}: {tok.strip()[:14] or repr(tok):<14} ({p:.2f}) | "
                  f"{x.p_target:.3f} {x.p_english:.3f} {x.p_digits:.3f} | {fmt(x.alignment)} {fmt(x.cka)}", file=say)
    if args.out:
        write_report(res, args.out)
        print(f"wrote {args.out}", file=say)
    figs = {"curves": lens_curves(res), "grid": lens_grid(res)}
    for path in plots:
        for kind, fig in figs.items():
            target = path.with_name(f"{path.stem}-{kind}{path.suffix}")
            save_figure(fig, target)
            print(f"wrote {target}", file=say)
    o.emit_json(args, res.to_json())
    return 0
