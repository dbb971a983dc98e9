"""Load test: N concurrent visitors (gradio_client) on one app, loopback only, bounded in count and time.

    python3 scripts/load_test.py --clients 4 --rounds 2          # starts `app.py` (hosted mode) itself
    python3 scripts/load_test.py --url http://127.0.0.1:7860     # an app already running on loopback

Each visitor loads the demo, builds its own plan (different for each visitor), asks a Kovani question
and exports its plan. A cross-visitor leak is a merged answer that differs from what the visitor's own
export answers to the same prompt (generated here with the same engine code). Prints completed
requests, errors, p50/p95 latency per endpoint and leaks, and a JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
MAX_CLIENTS = 16


def plan_of(i: int) -> tuple:
    """A different plan per visitor (b, u, tb, tu), all valid for the demo's 8 layers."""
    return (1 + i % 4, i % 3, i % 2, 0)


def start_app(port: int, workdir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LAYERSWAP_MGSM_DIR"}  # the demo's own test sets
    env.update(LAYERSWAP_HOSTED="1", LAYERSWAP_ENGINE=os.environ.get("LAYERSWAP_ENGINE", "transformers"),
               GRADIO_ANALYTICS_ENABLED="False", LAYERSWAP_CACHE=str(workdir / "cache"), OMP_NUM_THREADS="1")
    log = open(workdir / "app.log", "w")
    return subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), "--host", "127.0.0.1",
                             "--device", "cpu"], cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_served(url: str, deadline: float) -> None:
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} was not served in time")


def merged_output(answer_md: str) -> str:
    """The merged model's answer as the page shows it ("" for the page's placeholder of an empty answer)."""
    from layerswap.ui.tabs.ask import EMPTY

    m = re.search(r"```\n(.*?)\n```", answer_md, re.S)
    out = m.group(1).strip() if m else ""
    return "" if out == EMPTY else out


def own_answer(zip_path: str, prompt: str, max_new: int) -> str:
    """What the visitor's own export answers to `prompt` (same engine code as the app)."""
    from layerswap.evaluation import mgsm
    from layerswap.engines import TransformersEngine, load_model, load_tokenizer

    d = Path(tempfile.mkdtemp(prefix="layerswap-load-"))
    zipfile.ZipFile(zip_path).extractall(d)
    eng = TransformersEngine(load_model(d, "cpu"), load_tokenizer(d))
    lang = mgsm.get_language("xx", str(REPO / "assets" / "demo" / "mgsm"))
    return eng.generate([prompt], max_new_tokens=max_new, stop=lang.stop)[0].strip()


def visitor(url: str, i: int, rounds: int, max_new: int, stats: dict, lock: threading.Lock) -> None:
    from gradio_client import Client

    def call(name: str, *args):
        t = time.perf_counter()
        try:
            out = c.predict(*args, api_name=f"/{name}")
            ok = True
            return out
        except Exception as e:  # counted, and the visitor goes on
            ok = False
            with lock:
                stats["error_messages"].append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            return None
        finally:
            with lock:
                stats["latency"].setdefault(name, []).append(time.perf_counter() - t)
                stats["completed" if ok else "errors"] += 1

    c = Client(url, verbose=False)
    plan = plan_of(i)
    for r in range(rounds):
        call("load", "assets:demo/base", "assets:demo/math", "assets:demo/lang")
        call("build", *plan)
        out = call("ask", "xx", (i + r) % 20, "", max_new, *plan)
        exp = call("export", "", False, *plan)
        if out is None or exp is None:
            continue
        prompt = re.search(r"```\n(.*?)\n```", out[0], re.S).group(1)
        mine = own_answer(exp[1]["value"] if isinstance(exp[1], dict) else exp[1], prompt, max_new)
        with lock:
            stats["checked"] += 1
            stats["distinct"].add(mine)
            if mine != merged_output(out[3]):
                stats["leaks"].append({"visitor": i, "round": r, "plan": plan, "app": merged_output(out[3]), "own": mine})


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--url", help="an app on loopback (default: start one in hosted mode)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole test")
    args = ap.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise SystemExit(f"--clients must be 1..{MAX_CLIENTS}")
    if args.url and urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit("the load test only drives an app on loopback")
    deadline = time.time() + args.timeout
    from transformers import AutoModelForCausalLM  # noqa: F401  (imported once, before the visitor threads)

    proc = None
    url = args.url
    t_start = time.perf_counter()
    if url is None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_app(port, Path(tempfile.mkdtemp(prefix="layerswap-loadtest-")))
        url = f"http://127.0.0.1:{port}"
    try:
        wait_served(url, deadline)
        served = time.perf_counter() - t_start
        stats = {"completed": 0, "errors": 0, "checked": 0, "leaks": [], "latency": {}, "error_messages": [],
                 "distinct": set()}
        lock = threading.Lock()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            futs = [pool.submit(visitor, url, i, args.rounds, args.max_new_tokens, stats, lock)
                    for i in range(args.clients)]
            for f in futs:
                f.result(timeout=max(1.0, deadline - time.time()))
        wall = time.perf_counter() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{args.clients} visitors x {args.rounds} rounds in {wall:.1f} s (page served after {served:.1f} s)")
    print(f"completed {stats['completed']}, errors {stats['errors']}, answers checked against own export "
          f"{stats['checked']}, cross-visitor leaks {len(stats['leaks'])}")
    print(f"{'endpoint':<8} {'n':>4} {'p50 s':>7} {'p95 s':>7}")
    for name, xs in stats["latency"].items():
        print(f"{name:<8} {len(xs):>4} {statistics.median(xs):>7.2f} {pct(xs, 0.95):>7.2f}")
    for m in stats["error_messages"][:10]:
        print("error:", m)
    summary = {k: stats[k] for k in ("completed", "errors", "checked")}
    # the leak check has teeth only if the visitors' plans answer differently: count the distinct answers
    summary.update(leaks=len(stats["leaks"]), distinct_answers=len(stats["distinct"]), clients=args.clients, rounds=args.rounds, wall_s=round(wall, 1),
                   p50={k: round(statistics.median(v), 2) for k, v in stats["latency"].items()},
                   p95={k: round(pct(v, 0.95), 2) for k, v in stats["latency"].items()})
    print(json.dumps(summary))
    return 0 if stats["errors"] == 0 and not stats["leaks"] else 1


if __name__ == "__main__":
    sys.exit(main())
