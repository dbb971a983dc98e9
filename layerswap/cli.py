"""The `layerswap` command line: inspect, merge, diff, ask, eval.

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
from .methods import METHODS, MethodConfig
from .plans import KINDS, MODULES, NON_LAYER_OPTIONS, TRANSITIONS, Plan, default_plan


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
    g = p.add_argument_group("other layer maps (ablations)")
    g.add_argument("--map", choices=KINDS, default="swap",
                   help="swap (b/u/tb/tu, default), weights (--layer-weights), middle / random (--map-k), alternating")
    g.add_argument("--layer-weights", metavar="W0,W1,...", help="language-expert weight of every layer (--map weights)")
    g.add_argument("--map-k", type=int, default=0, help="number of layers from the language expert (--map middle/random)")
    g.add_argument("--offset", type=int, default=0, choices=[0, 1], help="first language layer (--map alternating)")
    g.add_argument("--modules", choices=MODULES, default="all",
                   help="apply the map to attention only or MLP only; the rest stays with the math expert")
    g.add_argument("--seed", type=int, default=0, help="seed for --map random and DARE (default 0)")


def _method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("merge method (default layer_swap; the others are the paper's baselines)")
    g.add_argument("--method", choices=list(METHODS), default="layer_swap")
    g.add_argument("--weight", type=float, default=0.5, help="soup: language expert's share (default 0.5)")
    g.add_argument("--expert-weights", default="1,1", metavar="WM,WL",
                   help="task arithmetic / TIES / DARE: weights of the math and language task vectors (default 1,1)")
    g.add_argument("--lambda", dest="lam", type=float, default=1.0, help="task-vector scale (default 1.0)")
    g.add_argument("--density", type=float, default=0.2, help="TIES: fraction of each task vector kept (default 0.2)")
    g.add_argument("--drop-rate", type=float, default=0.9, help="DARE: drop probability (default 0.9)")


def _floats(s: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(","))
    except ValueError:
        raise UserError(f"{what} takes comma-separated numbers, e.g. 1,1,0.5,0 (got {s!r}).") from None


def _plan_from(args, num_layers: int, validate: bool = True) -> Plan:
    d = default_plan(num_layers)
    counts = {k: getattr(args, k) for k in ("b", "u", "tb", "tu")}
    if all(v is None for v in counts.values()):
        counts = {k: getattr(d, k) for k in counts}
    else:
        counts = {k: (v if v is not None else getattr(d, k)) for k, v in counts.items()}
    kind = getattr(args, "map", "swap")
    weights = _floats(args.layer_weights, "--layer-weights") if getattr(args, "layer_weights", None) else None
    if weights is not None and kind == "swap":
        kind = "weights"
    plan = Plan(**counts, transition=args.transition, transition_weight=args.transition_weight,
                non_layer=args.non_layer, kind=kind, weights=weights, k=getattr(args, "map_k", 0),
                seed=getattr(args, "seed", 0), offset=getattr(args, "offset", 0),
                modules=getattr(args, "modules", "all"))
    if validate:
        plan.validate(num_layers)
    return plan


def _method_from(args) -> MethodConfig:
    ew = _floats(args.expert_weights, "--expert-weights")
    if len(ew) != 2:
        raise UserError("--expert-weights takes two numbers: math, language (e.g. 1,1).")
    m = MethodConfig(name=args.method, weight=args.weight, expert_weights=ew, lam=args.lam, density=args.density,
                     drop_rate=args.drop_rate, seed=args.seed)
    m.validate()
    return m


def _pairing_args(p: argparse.ArgumentParser, force: bool = True) -> None:
    from .checkpoints import BASE_DISTANCE_THRESHOLD

    p.add_argument("--base-distance-threshold", type=float, default=BASE_DISTANCE_THRESHOLD,
                   help="largest sampled relative distance of an expert from the base before the pair is "
                        f"treated as not sharing it (default {BASE_DISTANCE_THRESHOLD})")
    if force:
        p.add_argument("--force", action="store_true", help="merge even if the experts seem not to share the base")


def _open(ref: str | None):
    from .checkpoints import Checkpoint

    return Checkpoint.open(ref) if ref else None


# ---- commands --------------------------------------------------------------------------------

def _open_trio(args):
    """Open base first, so adapters given as experts merge into it."""
    from .adapters import open_expert

    base = _open(args.base)
    return open_expert(args.math, args.base), open_expert(args.lang, args.base), base


def cmd_inspect(args) -> int:
    from .checkpoints import check_compatible, check_pairing

    math, lang, base = _open_trio(args)
    rep = check_compatible(math, lang, base)
    print(rep.summary())
    if rep.ok:
        pairing = check_pairing(math, lang, base, args.base_distance_threshold)
        print(("  warning: " if pairing.suspicious else "  ") + pairing.message())
        return 1 if pairing.suspicious else 0
    return 1


def cmd_merge(args) -> int:
    from .merging import export_merge

    math, lang, base = _open_trio(args)
    method = _method_from(args)
    plan = _plan_from(args, math.num_layers, validate=method.spec.uses_plan)
    _print_recipe(plan, method, math.num_layers)
    bar = _ProgressLine(enabled=not args.quiet)
    s = export_merge(math, lang, plan, args.out, method=method, base=base, device=args.device,
                     overwrite=args.overwrite, shard_bytes=parse_size(args.out_shard_size), force=args.force,
                     base_distance_threshold=args.base_distance_threshold, progress=bar)
    bar.done()
    if s.pairing is not None and s.pairing.suspicious:
        print("warning (--force): " + s.pairing.message().replace("; pass --force to run it anyway", ""))
    print(f"wrote {s.out} ({s.n_tensors} tensors: {s.n_copied} copied, {s.n_blended} computed; "
          f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard{'s' if s.shards > 1 else ''})")
    return 0


def _print_recipe(plan: Plan, method: MethodConfig, num_layers: int) -> None:
    if method.spec.uses_plan:
        print(f"plan: {plan.title()} ({num_layers} layers)")
        print(textwrap.indent(plan.describe(num_layers), "  "))
    else:
        print(f"method: {method.describe()}")


def cmd_export_yaml(args) -> int:
    from .checkpoints import check_compatible
    from .interop import mergekit_yaml

    math, lang, base = _open_trio(args)
    check_compatible(math, lang, base).raise_if_bad()
    method = _method_from(args)
    plan = _plan_from(args, math.num_layers, validate=method.spec.uses_plan)
    text = mergekit_yaml(math, lang, plan, method)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out} (run: mergekit-yaml {args.out} OUT_DIR)")
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
    method = _method_from(args)
    wb.load(args.math, args.lang, args.base, force=args.force)
    plan = _plan_from(args, wb.num_layers, validate=method.spec.uses_plan)
    wb.build(plan, method)
    kw = dict(source=args.mgsm_dir, shots=args.shots, max_new_tokens=args.max_new_tokens)
    if args.question is not None:
        answers = wb.ask_question(args.question, args.mgsm_lang, **kw)
    else:
        answers = wb.ask_mgsm(args.mgsm_lang, args.index, **kw)
    _print_recipe(plan, method, wb.num_layers)
    print(f"engine: {wb.engine_note or answers[0].engine}")
    print("prompt:\n" + textwrap.indent(answers[0].prompt, "  | "))
    if answers[0].gold is not None:
        print(f"gold answer: {answers[0].gold}")
    for a in answers:
        mark = "" if a.gold is None else ("  ✓" if a.scored.flexible_correct else "  ✗")
        print(f"\n== {a.model} ({a.seconds:.1f}s) — strict: {a.scored.strict}  flexible: {a.scored.flexible}{mark}")
        print(textwrap.indent(a.scored.output.strip() or "(empty)", "  "))
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MGSM evaluation (lm-eval mgsm_native_cot protocol by default)")
    g.add_argument("--langs", default="sw,te,bn,ja", help="comma list of MGSM language codes (default sw,te,bn,ja)")
    g.add_argument("--limit", type=int, help="first N questions per language (default: all 250)")
    g.add_argument("--shots", type=int, default=0, choices=[0, 1, 2, 3, 4, 5, 6, 7, 8],
                   help="few-shot exemplars from exemplars.json (default 0, as lm-eval; 8 for the 8-shot setup)")
    g.add_argument("--mode", choices=("native_cot", "direct"), default="native_cot",
                   help="lm-eval task family: mgsm_native_cot (default) or mgsm_direct")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--mgsm-dir", help="folder of mgsm_XX.tsv files (default: $LAYERSWAP_MGSM_DIR, else the Hub)")


def _eval_config(args):
    from .evaluation import EvalConfig, build_prompts

    cfg = EvalConfig(langs=[c.strip() for c in args.langs.split(",") if c.strip()], limit=args.limit,
                     shots=args.shots, mode=args.mode, max_new_tokens=args.max_new_tokens, source=args.mgsm_dir)
    cfg.validate()
    for code in cfg.langs:  # data problems (missing or malformed TSV, exemplars) before any model loads
        build_prompts(code, cfg)
    return cfg


def _engine_args(p: argparse.ArgumentParser) -> None:
    from .engines import ENGINE_CHOICES

    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=ENGINE_CHOICES, default=None,
                   help="auto (default; $LAYERSWAP_ENGINE): vLLM when installed, else transformers")
    g.add_argument("--serving", choices=("auto", "three", "one"), default="auto",
                   help="with --math/--lang on vLLM: three engines, or one engine with weights swapped per model "
                        "(auto: three when they fit in memory)")
    g.add_argument("--max-model-len", type=int, help="vLLM context length (default: model's, at most 4096)")
    g.add_argument("--device", default="auto", help="transformers engine device: cpu, cuda or auto")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap prompts in the tokenizer's chat template (default: plain prompts, as lm-eval)")


def cmd_eval(args) -> int:
    from .engines import VLLMSettings, open_engine

    if args.model and (args.math or args.lang):
        raise UserError("Give either --model M, or --math M --lang L (to evaluate the experts and their merge).")
    if not args.model and not (args.math and args.lang):
        raise UserError("Give --model M, or --math M --lang L to evaluate the experts and their merge.")
    cfg = _eval_config(args)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UserError(f"Cannot write {args.out}: its folder does not exist.")
    settings = VLLMSettings(max_model_len=args.max_model_len)
    chat = True if args.chat_template else False
    if args.model:
        engine, note = open_engine(args.model, engine=args.engine, device=args.device, settings=settings,
                                   use_chat_template=chat)
        engines = {Path(args.model).name or args.model: engine}
    else:
        from .workbench import ROLE_NAMES, Workbench

        roles = [r.strip() for r in args.models.split(",") if r.strip()]
        bad = [r for r in roles if r not in ("math", "lang", "merged")]
        if bad or not roles:
            raise UserError(f"--models takes a comma list of math, lang, merged (got {args.models!r}).")
        wb = Workbench(device=args.device, engine=args.engine, serving=args.serving, vllm=settings,
                       chat_template=chat)
        method = _method_from(args)
        wb.load(args.math, args.lang, args.base, force=args.force)
        plan = _plan_from(args, wb.num_layers, validate=method.spec.uses_plan)
        if "merged" in roles:
            wb.build(plan, method)
            _print_recipe(plan, method, wb.num_layers)
        note = wb.engine_note
        engines = {ROLE_NAMES[r]: wb.engines[r] for r in roles}
    try:
        return _run_eval(args, cfg, engines, note)
    finally:
        if args.model:
            getattr(engine, "release", lambda: None)()  # back to the engine pool
        else:
            wb.close()


def _int_list(spec: str, what: str) -> list[int]:
    """'0,1,2' or '0-3' (inclusive) -> ints."""
    out: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part.strip()[1:]:
                lo, hi = part.split("-")
                out += list(range(int(lo), int(hi) + 1))
            elif part.strip():
                out.append(int(part))
    except ValueError:
        raise UserError(f"{what} takes numbers like 0,1,2 or 0-3 (got {spec!r}).") from None
    return out


def cmd_sweep(args) -> int:
    from .engines import VLLMSettings
    from .sweeps import ablation_suite, run_sweep, swap_grid, sweep_figure
    from .workbench import Workbench

    cfg = _eval_config(args)
    wb = Workbench(device=args.device, engine=args.engine, serving=args.serving,
                   vllm=VLLMSettings(max_model_len=args.max_model_len), chat_template=bool(args.chat_template))
    try:
        wb.load(args.math, args.lang, args.base, force=args.force)
        L = wb.num_layers
        if args.suite == "grid":
            points = swap_grid(L, _int_list(args.b_values, "--b-values"), _int_list(args.u_values, "--u-values"),
                               _int_list(args.t_values, "--t-values"), transition=args.transition,
                               non_layer=args.non_layer)
        else:
            points = ablation_suite(L, _plan_from(args, L), with_base=args.base is not None)
        print(f"{len(points)} recipes on {L} layers; engine: {wb.engine_note or 'transformers'}; MGSM {cfg.mode}, "
              f"{cfg.shots}-shot, {', '.join(cfg.langs)}, {'first ' + str(cfg.limit) if cfg.limit else 'all'} questions")
        bar = _Bar(enabled=not args.quiet)
        result = run_sweep(wb, points, cfg, include_experts=not args.no_experts, progress=bar)
        bar.done()
    finally:
        wb.close()
    print(result.table_text("flexible"))
    best = result.best()
    print(f"\nbest merge (mean flexible accuracy; best of {len(result.merges())}, so optimistic): {best.name}")
    if args.out:
        result.write_csv(args.out)
        print(f"wrote {args.out}")
    if args.plot:
        from .plots import save_figure

        save_figure(sweep_figure(result), args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_eval(args, cfg, engines: dict, note: str) -> int:
    from .evaluation import evaluate

    print(f"engine: {note}")
    print(f"MGSM {cfg.mode}, {cfg.shots}-shot, greedy, {cfg.max_new_tokens} new tokens; languages "
          f"{', '.join(cfg.langs)}; {'first ' + str(cfg.limit) if cfg.limit else 'all'} questions each")
    bar = _Bar(enabled=not args.quiet)
    report = evaluate(engines, cfg, progress=bar)
    bar.done()
    for metric in ("flexible", "strict"):
        print(f"\naccuracy (%), {metric} extraction:")
        print(report.table_text(metric))
    if args.out:
        report.write_jsonl(args.out)
        print(f"\nwrote {len(report.results)} per-question results to {args.out}")
    return 0


class _Bar:
    """A tqdm progress bar on stderr fed by `progress(fraction, text)` callbacks."""

    def __init__(self, enabled: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=1000, disable=not enabled, file=sys.stderr, bar_format="{l_bar}{bar}| {elapsed}<{remaining}")

    def __call__(self, frac: float, desc: str) -> None:
        self.bar.set_description_str(desc[:40])
        self.bar.update(int(frac * 1000) - self.bar.n)

    def done(self) -> None:
        self.bar.close()


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

    s = sub.add_parser("inspect", help="compatibility report (headers, plus a few MB of sampled weights)")
    _models(s)
    _pairing_args(s, force=False)
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("merge", help="build the layer-swapped (or baseline) model and write it as an HF folder")
    _models(s)
    _plan_args(s)
    _method_args(s)
    _pairing_args(s)
    s.add_argument("--device", default="cpu", help="where blended tensors are computed: cpu or cuda")
    s.add_argument("-o", "--out", required=True, help="output folder (must not exist, unless --overwrite)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    s.add_argument("--out-shard-size", default="5GB", help="maximum bytes per safetensors shard (default 5GB)")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=cmd_merge)

    s = sub.add_parser("export-yaml", help="the plan as a mergekit config (linear method) that reproduces the merge")
    _models(s)
    _plan_args(s)
    _method_args(s)
    s.add_argument("-o", "--out", default="-", help="YAML file (default: stdout)")
    s.set_defaults(fn=cmd_export_yaml)

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
    _method_args(s)
    _pairing_args(s)
    s.add_argument("--question", help="free-text question (prompted in --mgsm-lang's MGSM format)")
    s.add_argument("--mgsm-lang", default="en", help="MGSM language code (default en)")
    s.add_argument("--index", type=int, help="MGSM question number (0-based) in --mgsm-lang")
    s.add_argument("--mgsm-dir", help="folder of mgsm_XX.tsv files (default: $LAYERSWAP_MGSM_DIR, else the Hub)")
    s.add_argument("--shots", type=int, default=0, choices=[0, 1, 2, 3, 4, 5, 6, 7, 8],
                   help="few-shot exemplars from exemplars.json (default 0, as lm-eval)")
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    s.set_defaults(fn=cmd_ask)

    s = sub.add_parser("eval", help="MGSM accuracy of a model (or of both experts and their merge), per language")
    s.add_argument("--model", metavar="M", help="model folder or Hub id to evaluate")
    s.add_argument("--math", metavar="M", help="math expert (with --lang: evaluate experts and merge)")
    s.add_argument("--lang", metavar="L", help="language expert")
    s.add_argument("--base", metavar="B", help="base model (task-vector methods, adapters, the shared-base check)")
    s.add_argument("--models", default="math,lang,merged", help="with --math/--lang: which of math,lang,merged")
    _plan_args(s)
    _method_args(s)
    _pairing_args(s)
    _eval_args(s)
    _engine_args(s)
    s.add_argument("-o", "--out", help="per-question results as JSONL")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("sweep", help="merge and evaluate a grid of plans or the ablation suite, then tabulate")
    _models(s)
    s.add_argument("--suite", choices=("grid", "ablations"), default="grid",
                   help="grid: (b, u, t) swap plans; ablations: transition, location, module and baseline variants")
    s.add_argument("--b-values", default="0-3", help="grid: bottom layer counts (default 0-3)")
    s.add_argument("--u-values", default="0-2", help="grid: top layer counts (default 0-2)")
    s.add_argument("--t-values", default="0,1", help="grid: transition widths tb = tu (default 0,1)")
    _plan_args(s)
    _pairing_args(s)
    _eval_args(s)
    s.add_argument("--no-experts", action="store_true", help="skip evaluating the experts themselves")
    _engine_args(s)
    s.add_argument("-o", "--out", help="results as CSV")
    s.add_argument("--plot", help="bar chart of every recipe (.html or .png)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_sweep)
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
