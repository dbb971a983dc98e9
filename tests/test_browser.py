"""A real browser (Debian chromium via Playwright) clicks through the main flow."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from layerswap import mgsm
from tests.helpers import DEMO_MGSM, chromium_or_skip, launch_app, vllm_or_skip

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    exe = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=exe,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )
        yield b
        b.close()


def no_error_toast(page) -> None:
    assert page.locator("[data-testid=toast-body].error").count() == 0, page.locator("[data-testid=toast-body]").all_inner_texts()


def test_first_visit_every_tab_works(browser, app_url):
    """A newcomer opens the page and, without Load or Build, asks, looks at the heatmaps and evaluates."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url, wait_until="load")
    expect(page.locator("#demo-label")).to_contain_text("demo")
    page.locator("#organism-card").get_by_text("The demo organism's card").click()  # the card, one click away
    expect(page.locator("#organism-card")).to_contain_text("What it shows")
    page.locator("#ask").click()  # question 0 of the preselected Kovani set
    first = mgsm.load("xx", DEMO_MGSM)[0].question
    expect(page.locator("#prompt")).to_contain_text(f"Sorvi: {first[:30]}", timeout=180_000)
    for role in ("math", "lang", "merged"):
        expect(page.locator(f"#answer-{role}")).to_contain_text("flexible:", timeout=120_000)
    expect(page.locator("#plan")).to_contain_text("Built: the merged model answers with this plan")
    expect(page.locator("#report")).to_contain_text(re.compile(r"compatible: LlamaForCausalLM, \d+ layers"))
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "app.png"), full_page=True)

    page.locator("#b input[type=range]").fill("3")  # a new plan is built by the next question, no Build click
    expect(page.locator("#b input[type=number]")).to_have_value("3")
    page.locator("#free textarea").fill("Tom has 3 apples. Tom buys 4 more apples. How many apples does Tom have now?")
    page.locator("#ask").click()
    expect(page.locator("#prompt")).to_contain_text("answers from swap b=3", timeout=120_000)
    for role in ("math", "lang", "merged"):
        expect(page.locator(f"#answer-{role}")).to_contain_text("flexible:", timeout=120_000)

    page.get_by_role("tab", name="Where each expert changed").click()
    expect(page.locator("#heatmap .js-plotly-plot")).to_be_visible(timeout=120_000)
    expect(page.locator("#heatmap")).to_contain_text("plan b=3", timeout=120_000)
    page.screenshot(path=str(ARTIFACTS / "app-analysis.png"), full_page=True)
    page.locator("#lens-run").click()  # the lens on the same plan: curves, grid, the class rule
    expect(page.locator("#lens-curves .js-plotly-plot")).to_be_visible(timeout=180_000)
    expect(page.locator("#lens-grid .js-plotly-plot")).to_be_visible()
    expect(page.locator("#lens-summary")).to_contain_text("Token classes:")

    page.get_by_role("tab", name="Evaluate").click()
    expect(page.locator("#eval-langs input[type=checkbox]:checked")).to_have_count(1)
    expect(page.locator("#eval-langs label:has(input:checked)")).to_contain_text("(xx)")
    expect(page.locator("#eval-limit")).to_contain_text("0 = all")
    page.locator("#eval-limit input").fill("2")
    page.locator("#eval-run").click()
    expect(page.locator("#eval-status")).to_contain_text("Done:", timeout=180_000)
    expect(page.locator("#eval-bars .js-plotly-plot")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "app-evaluate.png"), full_page=True)
    no_error_toast(page)
    page.close()


def test_shared_link_restores_plan_and_tab(browser, app_url):
    """The share box's link, opened in a fresh browser context, shows the same plan on the same tab."""
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.goto(app_url, wait_until="load")
    page.locator("#b input[type=range]").fill("2")
    page.locator("#build").click()
    expect(page.locator("#share textarea, #share input")).to_have_value(re.compile(r"b=2"), timeout=180_000)
    query = page.locator("#share textarea, #share input").input_value().replace("tab=build", "tab=analysis")
    ctx.close()

    fresh = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = fresh.new_page()
    page.goto(app_url + "/" + query, wait_until="load")
    expect(page.locator("#b input[type=number]")).to_have_value("2", timeout=60_000)
    expect(page.locator("#heatmap .js-plotly-plot")).to_be_visible(timeout=180_000)  # the analysis tab is open
    expect(page.locator("#heatmap")).to_contain_text("plan b=2", timeout=120_000)
    no_error_toast(page)
    fresh.close()


def test_page_served_before_the_vllm_engines(browser, tmp_path):
    """With vLLM (a minute or more to start on CPU) the page is served within seconds, says it is loading,
    and a question asked meanwhile waits for the engines and is answered (no error)."""
    from playwright.sync_api import expect

    vllm_or_skip()
    t0 = time.perf_counter()
    app = launch_app(tmp_path, mgsm_dir=None, extra=["--engine", "vllm", "--serving", "one"],
                     env_extra={"LAYERSWAP_ENGINE": "vllm"})
    url = next(app)
    served = time.perf_counter() - t0
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="load")
        expect(page.locator("#status")).to_contain_text("Loading the default models", timeout=30_000)
        page.locator("#ask").click()
        for role in ("math", "lang", "merged"):
            expect(page.locator(f"#answer-{role}")).to_contain_text("flexible:", timeout=600_000)
        expect(page.locator("#answer-merged")).to_contain_text("vllm")
        ready = time.perf_counter() - t0
        expect(page.locator("#status")).to_contain_text("Models ready", timeout=120_000)
        no_error_toast(page)
        print(f"\npage served after {served:.1f} s; first answers (vLLM engines started) after {ready:.1f} s")
        assert served < 60, f"the page took {served:.0f} s to be served"
    finally:
        app.close()
