"""The `layerswap` command line: inspect, merge, diff, ask.

Every user error ends with a one-line reason on stderr and exit status 2 (1 for an
incompatible `inspect`), never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

from .errors import UserError
from .plans import NON_LAYER_OPTIONS, TRANSITIONS, Plan, default_plan


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_size(s: str) -> int:
    """'5GB', '500MB', '2G', '1000000' -> bytes (decimal units, like HF's max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", s.upper())
    if not m:
        raise UserError(f"Cannot read size {s!r}; write e.g. 5GB, 500MB or a number of bytes.")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]
    if m.group(3) == "IB":
        mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
    return int(float(m.group(1)) * mult)


def _models(p: argparse.ArgumentParser, base_required: bool = False) -> None:
    p.add_argument("--math", required=True, metavar="M", help="math expert: local folder or Hub id")
    p.add_argument("--lang", required=True, metavar="L", help="language expert: local folder or Hub id")
    p.add_argument("--base", required=base_required, metavar="B", help="base model both experts were tuned from")


def _plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (defaults: the literature's b=5 u=2 tb=1 tu=1 at 32 layers, scaled to the model)")
    g.add_argument("--b", type=int, help="bottom layers taken from the language expert")
    g.add_argument("--u", type=int, help="top layers taken from the language expert")
    g.add_argument("--tb", type=int, help="bottom transition layers (blends)")
    g.add_argument("--tu", type=int, help="top transition layers (blends)")
    g.add_argument("--transition", choices=TRANSITIONS, default="flat",
                   help="flat: every transition layer uses --transition-weight; ramp: linear steps (default flat)")
    g.add_argument("--transition-weight", type=float, default=0.5, metavar="W",
                   help="language-expert weight of flat transition layers (default 0.5)")
    g.add_argument("--non-layer", choices=NON_LAYER_OPTIONS, default="neighbour",
                   help="embeddings / final norm / lm_head: neighbour (embeddings follow layer 0, norm and "
                        "lm_head follow the last layer), math, lang or avg (default neighbour)")


def _plan_from(args, num_layers: int) -> Plan:
    d = default_plan(num_layers)
    counts = {k: getattr(args, k) for k in ("b", "u", "tb", "tu")}
    if all(v is None for v in counts.values()):
        counts = {k: getattr(d, k) for k in counts}
    else:
        counts = {k: (v if v is not None else getattr(d, k)) for k, v in counts.items()}
    plan = Plan(**counts, transition=args.transition, transition_weight=args.transition_weight,
                non_layer=args.non_layer)
    plan.validate(num_layers)
    return plan


def _open(ref: str | None):
    from .checkpoints import Checkpoint

    return Checkpoint.open(ref) if ref else None


# ---- commands --------------------------------------------------------------------------------

def cmd_inspect(args) -> int:
    from .checkpoints import check_compatible

    rep = check_compatible(_open(args.math), _open(args.lang), _open(args.base))
    print(rep.summary())
    return 0 if rep.ok else 1


def cmd_merge(args) -> int:
    from .merging import export_merge

    math, lang, base = _open(args.math), _open(args.lang), _open(args.base)
    plan = _plan_from(args, math.num_layers)
    print(f"plan: b={plan.b} u={plan.u} tb={plan.tb} tu={plan.tu} transition={plan.transition} "
          f"non-layer={plan.non_layer} ({math.num_layers} layers)")
    print(textwrap.indent(plan.describe(math.num_layers), "  "))
    bar = _ProgressLine(enabled=not args.quiet)
    s = export_merge(math, lang, plan, args.out, base=base, device=args.device, overwrite=args.overwrite,
                     shard_bytes=parse_size(args.out_shard_size), progress=bar)
    bar.done()
    print(f"wrote {s.out} ({s.n_tensors} tensors: {s.n_copied} copied, {s.n_blended} blended; "
          f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard{'s' if s.shards > 1 else ''})")
    return 0


def cmd_diff(args) -> int:
    from .analysis import METRICS, PANEL_METRICS, PANELS, analyze, write_csv
    from .checkpoints import check_compatible
    from .plots import analysis_heatmaps, layer_profile, save_figure

    math, lang, base = _open(args.math), _open(args.lang), _open(args.base)
    check_compatible(math, lang, base).raise_if_bad()
    panels = [p.strip() for p in args.panels.split(",") if p.strip()]
    for p in panels:
        if p not in PANELS:
            raise UserError(f"Unknown panel {p!r}; choose from {', '.join(PANELS)}.")
    L = math.num_layers
    plan = None if args.no_plan else _plan_from(args, L)
    if plan is None:
        panels = [p for p in panels if not p.startswith("merged")]
    ks = args.k or [1.0]
    bar = _ProgressLine(enabled=not args.quiet)
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
        print(f"  {name:>16}: " + " ".join(_short(prof_metric, v) for v in vals))
    print("\noutside the layers:")
    for r in an.non_layer_rows(k, merged):
        extra = (f", top-{k:g}% share math {_short('topk', r['topk_share_math'])} lang "
                 f"{_short('topk', r['topk_share_lang'])}") if an.topk else ""
        print(f"  {r['tensor']}: relative change math {_short('relative', r['relative_math'])} lang "
              f"{_short('relative', r['relative_lang'])}{extra}")
    ranked = an.most_changed(2 * len(an.tensors), by=prof_metric, k=k)
    if args.top:
        print(f"\nmost-changed tensors by {METRICS[prof_metric].replace('top-k%', f'top-{k:g}%')}:")
        for r in ranked[:args.top]:
            print(f"  {r['rank']:>3}. {r['expert']:<16} {r['tensor']:<48} {_short(prof_metric, r[prof_metric])}")
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


def _short(metric: str, v) -> str:
    if v is None or v != v:
        return "-"
    return f"{100 * v:.3g}%" if metric in ("relative", "topk") else f"{v:.3g}"


def cmd_ask(args) -> int:
    from .workbench import Workbench

    if (args.question is None) == (args.index is None):
        raise UserError("Give either --question \"...\" or --mgsm-lang XX --index N.")
    wb = Workbench(device=args.device)
    wb.load(args.math, args.lang, args.base)
    plan = _plan_from(args, wb.num_layers)
    wb.build(plan)
    kw = dict(source=args.mgsm_dir, shots=args.shots, max_new_tokens=args.max_new_tokens)
    if args.question is not None:
        answers = wb.ask_question(args.question, args.mgsm_lang, **kw)
    else:
        answers = wb.ask_mgsm(args.mgsm_lang, args.index, **kw)
    print(f"plan: b={plan.b} u={plan.u} tb={plan.tb} tu={plan.tu} ({wb.num_layers} layers); "
          f"engine: {answers[0].engine}")
    print("prompt:\n" + textwrap.indent(answers[0].prompt, "  | "))
    if answers[0].gold is not None:
        print(f"gold answer: {answers[0].gold}")
    for a in answers:
        mark = "" if a.gold is None else ("  ✓" if a.scored.flexible_correct else "  ✗")
        print(f"\n== {a.model} ({a.seconds:.1f}s) — strict: {a.scored.strict}  flexible: {a.scored.flexible}{mark}")
        print(textwrap.indent(a.scored.output.strip() or "(empty)", "  "))
    return 0


class _ProgressLine:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self.last = -1

    def __call__(self, frac: float, desc: str) -> None:
        pct = int(frac * 100)
        if self.enabled and pct != self.last:
            self.last = pct
            sys.stderr.write(f"\r{pct:3d}% {desc[:70]:<70}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog="layerswap", description="Layer swapping: merge a math expert and a language expert.")
    p.add_argument("--version", action="version", version=f"layerswap {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    s = sub.add_parser("inspect", help="compatibility report (headers only, no weights read)")
    _models(s)
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("merge", help="build the layer-swapped model and write it as an HF folder")
    _models(s)
    _plan_args(s)
    s.add_argument("--device", default="cpu", help="where blended tensors are computed: cpu or cuda")
    s.add_argument("-o", "--out", required=True, help="output folder (must not exist, unless --overwrite)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    s.add_argument("--out-shard-size", default="5GB", help="maximum bytes per safetensors shard (default 5GB)")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=cmd_merge)

    s = sub.add_parser("diff", help="where each expert changed: heatmaps, profile, top tensors, suggested plan")
    _models(s, base_required=True)
    _plan_args(s)
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
    s.add_argument("--device", default="cpu", help="where the arithmetic runs: cpu or cuda")
    s.add_argument("--workers", type=int, default=1,
                   help="threads streaming their own share of the tensors (CPU: one per free core, with "
                        "OMP_NUM_THREADS=1; default 1)")
    s.add_argument("--cache-dir", help="analysis cache folder (default $LAYERSWAP_CACHE/analysis)")
    s.add_argument("--no-cache", action="store_true", help="neither read nor write the analysis cache")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=cmd_diff)

    s = sub.add_parser("ask", help="the same question to math expert, language expert and merged model")
    _models(s)
    _plan_args(s)
    s.add_argument("--question", help="free-text question (prompted in --mgsm-lang's MGSM format)")
    s.add_argument("--mgsm-lang", default="en", help="MGSM language code (default en)")
    s.add_argument("--index", type=int, help="MGSM question number (0-based) in --mgsm-lang")
    s.add_argument("--mgsm-dir", help="folder of mgsm_XX.tsv files (default: $LAYERSWAP_MGSM_DIR, else the Hub)")
    s.add_argument("--shots", type=int, default=0, choices=[0, 1, 2, 3, 4, 5, 6, 7, 8],
                   help="few-shot exemplars from exemplars.json (default 0, as lm-eval)")
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    s.set_defaults(fn=cmd_ask)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"layerswap {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
