#!/usr/bin/env python3
"""Benchmark: layerswap merge vs mergekit on the same layer-swap plan, with `cp` as the floor.

    python3 scripts/bench_merge.py [--size 1b|8b] [--root DIR] [--repeats N] [--plan 5,2,1,1] [--cold]

Builds (or reuses) the Llama-shape trio of `bench_common.py` (``1b``: ~1.1B, 3 x 2.2 GB, under
/work/bench-cache; ``8b``: Llama 3.1 8B dimensions, 3 x 16 GB, under /work/bench8b), then
alternates, per repeat: `layerswap merge` (CLI), `mergekit-yaml` on the config that `layerswap
export-yaml` writes for the same plan, and `cp -r` of one expert (reading and writing the same
bytes once: the floor); mergekit only in the first ``--mergekit-repeats`` (at 8b one run takes
minutes and its ratio is far from the question). The page cache is warmed first, or with ``--cold`` (the default at 8b,
whose trio does not fit in memory) the trio's pages are dropped before every command. Each
command runs as its own process; wall time and that process's peak RSS are recorded. Every
output's tensors are hashed (outside the timing) and the output removed at once, so the disk
holds one output at a time; at the end the layerswap and mergekit outputs are compared tensor by
tensor. Prints a table with ratios measured in this one run, the machine and the load average.
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
sys.path.insert(0, str(HERE.parent))

from bench_common import SIZES, build_trio, drop_page_cache  # noqa: E402
from layerswap.core.runtime import ram_available  # noqa: E402


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


def digests(folder: Path) -> dict[str, tuple]:
    """Per tensor: (dtype, shape, blake2b of its bytes), read straight from the safetensors files."""
    import hashlib

    from layerswap.models.tensorfile import read_header

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for name, e in read_header(f).items():
                h = hashlib.blake2b(digest_size=16)
                fh.seek(e.start)
                left = e.nbytes
                while left:
                    block = fh.read(min(left, 64 << 20))
                    h.update(block)
                    left -= len(block)
                out[name] = (e.dtype, e.shape, h.hexdigest())
    return out


def compare(a: dict[str, tuple], b: dict[str, tuple]) -> tuple[int, int]:
    """(bit-identical tensors, tensors of a) between two outputs' digests."""
    return sum(1 for k, v in a.items() if b.get(k) == v), len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--root", default=None, help="where the trio lives (default: $LAYERSWAP_BENCH_CACHE or "
                                                  "/work/bench-cache for 1b, /work/bench8b for 8b)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1b), 1 (8b)")
    ap.add_argument("--plan", default="5,2,1,1", help="b,u,tb,tu")
    ap.add_argument("--mergekit-repeats", type=int, default=None, help="mergekit runs in the first N repeats only "
                    "(default: every repeat at 1b, 1 at 8b, where one run takes minutes)")
    ap.add_argument("--mergekit-args", default="", help="extra mergekit-yaml options (at 8b with under 14 GiB "
                    "available: --out-shard-size 1B)")
    ap.add_argument("--cold", action="store_true", default=None, help="drop the trio's cached pages before every "
                    "command (default at 8b)")
    args = ap.parse_args()
    big = args.size == "8b"
    root = args.root or ("/work/bench8b" if big else os.environ.get("LAYERSWAP_BENCH_CACHE", "/work/bench-cache"))
    repeats = args.repeats or (1 if big else 3)
    cold = big if args.cold is None else args.cold
    b, u, tb, tu = (int(x) for x in args.plan.split(","))
    trio = build_trio(root, size=args.size)
    work = Path(root) / "bench-merge-out"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_bytes = sum(f.stat().st_size for f in trio["math"].glob("*.safetensors"))
    free = shutil.disk_usage(work).free
    if free < 1.1 * model_bytes:
        raise SystemExit(f"{work}: one merged model needs {model_bytes / 1e9:.1f} GB of disk, {free / 1e9:.1f} GB free")
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
    mk_extra = args.mergekit_args.split()
    if big and not mk_extra and (ram_available() or 0) < 14 * 2**30:
        # mergekit holds a whole output shard (5B parameters by default: ~10 GB in bf16) in memory
        mk_extra = ["--out-shard-size", "1B"]
        print(f"only {(ram_available() or 0) / 2**30:.1f} GiB of memory available: mergekit runs with --out-shard-size 1B "
              "(~2 GB held instead of ~10 GB; same tensors, smaller shards)")
    mk_name = "mergekit-yaml" + (f" ({' '.join(mk_extra)})" if mk_extra else "")
    cmds = {
        "layerswap merge": lambda o: [py, "-m", "layerswap.cli", "merge", *models, "--base", str(trio["base"]),
                                      *plan, "-o", str(o), "-q"],
        mk_name: lambda o: [mk, str(yml), str(o), "--copy-tokenizer", "--quiet", *mk_extra],
        "cp -r (floor)": lambda o: ["cp", "-r", str(trio["math"]), str(o)],
    }
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    load0 = os.getloadavg()
    print(f"trio: {trio['math'].parent} (3 x {model_bytes / 1e9:.2f} GB, bf16)")
    print(f"plan: b={b} u={u} tb={tb} tu={tu}; {'cold (pages dropped before every command)' if cold else 'warm'}")
    if not cold:
        warm(trio.values())
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    sums: dict[str, dict] = {}
    mk_repeats = args.mergekit_repeats or (1 if big else repeats)
    for rep in range(repeats):
        for name, cmd in cmds.items():
            if name == mk_name and rep >= mk_repeats:
                continue
            out = work / f"{name.split()[0]}-{rep}"
            if cold:
                drop_page_cache(trio.values())
            results[name].append(run(cmd(out), env))
            print(f"  repeat {rep + 1} {name:<16} {results[name][-1][0]:7.2f} s  {results[name][-1][1]:7.0f} MB  "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            if name == "layerswap merge" and rep == 0 or name == mk_name and rep == mk_repeats - 1:
                sums[name] = digests(out)
            shutil.rmtree(out)
    same, total = compare(sums["layerswap merge"], sums[mk_name])
    ref = statistics.median(w for w, _ in results["layerswap merge"])
    floor = statistics.median(w for w, _ in results["cp -r (floor)"])
    load1 = os.getloadavg()
    print()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}; "
          f"started {started}; load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} at start, "
          f"{load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} at the end; {repeats} repeat(s), {'cold' if cold else 'warm'}")
    print("| tool | median s | min s | peak RSS MB | vs layerswap | vs cp floor |")
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        med = statistics.median(w for w, _ in rs)
        print(f"| {name}{f' ({len(rs)} runs)' if len(rs) != repeats else ''} | {med:.2f} | {min(w for w, _ in rs):.2f} | {max(r for _, r in rs):.0f} | "
              f"{med / ref:.2f}x | {med / floor:.2f}x |")
    paired = [w / c for (w, _), (c, _) in zip(results["layerswap merge"], results["cp -r (floor)"])]
    print(f"\nlayerswap / cp, each repeat (run back to back, so under about the same load): "
          f"{', '.join(f'{r:.2f}x' for r in paired)}; median {statistics.median(paired):.2f}x")
    print(f"layerswap vs mergekit outputs: {same}/{total} tensors bit-identical")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
