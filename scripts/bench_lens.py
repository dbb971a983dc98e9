#!/usr/bin/env python3
"""Benchmark: the latent-language lens (`layerswap.analysis.lens.run_lens`) on the demo organism and on a big checkpoint.

    python3 scripts/bench_lens.py [--demo assets/demo] [--demo-mgsm assets/demo/mgsm --demo-lang xx]
                                  [--big /work/bench8b/llama-8b-trio-v1 --big-mgsm DIR --big-lang sw]
                                  [--big-batch 1] [--big-roles math,lang,merged] [--threads 2] [--cold] [--markdown]

Every measurement runs in its own process (so peak RSS is its own), all in one invocation:

  demo memory     the organism's math, language, merged and base models in memory, batch 32, index 0
  demo stream     the same, streamed block by block from the files (one block resident)
  big stream      the big trio (`--big`: base/, math/, lang/) streamed, `--big-batch` questions (the focus
                  question and its English twin for 1), roles `--big-roles`, the default plan for its depth
  big read floor  every weight file of the models the streamed run reads, read once front to back
                  (16 MiB blocks): the disk's share of the streamed run

`--cold` drops the files from the page cache before each run (posix_fadvise, no privileges needed).
Peak RSS is the process's maximum resident set (imports included); `RSS after imports` is the same
process's peak before the lens starts, so the difference is the lens's own.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from bench_common import drop_page_cache  # noqa: E402


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: F401  (imports off the clock)

    from layerswap import Plan
    from layerswap.analysis.lens import LensConfig, run_lens

    if spec.get("kind") == "floor":
        t0 = time.perf_counter()
        n = 0
        for p in spec["paths"]:
            for f in sorted(Path(p).rglob("*.safetensors")):
                with open(f, "rb", buffering=0) as fh:
                    while chunk := fh.read(16 * 2**20):
                        n += len(chunk)
        return {"seconds": time.perf_counter() - t0, "bytes": n, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    root = Path(spec["root"])
    plan = Plan(**spec["plan"]) if spec.get("plan") else None
    cfg = LensConfig(spec["lang"], index=spec["index"], batch=spec["batch"], source=spec["mgsm"])
    base = root / "base" if "base" in spec["roles"] else None
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak so far: the imports
    t0 = time.perf_counter()
    res = run_lens(root / "math", root / "lang", plan, base=base, config=cfg, forward=spec["forward"],
                   roles=tuple(spec["roles"]), device="cpu")
    secs = time.perf_counter() - t0
    return {"seconds": secs, "per_model": {r: m.seconds for r, m in res.models.items()},
            "rss_after_imports": rss0, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "after_layer_1": {r: [m.layers[2].alignment, m.layers[2].cka]
                                                            for r, m in res.models.items() if len(m.layers) > 2}}


def run(spec: dict, cold_paths=()) -> dict:
    if cold_paths:
        drop_page_cache(cold_paths)
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), PYTHONPATH=str(REPO)))
    if out.returncode != 0:
        raise SystemExit(f"{spec['name']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--demo", default=str(REPO / "assets" / "demo"))
    ap.add_argument("--demo-mgsm", default=None, help="default: DEMO/mgsm")
    ap.add_argument("--demo-lang", default="xx")
    ap.add_argument("--big", help="folder with base/, math/, lang/ of a big checkpoint (e.g. the 8B-shaped trio)")
    ap.add_argument("--big-mgsm", default=os.environ.get("LAYERSWAP_MGSM_DIR"))
    ap.add_argument("--big-lang", default="sw")
    ap.add_argument("--big-batch", type=int, default=1)
    ap.add_argument("--big-roles", default="math,lang,merged")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the weight files from the page cache before each run")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    demo = Path(args.demo)
    rows = []
    load0 = os.getloadavg()
    common = {"threads": args.threads, "index": 0}
    demo_roles = ["math", "lang", "merged", "base"]
    demo_spec = {**common, "root": str(demo), "mgsm": args.demo_mgsm or str(demo / "mgsm"), "lang": args.demo_lang,
                 "batch": 32, "roles": demo_roles, "plan": _demo_plan(demo)}
    for fwd in ("memory", "stream"):
        r = run({**demo_spec, "name": f"demo {fwd}", "forward": fwd}, [demo] if args.cold else ())
        rows.append((f"demo organism, {fwd}", r))
    if args.big:
        big = Path(args.big)
        roles = [x for x in args.big_roles.split(",") if x]
        spec = {**common, "root": str(big), "mgsm": args.big_mgsm, "lang": args.big_lang, "batch": args.big_batch,
                "roles": roles, "forward": "stream", "name": "big stream"}
        files = [big / r for r in ("math", "lang", "base") if r in roles or (r in ("math", "lang") and "merged" in roles)]
        rows.append((f"{big.name}, stream ({', '.join(roles)}; batch {args.big_batch})", run(spec, files if args.cold else ())))
        reads = [big / "math"] * (("math" in roles) + ("merged" in roles)) + [big / "lang"] * (("lang" in roles) + ("merged" in roles))
        reads += [big / "base"] * ("base" in roles)
        rows.append((f"{big.name}, read floor (the same {len(reads)} model reads)",
                     run({**common, "kind": "floor", "paths": [str(p) for p in reads], "name": "floor"},
                         files if args.cold else ())))
    load1 = os.getloadavg()
    _print(rows, args, load0, load1)


def _demo_plan(demo: Path) -> dict | None:
    p = demo / "recommended_plan.json"
    if not p.exists():
        return None
    raw = json.loads(p.read_text())
    return {k: raw[k] for k in ("b", "u", "tb", "tu", "transition", "transition_weight", "non_layer")}


def _print(rows, args, load0, load1) -> None:
    import torch
    import transformers

    head = (f"{dt.datetime.now():%Y-%m-%d %H:%M} · {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} torch threads"
            + (", cold page cache" if args.cold else ", warm page cache")
            + f" · load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print(head)
    gib = 2**30
    lines = ["| run | seconds | per model (s) | peak RSS (GiB) | RSS after imports (GiB) |", "|---|---|---|---|---|"]
    for name, r in rows:
        per = ", ".join(f"{k} {v:.1f}" for k, v in r.get("per_model", {}).items())
        extra = f" ({r['bytes'] / 1e9:.1f} GB, {r['bytes'] / 1e9 / r['seconds']:.2f} GB/s)" if "bytes" in r else ""
        after = f"{r['rss_after_imports'] / gib:.2f}" if "rss_after_imports" in r else "-"
        lines.append(f"| {name}{extra} | {r['seconds']:.1f} | {per} | {r['peak_rss'] / gib:.2f} | {after} |")
    by = dict(rows)
    ratios = []
    d = [r for n, r in rows if n.startswith("demo")]
    if len(d) == 2:
        ratios.append(f"demo: streamed / in memory = {d[1]['seconds'] / d[0]['seconds']:.2f}x")
    big = [r for n, r in rows if not n.startswith("demo")]
    if len(big) == 2:
        ratios.append(f"big: streamed lens / read floor = {big[0]['seconds'] / big[1]['seconds']:.2f}x")
    print("\n".join(lines))
    for r in ratios:
        print(r)
    for name, r in by.items():
        if r.get("after_layer_1"):
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{name}: after layer 1 (cosine, CKA): " + ", ".join(f"{k} {fmt(v[0])}/{fmt(v[1])}"
                                                                      for k, v in r["after_layer_1"].items()))


if __name__ == "__main__":
    main()
