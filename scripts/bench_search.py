#!/usr/bin/env python3
"""Benchmark of the plan search (issue 32): the search against the exhaustive grid and against a disk-writing,
engine-restarting loop like mergekit-evolve's, measured in one run.

    python3 scripts/bench_search.py                      # the demo organism (Kovani), the whole comparison
    python3 scripts/bench_search.py --size 8b            # the 8B-shaped trio (scripts/bench_common.py): timing only

Demo organism (transformers engine, each question at most --max-new-tokens tokens):

1. the search: `layerswap.search` with --budget plans (successive halving, TPE seeded by the priors);
2. the exhaustive grid: every (b, u, tb, tu) at the default transition and non-layer choice, each plan on every
   dev question (`search` with strategy exhaustive, no halving), on the same split;
3. the disk loop, on the search's first --disk candidates and the same questions: each candidate exported to
   disk (`merging.export_merge`) and answered by a new engine loaded from that folder, against the search's own
   path (in-memory merge, refresh of the running engine) timed on the same candidates in the same run.

It prints plans, question-evaluations, seconds, when each reached the grid's best dev plan, and the held-out
accuracy (exact interval) of the search's plan and the grid's best. At 8B (timing only, no evaluation) it
times one candidate both ways with the engine this machine's plan gives (`eight_b`): the in-memory merge and
refresh against export to disk and a new engine.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from layerswap.engines import EngineSettings, TransformersEngine, load_model  # noqa: E402
from layerswap.merge.merging import export_merge  # noqa: E402
from layerswap.recipe.plans import Plan  # noqa: E402
from layerswap.recipe.recipes import Recipe  # noqa: E402
from layerswap.search import SearchConfig, grid_space, search  # noqa: E402
from layerswap.search.store import Identity  # noqa: E402
from layerswap.serving.workbench import Workbench  # noqa: E402

DEMO = ("assets:demo/math", "assets:demo/lang", "assets:demo/base")
EIGHT_B_PLANS = [Plan(b=5, u=2, tb=1, tu=1), Plan(b=4, u=3, tb=0, tu=1)]
PROBE = ["Question: Tom has 3 apples and buys 4 more. How many apples does he have? Answer:"]


def _timed_search(cfg: SearchConfig, results: Path, engine: EngineSettings):
    """The search, and for each plan as it finished: (seconds since the start, question-evaluations so far)."""
    marks: list[float] = []
    t0 = time.perf_counter()

    def progress(f: float, text: str) -> None:
        head = text.split(" plans")[0]
        if "/" in head and head.split("/")[0].isdigit() and int(head.split("/")[0]) > len(marks):
            marks.append(time.perf_counter() - t0)

    r = search(*DEMO[:2], DEMO[2], cfg, results=results, engine=engine, progress=progress)
    used, at = 0, []
    for t, s in zip(r.trials, marks):
        used += len(t.race.scores) * len(cfg.langs)
        at.append((s, used))
    return r, at


def _reached(r, at, plan: Plan):
    """(plans, seconds, question-evaluations) when the search first scored `plan` on every dev question."""
    for i, (t, (s, used)) in enumerate(zip(r.trials, at)):
        if t.plan == plan and t.race.complete:
            return i + 1, s, used
    return None


def _disk_loop(r, cfg: SearchConfig, engine: EngineSettings, n: int) -> tuple[float, float, int]:
    """Seconds for the search's first `n` candidates on their questions: in memory (build + refresh) vs the disk
    loop (export, new engine); both answer the same questions."""
    wb = Workbench.from_settings(engine)
    wb.load(*DEMO[:2], DEMO[2])
    ident = Identity.of(wb.checkpoints, False, r.split.dev_source or cfg.source, cfg.evals(), {"engine": engine.engine,
                                                                        "chat_template": engine.chat_template},
                        cfg.langs)
    dev = list(r.split.dev)
    mem = disk = 0.0
    tmp = Path(tempfile.mkdtemp(prefix="bench-search-"))
    try:
        for t in r.trials[:n]:
            cfgq = ident.config(dev[:len(t.race.scores)])
            t0 = time.perf_counter()
            wb.build(t.plan)
            wb.evaluate(cfgq, roles=("merged",))
            mem += time.perf_counter() - t0
            t0 = time.perf_counter()
            out = tmp / "merged"
            export_merge(wb.checkpoints["math"], wb.checkpoints["lang"], Recipe(plan=t.plan), out,
                         base=wb.checkpoints["base"], overwrite=True, card=False)
            eng = TransformersEngine(load_model(out, "cpu"), wb.engines["math"].tokenizer, batch_size=engine.batch_size)
            from layerswap.evaluation.run import evaluate

            evaluate({"merged model": eng}, cfgq)
            disk += time.perf_counter() - t0
            del eng
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        wb.close()
    return mem, disk, min(n, len(r.trials))


def _grid_order(g, seconds: float, n_dev: int):
    """(plans, seconds, question-evaluations) until the grid, run in its own order (b, u, tb, tu ascending, one plan per
    distinct model), has scored its best plan; seconds at the grid's mean time per plan."""
    space = grid_space(g.space.num_layers)
    seen, k = set(), 0
    for p in space.plans():
        e = space.effect(p)
        if e in seen:
            continue
        seen.add(e)
        k += 1
        if p == g.plan:
            break
    return k, seconds / max(g.evaluated["plans"], 1) * k, k * n_dev


def demo(args) -> None:
    engine = EngineSettings(engine="transformers", device="cpu", batch_size=64)
    base = dict(langs=["xx"], source=str(ROOT / "assets" / "demo" / "mgsm"), seed=args.seed,
                max_new_tokens=args.max_new_tokens)
    work = Path(tempfile.mkdtemp(prefix="bench-search-"))
    try:
        t0 = time.perf_counter()
        r, at = _timed_search(SearchConfig(budget=args.budget, **base), work / "search.jsonl", engine)
        s_search = time.perf_counter() - t0
        t0 = time.perf_counter()
        g_cfg = SearchConfig(budget=10_000, strategy="exhaustive", halving=False, transitions=("flat:0.5",),
                             non_layer=("neighbour",), **base)
        g, g_at = _timed_search(g_cfg, work / "grid.jsonl", engine)
        s_grid = time.perf_counter() - t0
        mem, disk, n = _disk_loop(r, SearchConfig(budget=args.budget, **base), engine, args.disk)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    hit = _reached(r, at, g.plan)
    g_hit = _grid_order(g, s_grid, len(r.split.dev))
    lo, hi = g.test["interval"]
    rows = [
        ("search (TPE + halving)", r.evaluated["plans"], r.evaluated["questions"], s_search,
         r.plan.title(), r.dev["accuracy"], r.test),
        (f"exhaustive grid (b, u, tb, tu: {grid_space(g.space.num_layers).size()} plans, distinct models)",
         g.evaluated["plans"], g.evaluated["questions"], s_grid,
         g.plan.title(), g.dev["accuracy"], g.test),
    ]
    print(f"\nDemo organism, Kovani, split seed {args.seed}: {len(r.split.dev)} dev / {len(r.split.test)} held-out "
          f"questions, transformers engine, at most {args.max_new_tokens} new tokens, torch threads "
          f"{torch.get_num_threads()}\n")
    print("| run | plans | dev question-evaluations | seconds (incl. held-out scoring) | plan found | dev | held-out [95 % exact] |")
    print("|---|---|---|---|---|---|---|")
    for name, plans, q, s, title, dev, test in rows:
        print(f"| {name} | {plans} | {q:,} | {s:.0f} | {title} | {100 * dev:.1f} % | {100 * test['accuracy']:.1f} % "
              f"[{100 * test['interval'][0]:.1f}, {100 * test['interval'][1]:.1f}] |")
    print(f"\nsearch / grid question-evaluations: {r.evaluated['questions'] / g.evaluated['questions']:.4f}; "
          f"seconds: {s_search / s_grid:.3f}")
    inside = lo <= r.test["accuracy"] <= hi
    print(f"search's held-out accuracy inside the grid best's exact interval [{100 * lo:.1f}, {100 * hi:.1f}]: {inside}")
    if hit:
        print(f"the grid's best dev plan ({g.plan.title()}): reached by the search after {hit[0]} plans, {hit[1]:.1f} s, "
              f"{hit[2]:,} question-evaluations; by the grid in its own order after {g_hit[0]} plans, about {g_hit[1]:.0f} s, {g_hit[2]:,}")
    else:
        print(f"the search did not score the grid's best dev plan ({g.plan.title()}) on every dev question")
    print(f"\nper candidate, the search's first {n} candidates on their own questions: in memory {mem:.1f} s, disk loop "
          f"(export + new engine) {disk:.1f} s: {disk / mem:.2f}x")


def disk_loop_8b(args) -> None:
    """The disk loop's candidate at 8B (run by `eight_b` in a fresh process): export, a new engine, one token."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_common import build_trio

    from layerswap.models.checkpoints import Checkpoint
    from layerswap.engines import VLLMEngine
    from layerswap.engines.planning import plan_engines

    paths = build_trio(args.trio, size="8b")
    cks = {r: Checkpoint.open(paths[r]) for r in ("math", "lang", "base")}
    out = Path(args.trio) / "bench-search-merged"
    try:
        t0 = time.perf_counter()
        export_merge(cks["math"], cks["lang"], Recipe(plan=EIGHT_B_PLANS[0]), out, base=cks["base"], overwrite=True,
                     card=False)
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.disk_loop in ("transformers", "none"):
            eng = TransformersEngine.from_pretrained(out, "cpu", use_chat_template=False)
        else:
            eng = VLLMEngine(out, plan_engines(cks).settings, use_chat_template=False)
        eng.generate(PROBE, max_new_tokens=1)
        t_start = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"DISK {t_export:.2f} {t_start:.2f}", flush=True)


def eight_b(args) -> None:
    """One candidate both ways on the 8B-shaped trio, with the engine this machine's plan gives two 8B experts (on
    a 24 GiB CPU machine: one vLLM engine, weights swapped; the transformers pair would need 31 GiB): the search's
    path (the merge streamed into the running engine, then one token from it) against the disk loop's (the merge
    exported, a new engine started on the folder, one token)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_common import build_trio

    paths = build_trio(args.trio, size="8b")
    probe = Workbench(engine="auto", chat_template=False)
    probe.check(str(paths["math"]), str(paths["lang"]), str(paths["base"]))
    plan = probe.engine_plan
    # the disk loop first, in a process of its own: an in-process engine's memory is not given back to the OS
    import subprocess

    child = subprocess.run([sys.executable, __file__, "--size", "8b", "--trio", args.trio, "--disk-loop",
                            plan.arrangement], capture_output=True, text=True)
    last = child.stdout.strip().splitlines()[-1:] or [""]
    if child.returncode or not last[0].startswith("DISK "):
        raise SystemExit(f"the disk loop failed ({child.returncode}):\n{child.stderr[-2000:]}")
    t_export, t_start = map(float, last[0].split()[1:])
    print(f"disk loop: export {t_export:.1f} s, new engine and one token {t_start:.1f} s", flush=True)
    wb = Workbench(engine="auto", chat_template=False)
    t0 = time.perf_counter()
    wb.load(str(paths["math"]), str(paths["lang"]), str(paths["base"]))
    load = time.perf_counter() - t0
    arrangement = wb.engine_plan.arrangement
    mem = []
    for p in EIGHT_B_PLANS[:max(1, args.builds)]:
        t0 = time.perf_counter()
        wb.build(p)
        wb.engines["merged"].generate(PROBE, max_new_tokens=1)  # a swapped engine takes the merge in here
        mem.append(time.perf_counter() - t0)
        print(f"in memory: {mem[-1]:.1f} s", flush=True)
    wb.close()
    mean = sum(mem) / len(mem)
    print(f"\n8B-shaped trio (Llama 3.1 8B dimensions, bf16) on this CPU: engine plan {arrangement}; experts loaded "
          f"and engines started in {load:.0f} s\n")
    print("| per candidate | seconds |\n|---|---|")
    print(f"| in memory: the merge streamed into the running engine + one token (mean of {len(mem)}) | {mean:.1f} |")
    print(f"| disk loop: export to disk + a new engine from the folder + one token | {t_export + t_start:.1f} "
          f"({t_export:.1f} + {t_start:.1f}) |")
    print(f"\nratio disk loop / in memory: {(t_export + t_start) / mean:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=("demo", "8b"), default="demo")
    ap.add_argument("--budget", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="the organism's protocol: 32")
    ap.add_argument("--disk", type=int, default=10, help="candidates timed through the disk loop")
    ap.add_argument("--trio", default="/work/bench8b", help="--size 8b: where the 8B-shaped trio is (or is built)")
    ap.add_argument("--builds", type=int, default=2, help="--size 8b: candidates timed in memory")
    ap.add_argument("--disk-loop", metavar="ARRANGEMENT", help=argparse.SUPPRESS)  # eight_b's child process
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.disk_loop:
        disk_loop_8b(args)
    else:
        demo(args) if args.size == "demo" else eight_b(args)


if __name__ == "__main__":
    main()
