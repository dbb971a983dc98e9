"""Screenshots of each tab of the app on first visit, and of the lens panel (docs/screenshots/*.png), for the
README, docs/app.md and docs/lens.md.

    python3 scripts/screenshots.py [--out docs/screenshots] [--engine transformers]
    python3 scripts/screenshots.py --math M --lang L --base B --name 8b   # analysis tab of any trio

Starts `app.py` on its offline default (the demo organism) on a free loopback port, opens it in
Debian's chromium (Playwright), waits until the page has filled itself (no clicks: that is the
point), and saves one picture per tab. With `--math/--lang/--base` it opens the app on that trio and saves
only its analysis tab (`analysis-NAME.png`): models of any size, whose heatmaps need no engine.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABS = [("build", None), ("analysis", "Where each expert changed"), ("evaluate", "Evaluate")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "screenshots"))
    ap.add_argument("--engine", default="transformers", help="the app's engine (vLLM on CPU takes minutes to start)")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--math")
    ap.add_argument("--lang")
    ap.add_argument("--base")
    ap.add_argument("--name", default="trio", help="with --math/--lang/--base: the picture is analysis-NAME.png")
    args = ap.parse_args()
    trio = ["--math", args.math, "--lang", args.lang, "--base", args.base] if args.math else []
    from playwright.sync_api import expect, sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="layerswap-shots-"))
    env = dict(os.environ, LAYERSWAP_ENGINE=args.engine, GRADIO_ANALYTICS_ENABLED="False",
               LAYERSWAP_CACHE=str(work / "cache"))
    env.pop("LAYERSWAP_MGSM_DIR", None)
    app = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), *trio], cwd=work, env=env,
                           stdout=open(work / "app.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--headless", "--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="load")
            if trio:  # no engines needed: the analysis tab once its heatmaps are drawn
                expect(page.get_by_text("compatible:", exact=False).first).to_be_visible(timeout=600_000)
                page.get_by_role("tab", name=TABS[1][1]).click()
                expect(page.locator("#heatmap .js-plotly-plot")).to_be_visible(timeout=1_800_000)
                page.wait_for_timeout(3000)
                page.screenshot(path=str(out / f"analysis-{args.name}.png"), full_page=True)
                print(f"wrote {out / f'analysis-{args.name}.png'}")
                browser.close()
                return 0
            expect(page.locator("#plan")).to_contain_text("Built", timeout=600_000)
            for name, label in TABS:
                if label:
                    page.get_by_role("tab", name=label).click()
                if name == "analysis":
                    expect(page.locator("#heatmap .js-plotly-plot")).to_be_visible(timeout=600_000)
                page.wait_for_timeout(1500)
                path = out / f"{name}.png"
                page.screenshot(path=str(path), full_page=True)
                print(f"wrote {path}")
                if name == "analysis":  # the lens panel, run once on the opening plan
                    page.locator("#lens-run").click()
                    expect(page.locator("#lens-grid .js-plotly-plot")).to_be_visible(timeout=600_000)
                    page.wait_for_timeout(1500)
                    page.locator("#lens-panel").screenshot(path=str(out / "lens.png"))
                    print(f"wrote {out / 'lens.png'}")
            browser.close()
    finally:
        app.terminate()
        app.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
