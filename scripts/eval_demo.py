#!/usr/bin/env python
"""Measure the demo organism with layerswap itself and write ``results.json`` and the model card.

    python scripts/eval_demo.py                      # assets/demo -> results.json, recommended_plan.json, README.md
    python scripts/eval_demo.py --demo DIR           # a rebuilt organism (tests/test_demo_organism.py, slow)

Everything goes through the library's public API (Workbench, Plan, Recipe, MethodConfig, evaluate_points, EvalConfig):
the same merge and MGSM evaluation code the app and CLI use (0-shot native chain-of-thought prompt,
greedy decoding, flexible and strict extraction as in lm-evaluation-harness' ``mgsm_native_cot``).

1. Choice, on the dev set only (``mgsm/dev``, the target language): a grid of swap plans (and, with ``--search
   FILE``, the plan a `layerswap search` found, its ``--json-out``); the best on dev under the one rule (highest
   flexible accuracy, a tie to fewer swapped layers: ``ResultsWriter.best_dev``) is the recommended plan
   (``recommended_plan.json``).
2. Test (``mgsm/mgsm_<target>.tsv``, ``mgsm/mgsm_en.tsv``): base, math expert, language expert, soup 50/50,
   TIES, task arithmetic and the recommended plan; the dictionary baseline (the math expert reading the target
   language through the world's word-for-word dictionary, no training); floors (most common answer,
   first/last number in the question, each model's answer prior) and a skill-aware floor (the arithmetic
   without the language: always subtracting). Exact 95 % intervals (Clopper-Pearson); the recommended plan
   against every other row per question (difference ± SE, z, exact McNemar p); whether the inverse map is
   the base model and task arithmetic the recommended plan, weight for weight.
Every per-question output is kept in ``results.json`` so the card's numbers can be recomputed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch

from layerswap import Checkpoint
from layerswap.evaluation import mgsm
from layerswap.shipped.results import DICTIONARY, SKILL_FLOOR, ResultsWriter, results_file
from layerswap.engines.transformers_engine import TransformersEngine
from layerswap.evaluation.run import EvalConfig, evaluate
from layerswap.merge.merging import merge_in_memory
from layerswap.recipe.methods import MethodConfig
from layerswap.recipe.plans import Plan
from layerswap.core.roles import ROLE_NAMES
from layerswap.recipe.recipes import Recipe
from layerswap.sweeps import SweepPoint, SweepRow, evaluate_points, swap_grid
from layerswap.serving.workbench import Workbench

MAX_NEW_TOKENS = 32  # a two-step gold solution is 17 tokens; the library's 256 only lets a rambling model ramble


def target_language(demo: Path) -> str:
    """The organism's target language: the one test language besides English."""
    codes = [c for c in mgsm.available_languages(demo / "mgsm") if c != "en"]
    if len(codes) != 1:
        raise SystemExit(f"{demo / 'mgsm'}: expected English and one target language, found {codes}")
    return codes[0]


def row_results(row: SweepRow, lang: str) -> list:
    """The per-question results of `row` on `lang`, in question order.

    Both experts' rows share one report, so the results are filtered on the row's model name too.
    """
    model = row.name if row.kind == "expert" else ROLE_NAMES["merged"]
    return report_results(row.report, model, lang)


def report_results(report, model: str, lang: str) -> list:
    qs = sorted((r for r in report.results if r.lang == lang and r.model == model), key=lambda r: r.index)
    if not qs:
        raise SystemExit(f"no results for {model} in {lang}")
    return qs


def answer_prior(preds: list[str], gold: list[int]) -> float:
    """Expected accuracy of the model's answer distribution scored independently of the question."""
    n = len(gold)
    g = Counter(str(x) for x in gold)
    p = Counter(mgsm.normalize(x) for x in preds)
    return round(sum(c * g.get(a, 0) for a, c in p.items()) / (n * n), 4)


def _numbers(question: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", question)]


def question_floors(items: list) -> dict:
    """No-skill floors: answers that need no reading and no arithmetic."""
    nums = [_numbers(it.question) for it in items]
    gold = [it.answer for it in items]
    mode, _ = Counter(gold).most_common(1)[0]
    n = len(items)
    return {f"most common answer ({mode})": round(sum(g == mode for g in gold) / n, 4),
            "first number in the question": round(sum(ns[0] == g for ns, g in zip(nums, gold) if ns) / n, 4),
            "last number in the question": round(sum(ns[-1] == g for ns, g in zip(nums, gold) if ns) / n, 4)}


def skill_floor(items: list) -> list[bool]:
    """A floor with the arithmetic but not the language: the question's numbers in order, every later one
    subtracted from the first (reading neither the verbs nor the word order)."""
    return [bool(ns) and ns[0] - sum(ns[1:]) == it.answer for it, ns in ((it, _numbers(it.question)) for it in items)]


def dictionary_engine(experts: Path, demo: Path) -> tuple[TransformersEngine, int]:
    """The math expert reading the target language through a dictionary, with no training: each target word's
    input embedding replaced by the base's embedding of its English twin (``dictionary.json``, written by the
    build from the world's lexicon). Returns the engine and the number of rows replaced."""
    pairs = json.loads((demo / "dictionary.json").read_text(encoding="utf-8"))
    engine = TransformersEngine.from_pretrained(experts / "math", batch_size=64)
    emb = engine.model.get_input_embeddings().weight
    base_emb = Checkpoint.open(demo / "base").get("model.embed_tokens.weight")
    vocab = engine.tokenizer.get_vocab()
    rows = 0
    with torch.no_grad():
        for en, tgt in pairs.items():
            for form in ("\u2581{}", "{}"):  # word-level tokens with and without the word-start mark
                e, t = vocab.get(form.format(en)), vocab.get(form.format(tgt))
                if e is not None and t is not None and e != t:
                    emb[t] = base_emb[e]
                    rows += 1
    return engine, rows


def same_weights(paths: dict[str, Path], num_layers: int, a: Recipe, b: Recipe | None) -> float:
    """Largest absolute difference between the weights two recipes build (b None: the base model itself)."""
    cks = {r: Checkpoint.open(p) for r, p in paths.items()}
    sd = {r: {n: ck.get(n) for n in ck.tensors} for r, ck in cks.items()}
    build = lambda rc: merge_in_memory(sd["math"], sd["lang"], num_layers, rc, base=sd["base"].__getitem__,
                                       arch=cks["math"].arch)
    wa, wb = build(a), (build(b) if b is not None else sd["base"])
    return max(float((wa[n].float() - wb[n].float()).abs().max()) for n in wa)


def plan_points(L: int, args) -> list[SweepPoint]:
    ints = lambda s: [int(x) for x in s.split(",")]
    pts = swap_grid(L, ints(args.b_values), ints(args.u_values), ints(args.t_values))
    pts = [p for p in pts if (p.recipe.plan.b, p.recipe.plan.u) != (0, 0)]
    if args.search:  # the search's plan, chosen on the same dev questions, joins the grid under the same rule
        plan = Plan.from_dict(json.loads(Path(args.search).read_text())["plan"])
        if all(p.recipe.plan != plan for p in pts):
            pts.append(SweepPoint(f"search: {plan.title()}", Recipe(plan=plan)))
    return pts


def choose_on_dev(wb: Workbench, demo: Path, target: str, L: int, args, progress, w: ResultsWriter) -> SweepPoint:
    """Every plan of the grid on the dev set (into `w`); returns the best (`ResultsWriter.best_dev`)."""
    cfg = EvalConfig(langs=[target], limit=args.dev_limit or args.limit, source=str(demo / "mgsm" / "dev"),
                     max_new_tokens=MAX_NEW_TOKENS)
    points = plan_points(L, args)
    res = evaluate_points(wb, points, cfg, include_experts=False, progress=progress)
    for pt, row in zip(points, res.rows):
        qs = row_results(row, target)
        w.add_dev(pt.name, pt.recipe.plan, [r.flexible_correct for r in qs], [r.strict_correct for r in qs])
    best = w.best_dev()
    return next(p for p in points if p.name == best)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo", default=str(REPO / "assets" / "demo"), help="organism folder (base, math, lang, mgsm)")
    ap.add_argument("--pair", default="", help="experts' subfolder (e.g. unlocalised); base stays DEMO/base")
    ap.add_argument("--lang", default="lang", help="the language expert's folder in the experts' folder (e.g. "
                    "lang_revert: trained fully, then reverted outside its range)")
    ap.add_argument("--out", help="results JSON (default DEMO[/PAIR]/results.json, or results_LANG.json)")
    ap.add_argument("--limit", type=int, help="first N questions per set (smoke runs only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--b-values", default="1,2,3")
    ap.add_argument("--u-values", default="0,1,2,3")
    ap.add_argument("--t-values", default="0,1")
    ap.add_argument("--english-for", default="",
                    help="merges also measured in English, '|'-separated names (the experts and the recommended "
                         "plan always are)")
    ap.add_argument("--dev-limit", type=int, default=200, help="first N dev questions for the plan choice")
    ap.add_argument("--search", help="a `layerswap search --json-out` result: its plan joins the dev grid")
    ap.add_argument("--no-card", action="store_true", help="do not rewrite README.md")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    demo = Path(args.demo)
    experts = demo / args.pair
    out = Path(args.out) if args.out else results_file(experts, args.lang)
    target = target_language(demo)
    t0 = time.time()

    def progress(f: float, d: str) -> None:
        print(f"\r[{time.time() - t0:6.0f}s] {100 * f:5.1f}% {d[:90]:<90}", end="", file=sys.stderr, flush=True)

    wb = Workbench(device="cpu", batch_size=64, engine="transformers")
    paths = {"math": experts / "math", "lang": experts / args.lang, "base": demo / "base"}
    wb.load(str(paths["math"]), str(paths["lang"]), str(paths["base"]))
    L = wb.num_layers
    w = ResultsWriter(target)
    best = choose_on_dev(wb, demo, target, L, args, progress, w)
    rec = best.recipe.plan
    rec_name = f"recommended plan ({best.name})"
    points = [SweepPoint("base model", Recipe(MethodConfig("task_arithmetic", lam=0.0))),
              SweepPoint("soup 50/50", Recipe(MethodConfig("soup", weight=0.5))),
              SweepPoint("TIES (density 0.2)", Recipe(MethodConfig("ties", density=0.2))),
              SweepPoint("task arithmetic", Recipe(MethodConfig("task_arithmetic"))),
              SweepPoint(rec_name, Recipe(plan=rec))]
    cfg = EvalConfig(langs=[target], limit=args.limit, source=str(demo / "mgsm"), max_new_tokens=MAX_NEW_TOKENS)
    runs = [evaluate_points(wb, points, cfg, progress=progress)]
    en_points = [p for p in points if p.name in args.english_for.split("|") or p.recipe.plan == rec]
    cfg_en = EvalConfig(langs=["en"], limit=args.limit, source=str(demo / "mgsm"), max_new_tokens=MAX_NEW_TOKENS)
    runs.append(evaluate_points(wb, en_points, cfg_en, progress=progress))  # (the experts always)
    wb.close()
    dict_engine, dict_rows = dictionary_engine(experts, demo)
    dict_report = evaluate({DICTIONARY: dict_engine}, cfg, progress=progress)
    print(file=sys.stderr)
    # the inverse map (the language expert's layers where the plan takes the math expert's, and vice versa)
    inverse = Plan(kind="weights", weights=tuple(1.0 - w for w in rec.layer_weights(L)),
                   non_layer={"neighbour": "neighbour", "math": "lang", "lang": "math"}.get(rec.non_layer, "avg"))
    identities = {"inverse map vs base model": same_weights(paths, L, Recipe(plan=inverse), None),
                  "task arithmetic vs recommended plan": same_weights(paths, L, Recipe(MethodConfig("task_arithmetic")),
                                                                      Recipe(plan=rec))}
    items = {lang: mgsm.load(lang, cfg.source)[: args.limit] for lang in (target, "en")}
    gold = {lang: [it.answer for it in items[lang]] for lang in items}

    def keep(name: str, entry: dict, lang: str, qs: list) -> None:
        w.add(name, entry, lang, [r.flexible_correct for r in qs], [r.strict_correct for r in qs],
              [r.output for r in qs], [r.flexible for r in qs], answer_prior([r.flexible for r in qs], gold[lang]))

    for res in runs:
        for row in res.rows:
            for lang in res.config.langs:
                keep(row.name, {"kind": row.kind, "recipe": row.recipe, "layer_weights_lang": row.layer_weights},
                     lang, row_results(row, lang))
    keep(DICTIONARY, {"kind": "dictionary", "rows_replaced": dict_rows}, target,
         report_results(dict_report, DICTIONARY, target))
    w.add_floor(SKILL_FLOOR, skill_floor(items[target]))
    plan_json = w.plan_entry(best.name, f"mgsm/dev/mgsm_{target}.tsv")
    result = w.finish(
        gold=gold, recommended=rec_name, plan=plan_json, floors=question_floors(items[target]),
        weight_differences=identities, num_layers=L,
        protocol={"mode": cfg.mode, "shots": cfg.shots, "max_new_tokens": MAX_NEW_TOKENS,
                  "engine": "transformers (greedy)", "metric": "flexible (strict also given)",
                  "intervals": "exact 95 % (Clopper-Pearson)", "paired": "difference ± SE, z, exact McNemar p"},
        meta={"generated_by": "scripts/eval_demo.py", "date": time.strftime("%Y-%m-%d"),
              "seconds": round(time.time() - t0), "pair": args.pair or "localised", "language_expert": args.lang})
    result.write(out)
    main_pair = not args.pair and args.lang == "lang"
    if main_pair:
        (demo / "recommended_plan.json").write_text(json.dumps(plan_json, indent=1) + "\n")
    for res in runs:
        print(res.table_text())
    print(f"{DICTIONARY} ({dict_rows} rows): {100 * result.score(DICTIONARY, target).acc:.1f}%; "
          f"{SKILL_FLOOR}: {100 * result.score(SKILL_FLOOR, target).acc:.1f}%; weights: {identities}")
    print(f"recommended plan (dev {100 * plan_json['dev_accuracy']:.1f}%): {best.name}")
    for name, c in result.comparisons().items():
        print(f"  recommended - {name:<45} {100 * c.diff:+6.1f} ± {100 * c.se:.1f} (z {c.z}, McNemar p {c.p})")
    print(f"targets: {result.targets()}")
    if not args.no_card and main_pair:
        import demo_card

        demo_card.write_card(demo)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
