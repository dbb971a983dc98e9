#!/usr/bin/env python
"""Measure the demo organism with layerswap itself and write ``results.json`` (the model card's numbers).

    python scripts/eval_demo.py                      # assets/demo -> assets/demo/results.json
    python scripts/eval_demo.py --demo DIR --out F   # a rebuilt organism (tests/test_demo_organism.py, slow)

Everything goes through the library's public API (Workbench, Plan, Recipe, MethodConfig, evaluate_points, EvalConfig):
the same merge and MGSM evaluation code the app and CLI use (0-shot native chain-of-thought prompt,
greedy decoding, strict and flexible extraction as in lm-evaluation-harness' ``mgsm_native_cot``).

Models: math expert, language expert, soup (0.5/0.5), TIES, the default plan for the layer count
(the literature's 32-layer b=5 u=2 tb=tu=1 scaled down) and a grid of swap plans. The best plan is
chosen on the first half of the target-language questions (dev) and reported on the second half
(held out) as well as on all of them, so its number is not just a pick of the luckiest plan.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from layerswap import mgsm  # noqa: E402
from layerswap.evaluation import EvalConfig  # noqa: E402
from layerswap.methods import MethodConfig  # noqa: E402
from layerswap.plans import default_plan  # noqa: E402
from layerswap.recipes import Recipe  # noqa: E402
from layerswap.sweeps import SweepPoint, evaluate_points, swap_grid  # noqa: E402
from layerswap.workbench import Workbench  # noqa: E402

TARGET = "xx"


def se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else 0.0


def row_accuracy(row, lang: str, lo: int, hi: int, metric: str = "flexible") -> tuple[float, int]:
    """Accuracy of a sweep row on questions lo..hi-1 of `lang` (from its per-question results)."""
    qs = [r for r in row.report.results if r.lang == lang and lo <= r.index < hi]
    ok = sum(bool(r.flexible_correct if metric == "flexible" else r.strict_correct) for r in qs)
    return (ok / len(qs) if qs else 0.0), len(qs)


def paired(a, b, lang: str) -> dict:
    """Mean per-question difference of two sweep rows' correctness (a - b) on `lang`, with its standard error."""
    ca = {r.index: r.flexible_correct for r in a.report.results if r.lang == lang}
    cb = {r.index: r.flexible_correct for r in b.report.results if r.lang == lang}
    d = [int(ca[i]) - int(cb[i]) for i in ca]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1))
    return {"diff": round(mean, 4), "se": round(sd / math.sqrt(len(d)), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo", default=str(REPO / "assets" / "demo"), help="organism folder (base, math, lang, mgsm)")
    ap.add_argument("--out", help="results JSON (default DEMO/results.json)")
    ap.add_argument("--limit", type=int, help="first N questions per language (smoke runs only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--b-values", default="0,1,2,3")
    ap.add_argument("--u-values", default="0,1,2")
    ap.add_argument("--t-values", default="0,1")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    demo = Path(args.demo)
    out = Path(args.out) if args.out else demo / "results.json"
    t0 = time.time()
    wb = Workbench(device="cpu", batch_size=64, engine="transformers")
    wb.load(str(demo / "math"), str(demo / "lang"), str(demo / "base"))
    L = wb.num_layers
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    dflt = default_plan(L)
    points = [SweepPoint("soup (average)", Recipe(MethodConfig("soup", weight=0.5))),
              SweepPoint("TIES (density 0.2)", Recipe(MethodConfig("ties", density=0.2))),
              SweepPoint(f"default swap ({dflt.title()})", Recipe(plan=dflt))]
    grid = [p for p in swap_grid(L, ints(args.b_values), ints(args.u_values), ints(args.t_values))
            if (p.recipe.plan.b, p.recipe.plan.u, p.recipe.plan.tb) != (dflt.b, dflt.u, dflt.tb)
            or dflt.transition != "flat"]
    points += grid
    cfg = EvalConfig(langs=[TARGET, "en"], limit=args.limit, source=str(demo / "mgsm"))

    def progress(f: float, d: str) -> None:
        print(f"\r[{time.time() - t0:6.0f}s] {100 * f:5.1f}% {d[:90]:<90}", end="", file=sys.stderr, flush=True)

    res = evaluate_points(wb, points, cfg, progress=progress)
    print(file=sys.stderr)
    n = res.rows[0].n[TARGET]
    half = n // 2
    models = {}
    for r in res.rows:
        entry = {"kind": r.kind, "recipe": r.recipe,
                 "layer_weights_lang": r.layer_weights}
        for lang in cfg.langs:
            m = r.n[lang]
            entry[lang] = {metric: round(r.accuracy[metric][lang], 4) for metric in ("flexible", "strict")}
            entry[lang]["se"] = round(se(r.accuracy["flexible"][lang], m), 4)
            entry[lang]["n"] = m
        entry["dev_" + TARGET] = round(row_accuracy(r, TARGET, 0, half)[0], 4)
        entry["heldout_" + TARGET] = round(row_accuracy(r, TARGET, half, n)[0], 4)
        models[r.name] = entry
    merges = [r for r in res.rows if r.kind == "merge" and r.recipe.get("method", {}).get("name", "layer_swap")
              == "layer_swap"]
    best = max(merges, key=lambda r: (row_accuracy(r, TARGET, 0, half)[0], -len(r.name)))
    summary = {
        "math expert": models["math expert"][TARGET],
        "language expert": models["language expert"][TARGET],
        "soup": models["soup (average)"][TARGET],
        "default swap": models[points[2].name][TARGET],
        "best swap": models[best.name][TARGET],
    }
    floors = {}  # accuracy without any model: a constant answer, or a number copied from the question
    for lang in cfg.langs:
        items = mgsm.load(lang, cfg.source)[:n]
        nums = [[int(x) for x in re.findall(r"\d+", it.question)] for it in items]
        mode = max(set(it.answer for it in items), key=lambda a: sum(it.answer == a for it in items))
        floors[lang] = {f"constant answer {mode} (the most common)": round(sum(it.answer == mode for it in items) / n, 4),
                        "first number": round(sum(ns[0] == it.answer for ns, it in zip(nums, items) if ns) / n, 4),
                        "last number": round(sum(ns[-1] == it.answer for ns, it in zip(nums, items) if ns) / n, 4),
                        "any number (oracle pick)": round(sum(it.answer in ns for ns, it in zip(nums, items)) / n, 4)}

    by_name = {r.name: r for r in res.rows}
    lang_row = by_name["language expert"]
    comparisons = {f"{name} - language expert": paired(by_name[name], lang_row, TARGET)
                   for name in (points[2].name, best.name, "soup (average)")}
    result = {
        "generated_by": "scripts/eval_demo.py",
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - t0),
        "protocol": {"mode": cfg.mode, "shots": cfg.shots, "max_new_tokens": cfg.max_new_tokens,
                     "engine": "transformers (greedy)", "metric": "flexible (strict also given)"},
        "num_layers": L,
        "target_language": TARGET,
        "questions_per_language": n,
        "default_plan": points[2].name,
        "best_plan": {"name": best.name, "chosen_on": f"{TARGET} questions 0-{half - 1} (dev)",
                      "heldout": f"{TARGET} questions {half}-{n - 1}",
                      "dev": models[best.name]["dev_" + TARGET], "heldout_acc": models[best.name]["heldout_" + TARGET]},
        "summary_target_language": summary,
        "floors": floors,
        "paired_on_target_language": comparisons,
        "tolerance": "a rebuild matches when every summary accuracy is within max(0.03, 3 SE) of these",
        "models": models,
    }
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    lines = [f"| model | {TARGET} flexible ± SE | {TARGET} strict | en flexible ± SE | en strict |", "|---|---|---|---|---|"]
    for name, m in models.items():
        cells = [f"{100 * m[lang]['flexible']:.1f} ± {100 * m[lang]['se']:.1f} | {100 * m[lang]['strict']:.1f}"
                 for lang in (TARGET, "en")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(res.table_text())
    print(f"\n{TARGET} accuracy (flexible) ± SE, n={n}:")
    for k, v in summary.items():
        print(f"  {k:<16} {100 * v['flexible']:5.1f}% ± {100 * v['se']:.1f}")
    print(f"best plan (chosen on dev half): {best.name}; held-out half {100 * result['best_plan']['heldout_acc']:.1f}%")
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    wb.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
