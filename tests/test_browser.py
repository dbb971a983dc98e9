"""A real browser (Debian chromium via Playwright) clicks through the main flow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from layerswap import mgsm
from tests.helpers import DEMO_MGSM, chromium_or_skip

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


def test_main_flow_in_browser(browser, app_url):
    """`python app.py` as a newcomer opens it: the demo organism, its Kovani test set preselected."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url, wait_until="load")
    expect(page.locator("#demo-label")).to_contain_text("demo")
    page.locator("#load").click()
    expect(page.locator("#report")).to_contain_text(re.compile(r"compatible: LlamaForCausalLM, \d+ layers"),
                                                   timeout=120_000)
    expect(page.locator("#report")).to_contain_text("Loaded in", timeout=120_000)  # the click's answer, not the page's

    page.locator("#b input[type=range]").fill("3")
    expect(page.locator("#b input[type=number]")).to_have_value("3")
    page.locator("#build").click()
    expect(page.locator("#plan")).to_contain_text("Built. swap b=3", timeout=120_000)
    expect(page.locator("#strip .js-plotly-plot")).to_be_visible(timeout=60_000)

    page.locator("#ask").click()  # question 0 of the preselected set
    first = mgsm.load("xx", DEMO_MGSM)[0].question
    expect(page.locator("#prompt")).to_contain_text(f"Sorvi: {first[:30]}", timeout=120_000)
    for role in ("math", "lang", "merged"):
        expect(page.locator(f"#answer-{role}")).to_contain_text("flexible:", timeout=120_000)
    page.locator("#free textarea").fill("Tom has 3 apples. Tom buys 4 more apples. How many apples does Tom have now?")
    page.locator("#ask").click()
    expect(page.locator("#prompt")).to_contain_text("Sorvi: Tom has 3 apples.", timeout=120_000)
    for role in ("math", "lang", "merged"):
        expect(page.locator(f"#answer-{role}")).to_contain_text("flexible:", timeout=120_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "app.png"), full_page=True)
    assert (ARTIFACTS / "app.png").stat().st_size > 10_000

    # the analysis tab shows the heatmaps with the built plan drawn on them
    page.get_by_role("tab", name="Where each expert changed").click()
    expect(page.locator("#heatmap .js-plotly-plot")).to_be_visible(timeout=120_000)
    expect(page.locator("#heatmap")).to_contain_text("plan b=3", timeout=120_000)
    page.screenshot(path=str(ARTIFACTS / "app-analysis.png"), full_page=True)
    page.close()
