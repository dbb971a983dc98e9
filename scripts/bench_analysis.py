#!/usr/bin/env python3
"""Benchmark: the streaming analysis against a naive full-load implementation and the read floor.

    python3 scripts/bench_analysis.py [--size 1b|8b] [--root DIR] [--k 1] [--repeat 1] [--no-naive]
                                      [--no-torch] [--runs A,B] [--device cpu|cuda] [--markdown]
    python3 scripts/bench_analysis.py --family 2 [--size 8b]     # a family: one math expert, N languages

Runs on a Llama-shape trio of `bench_common.build_trio` (``1b``: ~1.1B parameters, 6.6 GB, under
/work/bench-cache; ``8b``: Llama 3.1 8B dimensions, 48 GB, under /work/bench8b; built on first
use). Every measurement is its own process, so peak RSS is clean; all run in one invocation:

  read floor (reader)      every tensor of base, math and language expert read once, through the
                           same pread reader the analysis uses, no arithmetic
  read floor (sequential)  the three files read front to back in 16 MiB blocks
  streaming                layerswap.analysis.analyze(base, math, lang, ks=(k,), cache=False)
  streaming-2w             the same with workers=2 (two threads, each streaming half the tensors)
  streaming-torch          streaming with the torch kernels on CPU (LAYERSWAP_ANALYSIS_KERNEL=torch: the
                           main pass before the compiled loop; what runs without numba)
  naive                    safetensors.load_file of all three models, whole-tensor float32 arithmetic,
                           exact top-k% by np.partition over an expert's |Δ| of every entry

``--family N`` (N >= 2) measures a family instead, the trio's language expert plus N - 1 more
(`bench_common.build_extra_langs`: 16 GB each at 8b), all cold, in one invocation: `cat` of the
N + 2 models' files and of one trio's (the read floors, real ``cat`` into /dev/null), the family
analysis (`analyze_family`: base and math read once), and each of the N pair analyses (`analyze`,
one process each; the analyses' order turns each repeat, so a cache beneath this machine's helps each alike).
It reports each against its `cat`, and the family's time against the N pairs' summed, next to the read ratio
(N + 2) / 3N it should reach.

"cold" runs drop the files from the page cache first (posix_fadvise DONTNEED, no privileges
needed); "warm" runs read them from the page cache (not at 8b: 48 GB do not fit in memory, nor
does the naive run). The naive run, and the torch-kernel run, also check the streaming result:
thresholds, shares, overlaps and relative changes must agree.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_common import SIZES, build_trio, drop_page_cache, tensor_specs  # noqa: E402
from layerswap.core.runtime import ram_available  # noqa: E402

ROLES = ("base", "math", "lang")


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- workers (each in its own process) ------------------------------------------------------------

def work_floor_reader(paths, args) -> dict:
    from layerswap import Checkpoint
    from layerswap.analysis import CPU_CHUNK
    from layerswap.analysis.stream import ChunkStream

    cks = [Checkpoint.open(paths[r]) for r in ROLES]
    names = sorted(cks[0].tensors, key=lambda n: cks[0].tensors[n].start)
    with ChunkStream(cks, names, chunk_elems=CPU_CHUNK) as s:
        for _ in s:
            pass
        return {"bytes": s.bytes_read}


def work_floor_sequential(paths, args) -> dict:
    import numpy as np

    buf = np.empty(16 << 20, dtype=np.uint8)
    view = memoryview(buf)
    total = 0
    for r in ROLES:
        for f in sorted(paths[r].glob("*.safetensors")):
            fd = os.open(f, os.O_RDONLY)
            try:
                while True:
                    n = os.readv(fd, [view])
                    if n <= 0:
                        break
                    total += n
            finally:
                os.close(fd)
    return {"bytes": total}


def work_streaming(paths, args) -> dict:
    from layerswap import Checkpoint
    from layerswap.analysis import analyze

    cks = {r: Checkpoint.open(paths[r]) for r in ROLES}
    an = analyze(cks["base"], cks["math"], cks["lang"], ks=(args.k,), device=args.device, cache=False,
                 workers=args.workers)
    tk = an.topk_at(args.k)
    out = {"bytes": an.run.bytes_read, "passes": tk.passes, "sample_entries": an.run.sample_entries,
           "threshold": tk.threshold, "overlap": tk.overlap()}
    _save_result(args, an.tensors, an, tk)
    return out


def work_family(paths, args) -> dict:
    from layerswap import Checkpoint
    from layerswap.analysis import analyze_family

    langs = {r: Checkpoint.open(p) for r, p in paths.items() if r.startswith("lang")}
    fam = analyze_family(Checkpoint.open(paths["base"]), Checkpoint.open(paths["math"]), langs, ks=(args.k,),
                         device=args.device, cache=False, workers=args.workers)
    for r, an in fam.items():
        _save_result(argparse.Namespace(result=args.result.replace(".npz", f"-{r}.npz")), an.tensors, an,
                     an.topk_at(args.k))
    an = next(iter(fam.values()))
    return {"bytes": an.run.bytes_read, "passes": max(a.run.passes for a in fam.values()),
            "sample_entries": an.run.sample_entries}


def work_cat(paths, args) -> dict:
    """`cat` of every model's safetensors files into /dev/null (its CPU is the children's)."""
    files = [str(f) for r in paths for f in sorted(paths[r].glob("*.safetensors"))]
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"bytes": sum(os.path.getsize(f) for f in files), "child_cpu": c.ru_utime + c.ru_stime}


def _save_result(args, tensors, an, tk) -> None:
    import numpy as np

    names = [t.name for t in tensors]
    np.savez(args.result, names=np.array(names), **{
        f"relative_{r}": an.values(r, "relative") for r in ("math", "lang")},
        **{f"share_{r}": tk.share(r) for r in ("math", "lang")}, joint=tk.joint,
        cosine=an.values("overlap", "cosine"))


def work_naive(paths, args) -> dict:
    """What one writes first: load everything, whole-tensor arithmetic, one global selection."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    sd = {r: {k: v for f in sorted(paths[r].glob("*.safetensors")) for k, v in load_file(f).items()} for r in ROLES}
    names = list(sd["base"])
    T = len(names)
    rel = {r: np.zeros(T) for r in ("math", "lang")}
    cos = np.zeros(T)
    for i, n in enumerate(names):
        a = sd["base"][n].float()
        dm, dl = sd["math"][n].float() - a, sd["lang"][n].float() - a
        an2 = float(torch.sum(a * a, dtype=torch.float64))
        sm, sl = float(torch.sum(dm * dm, dtype=torch.float64)), float(torch.sum(dl * dl, dtype=torch.float64))
        rel["math"][i], rel["lang"][i] = (sm / an2) ** 0.5, (sl / an2) ** 0.5
        cos[i] = float(torch.sum(dm * dl, dtype=torch.float64)) / (sm * sl) ** 0.5 if sm and sl else float("nan")
    N = sum(sd["base"][n].numel() for n in names)
    K = min(N, max(1, round(args.k / 100 * N)))
    thr, frac, share = {}, {}, {}
    for r in ("math", "lang"):
        allabs = np.empty(N, dtype=np.float32)
        off = 0
        for n in names:
            d = (sd[r][n].float() - sd["base"][n].float()).abs().reshape(-1).numpy()
            allabs[off:off + len(d)] = d
            off += len(d)
        thr[r] = float(np.partition(allabs, N - K)[N - K])
        gt = int((allabs > thr[r]).sum())
        eq = int((allabs == thr[r]).sum())
        frac[r] = (K - gt) / eq
        del allabs
    joint = np.zeros(T)
    for r in ("math", "lang"):
        share[r] = np.zeros(T)
    for i, n in enumerate(names):
        a = sd["base"][n].float()
        p = {}
        for r in ("math", "lang"):
            d = (sd[r][n].float() - a).abs()
            p[r] = (d > thr[r]).double() + frac[r] * (d == thr[r]).double()
            share[r][i] = float(p[r].sum()) / K
        joint[i] = float((p["math"] * p["lang"]).sum())
    np.savez(args.result, names=np.array(names), relative_math=rel["math"], relative_lang=rel["lang"],
             share_math=share["math"], share_lang=share["lang"], joint=joint, cosine=cos)
    return {"threshold": thr, "overlap": float(joint.sum()) / K}


WORKERS = {"floor-reader": work_floor_reader, "floor-sequential": work_floor_sequential,
           "streaming": work_streaming, "streaming-2w": work_streaming, "streaming-torch": work_streaming,
           "naive": work_naive, "family": work_family, "cat": work_cat}


def worker_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    paths = {r: Path(p) for r, p in json.loads(args.paths).items()}
    base_rss = _rss_now()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    out = WORKERS[args.worker](paths, args)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.update(wall=wall, cpu=(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime) + out.pop("child_cpu", 0.0),
               peak_rss=r1.ru_maxrss * 1024, base_rss=base_rss)
    print("RESULT " + json.dumps(out))


# ---- the orchestrator ----------------------------------------------------------------------------

def run_worker(name: str, paths: dict, args, cold: bool, result: str) -> dict:
    if cold:
        drop_page_cache(paths.values())
    cmd = [sys.executable, __file__, "--worker", name, "--paths", json.dumps({r: str(p) for r, p in paths.items()}),
           "--k", str(args.k), "--device", args.device, "--threads", str(args.threads), "--result", result,
           "--workers", "2" if name == "streaming-2w" else "1"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               LAYERSWAP_ANALYSIS_KERNEL="torch" if name == "streaming-torch" else "auto")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def machine() -> str:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()
    pressure = ""
    try:
        pressure = open("/proc/pressure/cpu").readline().split()[1]  # avg10=..
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}; "
            f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at start, CPU pressure {pressure}")


def two_layers_bytes(spec: dict) -> int:
    return sum(2 * __import__("math").prod(s) for n, s in tensor_specs(spec) if ".layers.0." in n or ".layers.1." in n)


def compare(a_file: str, b_file: str) -> dict:
    import numpy as np

    a, b = np.load(a_file), np.load(b_file)
    ia = {n: i for i, n in enumerate(a["names"])}
    order = [ia[n] for n in b["names"]]
    out = {}
    for key in ("relative_math", "relative_lang", "cosine"):
        x, y = a[key][order], b[key]
        ok = np.isfinite(x) & np.isfinite(y)
        out[key] = float(np.max(np.abs(x[ok] - y[ok]) / np.maximum(np.abs(y[ok]), 1e-30)))
    for key in ("share_math", "share_lang", "joint"):
        out[key] = float(np.max(np.abs(a[key][order] - b[key])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--root", default=None, help="where the trio lives (default: $LAYERSWAP_BENCH_CACHE or "
                                                  "/work/bench-cache for 1b, /work/bench8b for 8b)")
    ap.add_argument("--k", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every worker (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch-kernel run")
    ap.add_argument("--runs", help="only these measurements, comma-separated (streaming always; e.g. "
                                   "floor-sequential,streaming with --repeat 3 for paired ratios)")
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the docs/benchmarks.md section")
    ap.add_argument("--family", type=int, default=0, metavar="N",
                    help="measure a family of N >= 2 language experts against N pair analyses and cat")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return

    big = args.size == "8b"
    root = args.root or ("/work/bench8b" if big else os.environ.get("LAYERSWAP_BENCH_CACHE", "/work/bench-cache"))
    if args.family:
        family_main(args, root)
        return
    paths = build_trio(root, size=args.size)
    info = json.loads((paths["base"].parent / "trio.json").read_text())
    started = dt.datetime.now().astimezone().isoformat(timespec="minutes")
    where = machine()
    tmp = Path(tempfile.mkdtemp(prefix="bench-analysis-"))
    plan = [("cold", "floor-reader"), ("cold", "floor-sequential"), ("cold", "streaming"), ("cold", "streaming-2w")]
    if not args.no_torch:
        plan.append(("cold", "streaming-torch"))
    naive_ok = not args.no_naive and not big and (ram_available() or 0) > 14 * 2**30
    if not args.no_naive and not naive_ok and not big:
        print(f"skipping naive: it holds ~12 GB, only {(ram_available() or 0) / 2**30:.1f} GiB available")
    if naive_ok:
        plan.append(("cold", "naive"))
    if not args.no_warm and not big:
        plan += [("warm", "floor-reader"), ("warm", "floor-sequential"), ("warm", "streaming"),
                 ("warm", "streaming-2w")]
    if args.runs:
        keep = set(args.runs.split(","))
        unknown = keep - set(WORKERS)
        if unknown or "streaming" not in keep:
            raise SystemExit(f"--runs: choose from {', '.join(WORKERS)}, streaming included (got {args.runs})")
        plan = [(mode, name) for mode, name in plan if name in keep]
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeat):
        # an unmeasured cold read first: the first cold read after other activity pays for reclaiming
        # memory (measured: up to 3x its usual system time), which would land on whichever run came first
        if not big:  # at 8b every read reclaims memory alike (the trio is twice the RAM)
            run_worker("floor-sequential", paths, args, True, str(tmp / "x.npz"))
        for mode, name in plan:
            if name == "naive" and rep > 0:  # minutes and ~16 GB: once is enough
                continue
            if mode == "warm" and name == "floor-reader" and rep == 0:
                run_worker("floor-sequential", paths, args, False, str(tmp / "x.npz"))  # fill the page cache
            r = run_worker(name, paths, args, mode == "cold", str(tmp / f"{name}.npz"))
            results.setdefault((mode, name), []).append(r)
            print(f"{mode:>4} {name:<17} {r['wall']:7.1f} s wall {r['cpu']:7.1f} s cpu  "
                  f"peak RSS {r['peak_rss'] / 2**20:7.0f} MiB (+{(r['peak_rss'] - r['base_rss']) / 2**20:.0f})",
                  flush=True)
    agree = compare(str(tmp / "streaming.npz"), str(tmp / "naive.npz")) if naive_ok else None
    if ("cold", "streaming-torch") in results:
        t, c = results[("cold", "streaming-torch")][-1], results[("cold", "streaming")][-1]
        print(f"compiled vs torch kernels: thresholds {'equal' if t['threshold'] == c['threshold'] else 'DIFFER'}; "
              f"max differences {compare(str(tmp / 'streaming.npz'), str(tmp / 'streaming-torch.npz'))}")
    if naive_ok:
        s, n = results[("cold", "streaming")][-1], results[("cold", "naive")][-1]
        same = s["threshold"] == n["threshold"]
        print(f"streaming vs naive: thresholds {'equal' if same else 'DIFFER'} {s['threshold']} / {n['threshold']}; "
              f"max differences {agree}")
    med = {key: {f: statistics.median(x[f] for x in v) for f in ("wall", "cpu", "peak_rss", "base_rss")}
           for key, v in results.items()}
    two = two_layers_bytes(SIZES[args.size])
    lines = []
    for mode in ("cold", "warm"):
        if (mode, "streaming") not in med:
            continue
        floor = min((med[(mode, f)]["wall"] for f in ("floor-reader", "floor-sequential") if (mode, f) in med),
                    default=float("nan"))
        lines.append(f"| **{mode}** page cache | | | | | |")
        for name in ("floor-sequential", "floor-reader", "streaming", "streaming-2w", "streaming-torch", "naive"):
            if (mode, name) not in med:
                continue
            m = med[(mode, name)]
            above = m["peak_rss"] - m["base_rss"]
            lines.append(f"| {name} | {m['wall']:.1f} | {m['wall'] / floor:.2f}x | {m['cpu']:.1f} | "
                         f"{m['peak_rss'] / 2**20:,.0f} MiB | {above / 2**20:,.0f} MiB ({above / two:.2f}x) |")
    table = ("| implementation | wall s | vs read floor | CPU s | peak RSS | above import baseline "
             "(x two layers) |\n|---|---|---|---|---|---|\n" + "\n".join(lines))
    s = results[("cold", "streaming")][-1]
    print()
    print(table)
    for name in ("streaming", "streaming-2w"):
        for floor_name in ("floor-sequential", "floor-reader"):
            if ("cold", floor_name) in results and ("cold", name) in results and args.repeat > 1:
                pairs = [x["wall"] / f["wall"] for x, f in zip(results[("cold", name)], results[("cold", floor_name)])]
                print(f"cold {name} / {floor_name}, each repeat (run back to back): "
                      f"{', '.join(f'{r:.2f}x' for r in pairs)}; median {statistics.median(pairs):.2f}x")
    print(f"\ntwo layers of one model = {two / 2**20:.0f} MiB; streaming made {s['passes']} pass(es), sampled "
          f"{s['sample_entries']:,} entries first, read {s['bytes'] / 1e9:.2f} GB")
    if args.markdown:
        print("\n---\n")
        load = os.getloadavg()
        print(f"Run {started} on {where}; {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end. torch "
              f"{info['torch']}, k = {args.k:g}%, {args.threads} torch thread(s), device {args.device}, median of "
              f"{args.repeat} (naive: 1 run). Trio: {paths['base'].parent} ({args.size}).")
        if agree is not None:
            print(f"Streaming and naive agree: thresholds {'identical' if same else 'DIFFERENT'}; largest differences "
                  + ", ".join(f"{k} {v:.1e}" for k, v in agree.items()) + ".")


def family_main(args, root: str) -> None:
    """--family N: cat, the family analysis and N pair analyses, all cold, one table."""
    from bench_common import build_extra_langs

    n = args.family
    if not 2 <= n <= 8:
        raise SystemExit("--family: give 2 to 8 language experts")
    paths = build_extra_langs(root, n - 1, size=args.size)
    langs = ["lang"] + [f"lang{j}" for j in range(2, n + 1)]
    fam = {r: paths[r] for r in ("base", "math", *langs)}
    trio = {r: paths[r] for r in ROLES}
    started, where = dt.datetime.now().astimezone().isoformat(timespec="minutes"), machine()
    tmp = Path(tempfile.mkdtemp(prefix="bench-analysis-"))
    cats = [("cat-family", "cat", fam), ("cat-trio", "cat", trio)]
    analyses = [("family", "family", fam)]
    analyses += [(f"pair-{r}", "streaming", {"base": paths["base"], "math": paths["math"], "lang": paths[r]})
                 for r in langs]
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        # the analyses' order turns each repeat (family first, then a pair first, ...): whatever a run leaves in a
        # cache beneath this machine's (a VM host's: fadvise empties only ours) helps each analysis alike
        turn = rep % len(analyses)
        for label, worker, ps in cats + analyses[turn:] + analyses[:turn]:
            r = run_worker(worker, ps, args, True, str(tmp / f"{label}.npz"))
            runs.setdefault(label, []).append(r)
            print(f"cold {label:<12} {r['wall']:7.1f} s wall {r['cpu']:7.1f} s cpu  {r['bytes'] / 1e9:6.2f} GB  "
                  f"peak RSS {r['peak_rss'] / 2**20:6.0f} MiB", flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("wall", "cpu", "peak_rss", "bytes")}
           for k, v in runs.items()}
    pairs = [med[f"pair-{r}"] for r in langs]
    same = all(compare(str(tmp / f"family-{r}.npz"), str(tmp / f"pair-{r}.npz")) == dict.fromkeys(
        ("relative_math", "relative_lang", "cosine", "share_math", "share_lang", "joint"), 0.0) for r in langs)
    sum_wall, sum_cpu = sum(p["wall"] for p in pairs), sum(p["cpu"] for p in pairs)
    rows = [("cat of the N + 2 models", med["cat-family"], med["cat-family"]["wall"]),
            ("cat of one trio", med["cat-trio"], med["cat-trio"]["wall"]),
            ("family analysis", med["family"], med["cat-family"]["wall"])]
    rows += [(f"pair analysis ({r})", med[f"pair-{r}"], med["cat-trio"]["wall"]) for r in langs]
    lines = [f"| {name} | {m['wall']:.1f} | {m['wall'] / floor:.2f}x | {m['cpu']:.1f} | {m['bytes'] / 1e9:.1f} | "
             f"{m['peak_rss'] / 2**20:,.0f} MiB |" for name, m, floor in rows]
    lines.append(f"| {n} pair analyses, summed | {sum_wall:.1f} | {sum_wall / (n * med['cat-trio']['wall']):.2f}x | "
                 f"{sum_cpu:.1f} | {sum(p['bytes'] for p in pairs) / 1e9:.1f} | |")
    print("\n| run | wall s | vs its cat | CPU s | GB read | peak RSS |\n|---|---|---|---|---|---|\n" + "\n".join(lines))
    goal = (n + 2) / (3 * n)
    ratio = med["family"]["wall"] / sum_wall
    print(f"\nfamily / {n} pairs: {ratio:.2f}x wall, {med['family']['cpu'] / sum_cpu:.2f}x CPU (reads: "
          f"{med['family']['bytes'] / sum(p['bytes'] for p in pairs):.2f}x; goal (N + 2) / 3N = {goal:.2f}: "
          f"{'met' if ratio <= goal else 'NOT met'}); family and pair results {'identical' if same else 'DIFFER'}")
    if args.markdown:
        load = os.getloadavg()
        print(f"\nRun {started} on {where}; {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end. k = {args.k:g}%, "
              f"{args.threads} torch thread(s), device {args.device}, median of {args.repeat}, every run cold, the "
              f"analyses' order turned each repeat. "
              f"Family: {paths['base'].parent} ({args.size}), {n} language experts.")


if __name__ == "__main__":
    main()
