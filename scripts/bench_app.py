#!/usr/bin/env python3
"""The page at any size: from Load to the compatibility report and to the heatmaps, against the CLI's analysis of the
same trio in the same run; and, on the demo, from the page being served to the first answer.

    python3 scripts/bench_app.py --size 8b --root /work/bench8b     # bench_common's 8B trio (48 GB; built if missing)
    python3 scripts/bench_app.py --math M --lang L --base B          # any trio
    python3 scripts/bench_app.py --demo                              # the README's app command: first answer
    python3 scripts/bench_app.py --size 8b --ask 8                   # also Start engines and one Ask of 8 tokens
    python3 scripts/bench_app.py --size 8b --first-view              # a browser's first view, demo and 8B trio

Every measurement starts from a cold page cache (`bench_common.drop_page_cache`) and its own process: `layerswap
diff` (the read floor's neighbour: the analysis as the CLI runs it) and `app.py --math --lang --base` driven through
`gradio_client` as a visitor would (`/load`, then `/heatmap` with the default panels); with ``--ask N``, then
`/start_engines` (the engine plan the app picks on this machine) and one `/ask` of N new tokens to the three
models (each answer's seconds include its weight swap, as the page shows them). With ``--first-view``, Chromium
opens the page of a fresh app (the demo, and the trio if given) and times, from the page's load event, the page's
opening event (share link and test set filled in) and the models' report, against the page load itself. Prints a markdown table with the
ratio app / CLI; record it in docs/benchmarks.md with the date, the machine and `uptime`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def _serve(args: list[str], env: dict, work: Path) -> tuple[subprocess.Popen, str, float]:
    """`app.py ARGS` on a free port; returns the process, its URL and the seconds until the page is served."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), *args], cwd=work, env=env,
                            stdout=open(work / "app.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"app.py exited:\n{(work / 'app.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)


def _add(rows: list, name: str, sec: float, note: str = "") -> None:
    """A row of the table, printed as soon as it is measured (a later failure keeps it)."""
    print(f"  {name}: {sec:.1f} s {note}", flush=True)
    rows.append((name, sec, note))


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tree_rss_peak_mb(pid: int) -> float:
    """Peak RSS of a process plus its children (vLLM's engine runs in a child), summed."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(_rss_peak_mb(p.pid) for p in procs if p.is_running())


def bench_ask(c, tokens: int, lang: str, pid: int) -> list[tuple[str, float, str]]:
    """Start engines, then one question of `tokens` new tokens to the three models, as the page asks it."""
    import re

    t = time.perf_counter()
    report = c.predict(api_name="/start_engines")
    plan = [line for line in report.split("\n") if "Answers" in line or "engine" in line.lower()]
    rows: list = []
    _add(rows, "app: Start engines (engines ready)", time.perf_counter() - t, (plan[0] if plan else "")[:160].replace("|", "/"))
    t = time.perf_counter()
    out = c.predict(lang, 0, "", tokens, api_name="/ask")
    total = time.perf_counter() - t
    for md in out[1:4]:
        m = re.match(r"\*\*(.+?)\*\* · (.+?) · ([\d.]+)s", md)
        if m:
            _add(rows, f"app: Ask, {m.group(1)} ({tokens} new tokens)", float(m.group(3)), m.group(2))
    _add(rows, f"app: one Ask to the three models ({tokens} new tokens)", total,
         f"peak RSS of the app and its engine processes {_tree_rss_peak_mb(pid):.0f} MB")
    return rows


def bench_trio(paths: dict[str, Path], work: Path, ask_tokens: int = 0, ask_lang: str = "en") -> list[tuple[str, float, str]]:
    from bench_common import drop_page_cache
    from gradio_client import Client

    rows = []
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", LAYERSWAP_CACHE=str(work / "cache-cli"))
    drop_page_cache(paths.values())
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "layerswap.cli", "diff", "--base", str(paths["base"]), "--math",
                    str(paths["math"]), "--lang", str(paths["lang"]), "--no-plan", "--top", "0"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    cli = time.perf_counter() - t
    _add(rows, "CLI `layerswap diff` (cold cache)", cli, "the reference")
    drop_page_cache(paths.values())
    env["LAYERSWAP_CACHE"] = str(work / "cache-app")
    proc, url, served = _serve(["--math", str(paths["math"]), "--lang", str(paths["lang"]), "--base",
                                str(paths["base"]), "--device", "cpu"], env, work)
    try:
        _add(rows, "app: page served", served, "")
        c = Client(url, verbose=False)
        t = time.perf_counter()
        report, *_ = c.predict(str(paths["base"]), str(paths["math"]), str(paths["lang"]), api_name="/load")
        _add(rows, "app: Load to the compatibility report", time.perf_counter() - t,
             report.split("\n")[0][:60].replace("|", "/"))
        c.predict(["math", "lang", "overlap", "merged"], "relative", "cosine", 1.0, "raw", api_name="/heatmap")
        heat = time.perf_counter() - t
        _add(rows, "app: Load to the heatmaps", heat, f"{heat / cli:.2f}x the CLI; peak RSS {_rss_peak_mb(proc.pid):.0f} MB")
        answers = [line for line in report.split("\n") if line.startswith("**Answers")]
        _add(rows, "app: what answering would need", 0.0, (answers[0] if answers else "")[:160].replace("|", "/"))
        if ask_tokens:
            rows += bench_ask(c, ask_tokens, ask_lang, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def bench_demo(work: Path) -> list[tuple[str, float, str]]:
    from gradio_client import Client

    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", LAYERSWAP_CACHE=str(work / "cache-demo"))
    env.pop("LAYERSWAP_ENGINE", None)
    t0 = time.perf_counter()
    proc, url, served = _serve([], env, work)
    try:
        c = Client(url, verbose=False)
        *_, merged, _, _ = c.predict("xx", 0, "", 256, api_name="/ask")
        first = time.perf_counter() - t0
        engine = merged.split("·")[1].strip() if "·" in merged else "?"
        rows: list = []
        _add(rows, "demo: page served (README app command)", served)
        _add(rows, "demo: served to the first three answers", first - served, f"answered by {engine}")
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _open(browser, url: str):
    """A new page of `url`: (page, its start, seconds to its load event, then seconds to its first view)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    t0 = time.perf_counter()
    page.goto(url, wait_until="load")
    loaded = time.perf_counter() - t0
    page.wait_for_function("() => [...document.querySelectorAll('#share textarea, #share input')]"
                           ".some(e => e.value.includes('math='))", timeout=600_000, polling=50)
    return page, t0, loaded, time.perf_counter() - t0 - loaded


def bench_first_view(name: str, app_args: list[str], work: Path) -> list[tuple[str, float, str]]:
    """A fresh app opened in Chromium: seconds from the page's load event to its opening event's answer (the share
    link names the models) and to the models' report (their headers read), against the load event itself."""
    from playwright.sync_api import sync_playwright

    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", LAYERSWAP_CACHE=str(work / f"cache-view-{name}"))
    proc, url, served = _serve(app_args, env, work)
    rows: list = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"])
            page, t0, loaded, opened = _open(browser, url)
            page.wait_for_function("() => (document.querySelector('#report')?.innerText || '').includes('layers')",
                                   timeout=600_000, polling=50)
            report = time.perf_counter() - t0 - loaded
            # a second visitor once start-up is over (the engines answering, where they start behind the page)
            if name == "demo":  # its engines start behind the page: transformers answers, then vLLM takes over
                page.wait_for_function("() => { const t = document.querySelector('#engine-now')?.innerText || '';"
                                       " return t.includes('vLLM') && !t.includes('starting'); }",
                                       timeout=600_000, polling=500)
            page.wait_for_timeout(2000)
            _, _, loaded2, opened2 = _open(browser, url)
            browser.close()
        _add(rows, f"{name}: page served to its load event in the browser", loaded, "the reference")
        _add(rows, f"{name}: load event to the first view (share link, test set)", opened,
             f"{opened / loaded:.2f}x the page load")
        _add(rows, f"{name}: load event to the models' report", report, f"{report / loaded:.2f}x the page load")
        _add(rows, f"{name}: a second visitor after start-up, load event to the first view", opened2,
             f"{opened2 / loaded2:.2f}x its page load ({loaded2:.1f} s)")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["1b", "8b"], help="bench_common's trio of that size")
    ap.add_argument("--root", default="/work/bench-cache", help="where bench_common's trio lives (built if missing)")
    ap.add_argument("--math")
    ap.add_argument("--lang")
    ap.add_argument("--base")
    ap.add_argument("--demo", action="store_true", help="the README's app command: time to the first answer")
    ap.add_argument("--ask", type=int, default=0, metavar="N",
                    help="also Start engines and one Ask of N new tokens (the page's minimum is 16)")
    ap.add_argument("--ask-lang", default="en", help="the MGSM language of that question (default en)")
    ap.add_argument("--first-view", action="store_true",
                    help="only the browser's first view: the demo, and the trio if given (needs Chromium)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layerswap-bench-app-"))
    rows = []
    paths = None
    if args.size:
        from bench_common import build_trio

        t = time.perf_counter()
        paths = build_trio(args.root, size=args.size)
        print(f"trio ready in {time.perf_counter() - t:.0f} s: {paths['math'].parent}")
    elif args.math:
        paths = {"math": Path(args.math), "lang": Path(args.lang), "base": Path(args.base)}
    if args.first_view:
        rows += bench_first_view("demo", [], work)
        if paths:
            rows += bench_first_view(args.size or "trio", ["--math", str(paths["math"]), "--lang", str(paths["lang"]),
                                                         "--base", str(paths["base"]), "--device", "cpu"], work)
    elif paths:
        rows += bench_trio(paths, work, args.ask, args.ask_lang)
    if args.demo:
        rows += bench_demo(work)
    print(f"\n{os.uname().nodename} · {os.cpu_count()} cores · {time.strftime('%Y-%m-%d')} · load "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| measure | seconds | note |\n|---|---|---|")
    for name, sec, note in rows:
        print(f"| {name} | {sec:.1f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
