#!/usr/bin/env python
"""Measure the demo organism with layerswap itself and write ``results.json`` and the model card.

    python scripts/eval_demo.py                      # assets/demo -> results.json, recommended_plan.json, README.md
    python scripts/eval_demo.py --demo DIR           # a rebuilt organism (tests/test_demo_organism.py, slow)

Everything goes through the library's public API (Workbench, Plan, Recipe, MethodConfig, evaluate_points, EvalConfig):
the same merge and MGSM evaluation code the app and CLI use (0-shot native chain-of-thought prompt,
greedy decoding, flexible and strict extraction as in lm-evaluation-harness' ``mgsm_native_cot``).

1. Choice, on the dev set only (``mgsm/dev``, Kovani): a grid of swap plans; the best on dev is the
   recommended plan (``recommended_plan.json``).
2. Test (``mgsm/mgsm_xx.tsv``, ``mgsm/mgsm_en.tsv``): base, math expert, language expert, soup 50/50,
   TIES, task arithmetic, the default plan for the depth, the recommended plan and its inverse map,
   with 95 % intervals, floors (most common answer, first/last number in the question, each model's
   answer prior) and paired differences of the recommended plan against every other model.
Every per-question output is kept in ``results.json`` so the card's numbers can be recomputed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from layerswap import mgsm
from layerswap.demo import RECOMMENDED_PLAN_FIELDS
from layerswap.evaluation import EvalConfig
from layerswap.methods import MethodConfig
from layerswap.plans import Plan
from layerswap.roles import ROLE_NAMES
from layerswap.recipes import Recipe
from layerswap.sweeps import SweepPoint, SweepRow, evaluate_points, swap_grid
from layerswap.workbench import Workbench

TARGET = "xx"
MAX_NEW_TOKENS = 32  # a two-step gold solution is 17 tokens; the library's 256 only lets a rambling model ramble
PLAN_FIELDS = RECOMMENDED_PLAN_FIELDS  # what recommended_plan.json holds (read back by layerswap.demo)
TARGET_SE = 3.0  # the recommended plan must beat each baseline by this many paired standard errors
FLOOR_MARGIN = 0.10  # ... and every floor by this much
MATH_EN_MIN = 0.80


def row_results(row: SweepRow, lang: str) -> list:
    """The per-question results of `row` on `lang`, in question order.

    Both experts' rows share one report, so the results are filtered on the row's model name too.
    """
    model = row.name if row.kind == "expert" else ROLE_NAMES["merged"]
    qs = sorted((r for r in row.report.results if r.lang == lang and r.model == model), key=lambda r: r.index)
    if not qs:
        raise SystemExit(f"no results for {row.name!r} ({model}) in {lang}")
    return qs


def accuracy(correct: list[bool]) -> dict:
    n = len(correct)
    p = sum(correct) / n
    se = math.sqrt(p * (1 - p) / n)
    return {"acc": round(p, 4), "se": round(se, 4), "ci95": [round(max(0.0, p - 1.96 * se), 4),
                                                              round(min(1.0, p + 1.96 * se), 4)], "n": n}


def paired(a: list[bool], b: list[bool]) -> dict:
    """Mean per-question difference a - b with its standard error and the ratio."""
    d = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1))
    se = sd / math.sqrt(len(d))
    return {"diff": round(mean, 4), "se": round(se, 4), "z": round(mean / se, 2) if se else None}


def answer_prior(preds: list[str], gold: list[int]) -> float:
    """Expected accuracy of the model's answer distribution scored independently of the question."""
    n = len(gold)
    g = Counter(str(x) for x in gold)
    p = Counter(mgsm.normalize(x) for x in preds)
    return round(sum(c * g.get(a, 0) for a, c in p.items()) / (n * n), 4)


def question_floors(items: list) -> dict:
    nums = [[int(x) for x in re.findall(r"\d+", it.question)] for it in items]
    gold = [it.answer for it in items]
    mode, _ = Counter(gold).most_common(1)[0]
    n = len(items)
    return {f"most common answer ({mode})": round(sum(g == mode for g in gold) / n, 4),
            "first number in the question": round(sum(ns[0] == g for ns, g in zip(nums, gold) if ns) / n, 4),
            "last number in the question": round(sum(ns[-1] == g for ns, g in zip(nums, gold) if ns) / n, 4)}


def plan_points(L: int, args) -> list[SweepPoint]:
    ints = lambda s: [int(x) for x in s.split(",")]
    pts = swap_grid(L, ints(args.b_values), ints(args.u_values), ints(args.t_values))
    return [p for p in pts if (p.recipe.plan.b, p.recipe.plan.u) != (0, 0)]


def choose_on_dev(wb: Workbench, demo: Path, L: int, args, progress) -> tuple[SweepPoint, dict]:
    cfg = EvalConfig(langs=[TARGET], limit=args.dev_limit or args.limit, source=str(demo / "mgsm" / "dev"),
                     max_new_tokens=MAX_NEW_TOKENS)
    points = plan_points(L, args)
    res = evaluate_points(wb, points, cfg, include_experts=False, progress=progress)
    dev = {}
    for pt, row in zip(points, res.rows):
        c = [r.flexible_correct for r in row_results(row, TARGET)]
        dev[pt.name] = {"plan": {k: getattr(pt.recipe.plan, k) for k in PLAN_FIELDS}, "acc": round(sum(c) / len(c), 4),
                        "correct": "".join("1" if x else "0" for x in c)}
    # best dev accuracy; ties go to the plan that swaps fewer layers (then the grid's order)
    best = max(points, key=lambda p: (dev[p.name]["acc"], -(p.recipe.plan.b + p.recipe.plan.u + p.recipe.plan.tb
                                                             + p.recipe.plan.tu)))
    return best, dev


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo", default=str(REPO / "assets" / "demo"), help="organism folder (base, math, lang, mgsm)")
    ap.add_argument("--pair", default="", help="experts' subfolder (e.g. unlocalised); base stays DEMO/base")
    ap.add_argument("--out", help="results JSON (default DEMO[/PAIR]/results.json)")
    ap.add_argument("--limit", type=int, help="first N questions per set (smoke runs only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--b-values", default="1,2,3")
    ap.add_argument("--u-values", default="0,1")
    ap.add_argument("--t-values", default="0,1")
    ap.add_argument("--english-for", default="",
                    help="merges also measured in English, '|'-separated names (the experts and the recommended "
                         "plan always are)")
    ap.add_argument("--dev-limit", type=int, default=200, help="first N dev questions for the plan choice")
    ap.add_argument("--no-card", action="store_true", help="do not rewrite README.md")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    demo = Path(args.demo)
    experts = demo / args.pair
    out = Path(args.out) if args.out else experts / "results.json"
    t0 = time.time()

    def progress(f: float, d: str) -> None:
        print(f"\r[{time.time() - t0:6.0f}s] {100 * f:5.1f}% {d[:90]:<90}", end="", file=sys.stderr, flush=True)

    wb = Workbench(device="cpu", batch_size=64, engine="transformers")
    wb.load(str(experts / "math"), str(experts / "lang"), str(demo / "base"))
    L = wb.num_layers
    best, dev = choose_on_dev(wb, demo, L, args, progress)
    rec = best.recipe.plan
    inverse = Plan(kind="weights", weights=tuple(1.0 - w for w in rec.layer_weights(L)),
                   non_layer={"neighbour": "neighbour", "math": "lang", "lang": "math"}.get(rec.non_layer, "avg"))
    points = [SweepPoint("base model", Recipe(MethodConfig("task_arithmetic", lam=0.0))),
              SweepPoint("soup 50/50", Recipe(MethodConfig("soup", weight=0.5))),
              SweepPoint("TIES (density 0.2)", Recipe(MethodConfig("ties", density=0.2))),
              SweepPoint("task arithmetic", Recipe(MethodConfig("task_arithmetic"))),
              SweepPoint(f"recommended plan ({best.name})", Recipe(plan=rec)),
              SweepPoint("inverse map (language middle, math outer)", Recipe(plan=inverse))]
    cfg = EvalConfig(langs=[TARGET], limit=args.limit, source=str(demo / "mgsm"), max_new_tokens=MAX_NEW_TOKENS)
    runs = [evaluate_points(wb, points, cfg, progress=progress)]
    en_points = [p for p in points if p.name in args.english_for.split("|") or p.recipe.plan == rec]
    cfg_en = EvalConfig(langs=["en"], limit=args.limit, source=str(demo / "mgsm"), max_new_tokens=MAX_NEW_TOKENS)
    runs.append(evaluate_points(wb, en_points, cfg_en, progress=progress))  # (the experts always)
    print(file=sys.stderr)
    wb.close()
    gold = {lang: [it.answer for it in mgsm.load(lang, cfg.source)][: args.limit] for lang in (TARGET, "en")}
    models, outputs = {}, {}
    for res in runs:
        for row in res.rows:
            entry = models.setdefault(row.name, {"kind": row.kind, "recipe": row.recipe,
                                                 "layer_weights_lang": row.layer_weights})
            for lang in res.config.langs:
                qs = row_results(row, lang)
                c = [r.flexible_correct for r in qs]
                entry[lang] = {**accuracy(c), "strict": round(sum(r.strict_correct for r in qs) / len(qs), 4),
                               "answer_prior": answer_prior([r.flexible for r in qs], gold[lang])}
                outputs.setdefault(row.name, {})[lang] = {
                    "output": [r.output for r in qs], "flexible": [r.flexible for r in qs],
                    "correct": "".join("1" if x else "0" for x in c)}
    rec_name = points[4].name
    rc = [ch == "1" for ch in outputs[rec_name][TARGET]["correct"]]
    comparisons = {name: paired(rc, [ch == "1" for ch in o[TARGET]["correct"]])
                   for name, o in outputs.items() if name != rec_name}
    floors = question_floors(mgsm.load(TARGET, cfg.source)[: args.limit])
    floors.update({f"answer prior of the {name}": m[TARGET]["answer_prior"] for name, m in models.items()})
    rec_acc = models[rec_name][TARGET]["acc"]
    must_beat = ["math expert", "language expert", "soup 50/50", "TIES (density 0.2)"]
    targets = {f"beats {n} by >= {TARGET_SE:g} SE (paired)": comparisons[n]["z"] is not None
               and comparisons[n]["z"] >= TARGET_SE for n in must_beat}
    targets[f"beats every floor by >= {100 * FLOOR_MARGIN:g} points"] = rec_acc >= max(floors.values()) + FLOOR_MARGIN
    targets[f"math expert >= {100 * MATH_EN_MIN:g} % in English"] = models["math expert"]["en"]["acc"] >= MATH_EN_MIN
    plan_json = {**{k: getattr(rec, k) for k in PLAN_FIELDS}, "name": best.name,
                 "chosen_on": f"mgsm/dev/mgsm_{TARGET}.tsv ({len(next(iter(dev.values()))['correct'])} questions)",
                 "dev_accuracy": dev[best.name]["acc"]}
    result = {
        "generated_by": "scripts/eval_demo.py", "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - t0), "pair": args.pair or "localised",
        "english_measured_for": sorted(n for n, m in models.items() if "en" in m),
        "protocol": {"mode": cfg.mode, "shots": cfg.shots, "max_new_tokens": MAX_NEW_TOKENS,
                     "engine": "transformers (greedy)", "metric": "flexible (strict also given)"},
        "num_layers": L, "target_language": TARGET, "questions_per_language": len(gold[TARGET]),
        "recommended_plan": plan_json, "recommended_name": rec_name, "dev_grid": dev,
        "floors_target_language": floors, "paired_recommended_minus": comparisons,
        "targets": targets, "targets_met": all(targets.values()),
        "tolerance": "a rebuild matches when every test accuracy is within max(0.03, 3 SE) of these",
        "models": models, "gold": gold, "outputs": outputs,
    }
    out.write_text(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n")
    if not args.pair:
        (demo / "recommended_plan.json").write_text(json.dumps(plan_json, indent=1) + "\n")
    for res in runs:
        print(res.table_text())
    print(f"recommended plan (dev {100 * dev[best.name]['acc']:.1f}%): {best.name}")
    for name, c in comparisons.items():
        print(f"  recommended - {name:<45} {100 * c['diff']:+6.1f} ± {100 * c['se']:.1f} (z {c['z']})")
    print(f"targets: {targets}")
    if not args.no_card and not args.pair:
        import demo_card

        demo_card.write_card(demo)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
