#!/usr/bin/env python3
"""Memory of the demo's three CPU vLLM engines: sized from the models, inside the app's process (what the engine
plan starts now) against the earlier setting (1 GiB KV cache each, one engine process each).

    python scripts/bench_serving.py [--math assets:demo/math --lang assets:demo/lang]

Each setting runs in a fresh process of its own (so neither sees the other's memory): it imports vLLM, reads the
resident memory of its process tree, starts the three engines the plan asks for (math, language, and a third on the
math expert's weights where the merge goes), answers one question on each, and reads the tree's resident memory
again. Prints a Markdown table with both and their ratio, and the machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GiB = 2**30


def tree_rss() -> int:
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])


def measure(setting: str, math: str, lang: str) -> dict:
    """One setting, in this process: ``planned`` (the engine plan's sizes, in-process) or ``separate`` (1 GiB KV
    cache per engine, one engine process each: the setting before)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from layerswap.models.checkpoints import Checkpoint
    from layerswap.engines import VLLMEngine, VLLMSettings, plan_engines
    from layerswap.models.presets import ASSETS_PREFIX, assets_path

    refs = {r: str(assets_path(x)) if x.startswith(ASSETS_PREFIX) else x for r, x in (("math", math), ("lang", lang))}
    cks = {r: Checkpoint.open(p) for r, p in refs.items()}
    plan = plan_engines(cks, engine="vllm", serving="three")
    settings = plan.settings
    if setting == "separate":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        settings = VLLMSettings(kv_cache_gib=1.0, enforce_eager=True)
        import layerswap.engines.vllm_engine as ve

        real_env = ve._engine_env
        ve._engine_env = lambda device: real_env("cuda")  # "not the CPU": keeps vLLM's own engine processes
    import vllm  # noqa: F401  (imported before the first reading: both settings pay it)

    before = tree_rss()
    engines = [VLLMEngine.acquire(refs[r], settings) for r in ("math", "lang", "math")]
    answers = [e.generate(["Question: 2 + 3 = ?"], max_new_tokens=8)[0] for e in engines]
    after = tree_rss()
    for e in engines:
        e.close()
    return {"setting": setting, "kv_cache_mib": round((settings.kv_cache_gib or 1) * 1024, 1),
            "engines_gib": (after - before) / GiB, "process_gib": after / GiB, "answers": answers,
            "plan": plan.estimate.describe()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--math", default="assets:demo/math")
    ap.add_argument("--lang", default="assets:demo/lang")
    ap.add_argument("--one", choices=("planned", "separate"), help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.math, args.lang)), flush=True)
        return 0
    rows = {}
    for setting in ("planned", "separate"):
        r = subprocess.run([sys.executable, __file__, "--one", setting, "--math", args.math, "--lang", args.lang],
                           capture_output=True, text=True, timeout=1800)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
            return 1
        rows[setting] = json.loads(line[len("RESULT "):])
    p, s = rows["planned"], rows["separate"]
    import torch
    import vllm

    print(f"{dt.date.today()} · {platform.processor() or platform.machine()}, {os.cpu_count()} cores · vllm "
          f"{vllm.__version__}, torch {torch.__version__} · models {args.math}, {args.lang}")
    print(f"plan: {p['plan']}")
    print()
    print("| setting | KV cache per engine | three engines (resident memory added) | whole process tree |")
    print("|---|---|---|---|")
    print(f"| planned: sized from the models, in the app's process | {p['kv_cache_mib']} MiB | {p['engines_gib']:.2f} GiB "
          f"| {p['process_gib']:.2f} GiB |")
    print(f"| before: 1 GiB KV cache, an engine process each | {s['kv_cache_mib']:.0f} MiB | {s['engines_gib']:.2f} GiB "
          f"| {s['process_gib']:.2f} GiB |")
    print(f"| ratio (before / planned) | | {s['engines_gib'] / p['engines_gib']:.1f}x | "
          f"{s['process_gib'] / p['process_gib']:.1f}x |")
    print(f"\nsame answers in both settings: {p['answers'] == s['answers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
