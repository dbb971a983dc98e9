#!/usr/bin/env python3
"""Benchmark: layerswap merge vs mergekit on the same layer-swap plan, with `cp` as the floor.

    python3 scripts/bench_merge.py [--root /work/bench-cache] [--repeats 3] [--plan 5,2,1,1]

Builds (or reuses) the ~1.1B Llama-shape trio from `bench_common.py`, warms the page cache,
then alternates, per repeat: `layerswap merge` (CLI), `mergekit-yaml` on the config that
`layerswap export-yaml` writes for the same plan, and `cp -r` of one expert (reading and
writing the same bytes once: the floor). Each command runs as its own process; wall time and
that process's peak RSS (``wait4``) are recorded. At the end the layerswap and mergekit outputs
are compared tensor by tensor. Prints a table with ratios measured in this one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import build_trio  # noqa: E402


TIME = shutil.which("time") or "/usr/bin/time"


def run(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one command.

    RSS comes from GNU time run as a fresh process, so the benchmark's own memory (inherited by
    a fork before exec) does not count.
    """
    rss_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-rss-{os.getpid()}"
    use_time = Path(TIME).exists()
    full = [TIME, "-f", "%M", "-o", str(rss_file), *cmd] if use_time else cmd
    os.sync()  # every command starts with no dirty pages of the previous one still being written back
    t = time.perf_counter()
    p = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        err = p.stderr.read().decode()[-2000:] if p.stderr else ""
        raise SystemExit(f"failed: {' '.join(cmd)}\n{err}")
    rss_kb = float(rss_file.read_text().split()[-1]) if use_time else ru.ru_maxrss
    return wall, rss_kb / 1024


def warm(paths) -> None:
    for p in paths:
        for f in Path(p).glob("*.safetensors"):
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def compare(a: Path, b: Path) -> tuple[int, int]:
    """(bit-identical tensors, tensors) between two model folders."""
    import torch

    from layerswap import Checkpoint

    ca, cb = Checkpoint.open(a), Checkpoint.open(b)
    same = 0
    for k, info in ca.tensors.items():
        other = cb.tensors.get(k)
        if other is None or other.shape != info.shape or other.dtype != info.dtype:
            continue
        ta, tb = ca.read(k).reshape(-1).view(torch.uint8), cb.read(k).reshape(-1).view(torch.uint8)
        same += int(torch.equal(ta, tb))
    return same, len(ca.tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.environ.get("LAYERSWAP_BENCH_CACHE", "/work/bench-cache"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plan", default="5,2,1,1", help="b,u,tb,tu")
    args = ap.parse_args()
    b, u, tb, tu = (int(x) for x in args.plan.split(","))
    trio = build_trio(args.root)
    work = Path(args.root) / "bench-merge-out"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    py = sys.executable
    mk = shutil.which("mergekit-yaml", path=str(Path(py).parent)) or shutil.which("mergekit-yaml")
    if mk is None:
        raise SystemExit("mergekit is not installed here: pip install 'mergekit>=0.1.5,<0.2'")
    plan = ["--b", str(b), "--u", str(u), "--tb", str(tb), "--tu", str(tu)]
    models = ["--math", str(trio["math"]), "--lang", str(trio["lang"])]
    yml = work / "merge.yml"
    subprocess.run([py, "-m", "layerswap.cli", "export-yaml", *models, *plan, "-o", str(yml)], check=True,
                   stdout=subprocess.DEVNULL)
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    cmds = {
        "layerswap merge": lambda o: [py, "-m", "layerswap.cli", "merge", *models, "--base", str(trio["base"]),
                                      *plan, "-o", str(o), "-q"],
        "mergekit-yaml": lambda o: [mk, str(yml), str(o), "--copy-tokenizer", "--quiet"],
        "cp -r (floor)": lambda o: ["cp", "-r", str(trio["math"]), str(o)],
    }
    print(f"trio: {trio['math'].parent} (3 x {sum(f.stat().st_size for f in trio['math'].glob('*.safetensors')) / 1e9:.2f} GB, bf16)")
    print(f"plan: b={b} u={u} tb={tb} tu={tu}; warming the page cache ...")
    warm(trio.values())
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    for rep in range(args.repeats):
        for name, cmd in cmds.items():
            out = work / f"{name.split()[0]}-{rep}"
            results[name].append(run(cmd(out), env))
            print(f"  repeat {rep + 1} {name:<16} {results[name][-1][0]:7.2f} s  {results[name][-1][1]:7.0f} MB")
            if rep < args.repeats - 1:
                shutil.rmtree(out)
    last = args.repeats - 1
    same, total = compare(work / f"layerswap-{last}", work / f"mergekit-yaml-{last}")
    ref = statistics.median(w for w, _ in results["layerswap merge"])
    floor = statistics.median(w for w, _ in results["cp -r (floor)"])
    print()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("| tool | median s | min s | peak RSS MB | vs layerswap | vs cp floor |")
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        med = statistics.median(w for w, _ in rs)
        print(f"| {name} | {med:.2f} | {min(w for w, _ in rs):.2f} | {max(r for _, r in rs):.0f} | "
              f"{med / ref:.2f}x | {med / floor:.2f}x |")
    print(f"\nlayerswap vs mergekit outputs: {same}/{total} tensors bit-identical")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
