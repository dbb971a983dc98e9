"""The first hour of a newcomer, in a real browser (issue 33, points 1-4): every preset and Load sets what belongs
to its models, the share link follows every change, the page never moves a visitor off their tab, and the first
view comes while the models are still loading.

The expected plans and languages are read from the shipped files here, independently of `layerswap`."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from layerswap.recipe.plans import Plan
from layerswap.models.presets import assets_dir
from tests.helpers import DEMO_MGSM, launch_app, serve
from tests.test_browser import browser, no_error_toast  # noqa: F401 (the browser fixture)

pytestmark = pytest.mark.browser
A = assets_dir()
SHARE = "#share textarea, #share input"


def recommended(org: str) -> dict:
    return json.loads((A / org / "results.json").read_text())["recommended_plan"]


def expect_plan(page, plan: dict) -> None:
    from playwright.sync_api import expect

    for k in ("b", "u", "tb", "tu"):
        expect(page.locator(f"#{k} input[type=number]")).to_have_value(str(plan[k]), timeout=60_000)


def pick_preset(page, label_words: str) -> None:
    page.locator("#preset input").click()
    page.get_by_role("option", name=re.compile(re.escape(label_words))).click()


def test_a_preset_or_load_sets_everything_that_belongs_to_its_models(browser, app_url):  # noqa: F811
    """Point 1: after picking demo2 (it loads at once), every menu offers Oruki and English only, Ask asks in Oruki,
    the banner, card and test-set line name the paper-setting organism, and the plan is its recommended one;
    Load of the unlocalised pair opens on its own plan; back to demo, Kovani again."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url, wait_until="load")
    expect(page.locator("#preset input")).to_have_value(re.compile("Demo organism \\(offline"), timeout=30_000)
    expect(page.locator("#test-set")).to_contain_text("Kovani (xx)")
    pick_preset(page, "paper's setting")
    expect(page.locator("#test-set")).to_contain_text("assets:demo2/mgsm", timeout=120_000)
    expect(page.locator("#test-set")).to_contain_text("Oruki (yy)")
    expect(page.locator("#test-set")).not_to_contain_text("Kovani")
    plan = recommended("demo2")
    expect_plan(page, plan)
    expect(page.locator("#report")).to_contain_text("10 layers")
    expect(page.locator("#demo-label")).to_contain_text("paper's setting")
    expect(page.locator("#demo-label")).to_contain_text("Oruki test set")
    expect(page.locator("#demo-label")).not_to_contain_text("Kovani")
    page.locator("#organism-card").get_by_text("The organism's card").click()
    expect(page.locator("#card-text")).to_contain_text("Oruki")
    expect(page.locator("#mgsm-lang input")).to_have_value("Oruki (yy)")
    expect(page.locator("#share textarea, #share input")).to_have_value(re.compile(
        f"math=assets%3Ademo2%2Fmath.*b={plan['b']}&u={plan['u']}&.*non_layer={plan['non_layer']}"))
    page.locator("#mgsm-lang input").click()
    assert sorted(t.strip("✓\n ") for t in page.get_by_role("option").all_inner_texts()) == ["English (en)", "Oruki (yy)"]
    page.keyboard.press("Escape")
    page.locator("#ask").click()  # the opening question, in Oruki's prompt format, to the Oruki models
    expect(page.locator("#prompt")).to_contain_text("Sural:", timeout=180_000)
    expect(page.locator("#prompt")).to_contain_text(f"answers from {Plan.from_dict(plan).title()}")
    expect(page.locator("#answer-merged")).to_contain_text("flexible:", timeout=120_000)
    expect(page.locator("#answer-merged")).to_contain_text("correct")  # the question the recommended plan gets right
    page.get_by_role("tab", name="Where each expert changed").click()
    expect(page.locator("#lens-lang input")).to_have_value("Oruki (yy)")
    page.get_by_role("tab", name="Evaluate").click()
    expect(page.locator("#eval-langs")).to_contain_text("Oruki (yy)")
    expect(page.locator("#eval-langs")).not_to_contain_text("Kovani")
    expect(page.locator("#eval-limit")).to_contain_text("0 = all 1,000")

    page.get_by_role("tab", name="Build & ask").click()  # Load, typed by hand: the unlocalised pair's own plan
    page.locator("#base input, #base textarea").fill("assets:demo/base")
    page.locator("#math input, #math textarea").fill("assets:demo/unlocalised/math")
    page.locator("#lang input, #lang textarea").fill("assets:demo/unlocalised/lang")
    page.locator("#load").click()
    expect(page.locator("#test-set")).to_contain_text("Kovani (xx)", timeout=120_000)
    expect_plan(page, json.loads((A / "demo/unlocalised/results.json").read_text())["recommended_plan"])
    expect(page.locator("#preset input")).to_have_value(re.compile("without layer ranges"))
    expect(page.locator("#demo-label")).to_contain_text("negative control")

    pick_preset(page, "Demo organism (offline")
    expect_plan(page, recommended("demo"))
    expect(page.locator("#mgsm-lang input")).to_have_value("Kovani (xx)")
    no_error_toast(page)
    page.close()


def test_the_share_link_follows_every_change(browser, app_url):  # noqa: F811
    """Point 3: a slider, the revert box and the open tab change the link at once (no Build, no Load); Ask, which
    builds the plan by itself, leaves it naming that plan; the link opens that view."""
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.goto(app_url, wait_until="load")
    share = page.locator(SHARE)
    expect(share).to_have_value(re.compile(r"math=assets%3Ademo%2Fmath"), timeout=60_000)
    page.locator("#b input[type=range]").fill("3")
    expect(share).to_have_value(re.compile(r"[?&]b=3&"))
    page.get_by_text("Other layer maps (ablations) and baseline methods").click()
    page.locator("#revert input, #revert textarea").fill("3-4")
    expect(share).to_have_value(re.compile(r"revert=3-4"))
    page.locator("#free textarea").fill("Tom has 3 apples and buys 4 more. How many apples does he have?")
    page.locator("#ask").click()
    expect(page.locator("#prompt")).to_contain_text("revert 3-4 to base", timeout=180_000)
    expect(share).to_have_value(re.compile(r"[?&]b=3&.*revert=3-4"))
    page.get_by_role("tab", name="Where each expert changed").click()
    expect(share).to_have_value(re.compile(r"tab=analysis"))
    link = share.input_value()
    no_error_toast(page)
    ctx.close()

    fresh = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = fresh.new_page()
    page.goto(app_url + "/" + link, wait_until="load")
    expect(page.locator("#heatmap")).to_contain_text("revert 3-4", timeout=180_000)  # the analysis tab, that plan
    expect(page.locator("#b input[type=number]")).to_have_value("3")
    fresh.close()


def _open_page_fn(app_url: str) -> int:
    """The id of the page's opening event (the one listener of the page's load)."""
    import urllib.request

    cfg = json.loads(urllib.request.urlopen(app_url + "/config", timeout=10).read())
    return next(d["id"] for d in cfg["dependencies"] if any(t[1] == "load" for t in d["targets"]))


def test_the_page_never_moves_a_visitor_off_their_tab(browser, app_url):  # noqa: F811
    """Point 4: a visitor who opens "Where each expert changed" before the page's opening event answered stays
    there (the opening answer is held back by the browser until the click is done)."""
    from playwright.sync_api import expect

    fn = _open_page_fn(app_url)
    held = []

    def hold(route):
        body = route.request.post_data or ""
        if f'"fn_index":{fn},' in body.replace(" ", "") and not held:
            held.append(route)
        else:
            route.continue_()

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.route("**/gradio_api/run/predict", hold)
    page.goto(app_url, wait_until="load")
    for _ in range(300):
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "the page's opening event was never sent"
    page.get_by_role("tab", name="Where each expert changed").click()
    expect(page.get_by_role("tab", name="Where each expert changed")).to_have_attribute("aria-selected", "true")
    held[0].continue_()
    expect(page.locator("#status")).to_contain_text("Models ready", timeout=180_000)  # the opening has answered
    expect(page.get_by_role("tab", name="Where each expert changed")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#heatmap .js-plotly-plot")).to_be_visible(timeout=180_000)
    expect(page.locator(SHARE)).to_have_value(re.compile("tab=analysis"))
    page.close()


class SlowHub(BaseHTTPRequestHandler):
    """A Hub that answers nothing until the test lets it (then: no such model): the default models load forever."""

    release = threading.Event()

    def do_GET(self):  # noqa: N802 (http.server's name)
        SlowHub.release.wait(300)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *a):
        pass


def test_the_first_view_comes_while_the_models_load(browser, tmp_path):  # noqa: F811
    """The page's first view (share link, test set, status, plan controls) does not wait for the models: here
    their download never finishes, as with a big trio being read, and the visitor can still look around."""
    from playwright.sync_api import expect

    SlowHub.release.clear()
    hub = serve(SlowHub)
    url_hub = next(hub)
    app = launch_app(tmp_path, mgsm_dir=DEMO_MGSM, extra=["--math", "slow/math", "--lang", "slow/lang"],
                     env_extra={"HF_ENDPOINT": url_hub, "HF_HUB_OFFLINE": "0"})
    url = next(app)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="load")
        expect(page.locator(SHARE)).to_have_value(re.compile("math=slow%2Fmath"), timeout=30_000)
        expect(page.locator("#report")).to_contain_text("Loading the default models")
        expect(page.locator("#test-set")).to_contain_text("Kovani (xx)")
        page.get_by_role("tab", name="Sweeps").click()
        expect(page.locator(SHARE)).to_have_value(re.compile("tab=sweeps"))
        expect(page.get_by_role("tab", name="Sweeps")).to_have_attribute("aria-selected", "true")
        page.close()
    finally:
        SlowHub.release.set()
        app.close()
        hub.close()


def _fn(app_url: str, api_name: str) -> int:
    import urllib.request

    cfg = json.loads(urllib.request.urlopen(app_url + "/config", timeout=10).read())
    return next(d["id"] for d in cfg["dependencies"] if d.get("api_name") == api_name)


def test_the_smaller_things(browser, app_url, tmp_path):  # noqa: F811
    """Point 8: Ask opens on a question the merged model gets right; old answers go at once while Ask waits its
    turn; the overlap panel is labelled and says why its cells are grey; the lens grid's notes fit the figure;
    Export's default folder is outside the checkout; "mergekit YAML" says what it wrote; a refused Push shows its
    message, no bare "Error"."""
    from playwright.sync_api import expect

    ask_fn, held = _fn(app_url, "ask"), []

    def hold(route):
        body = (route.request.post_data or "").replace(" ", "")
        if not held and f'"fn_index":{ask_fn},' in body:
            held.append(route)
        else:
            route.continue_()

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url, wait_until="load")
    expect(page.locator("#status")).to_contain_text("Models ready", timeout=180_000)
    page.locator("#ask").click()
    expect(page.locator("#answer-merged")).to_contain_text("flexible:", timeout=180_000)
    expect(page.locator("#answer-merged")).to_contain_text("correct")  # not "wrong": the showcase question

    page.route("**/gradio_api/queue/join*", hold)
    page.locator("#b input[type=range]").fill("3")
    page.locator("#ask").click()
    for _ in range(300):
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "Ask never joined the queue"
    expect(page.locator("#answer-merged")).to_contain_text("waiting")  # while the job waits: no old answer
    expect(page.locator("#answer-merged")).not_to_contain_text("flexible:")
    held[0].continue_()
    expect(page.locator("#prompt")).to_contain_text("answers from swap b=3", timeout=180_000)
    expect(page.locator("#answer-merged")).to_contain_text("flexible:", timeout=180_000)
    page.unroute("**/gradio_api/queue/join*")

    assert not page.locator("#out-dir input, #out-dir textarea").input_value().startswith("exports")
    page.locator("#out-dir input, #out-dir textarea").fill(str(tmp_path / "merge"))
    page.locator("#export").click()
    expect(page.locator("#export-status")).to_contain_text("Wrote", timeout=120_000)
    page.locator("#export-yaml").click()
    expect(page.locator("#export-status")).to_contain_text("mergekit YAML of swap b=3", timeout=60_000)
    page.locator("#push-repo input, #push-repo textarea").fill("not a repo id")
    page.locator("#push").click()
    expect(page.locator("[data-testid=toast-body]")).to_contain_text("owner/name", timeout=60_000)
    expect(page.locator("#push-status")).to_have_text("")

    page.get_by_role("tab", name="Where each expert changed").click()
    expect(page.locator("#heatmap")).to_contain_text("every cell grey", timeout=180_000)
    from layerswap.ui.tabs.analysis import DEFAULT_PANELS

    expect(page.locator("#heatmap .yaxislayer-above text", has_text="mlp_norm")).to_have_count(len(DEFAULT_PANELS))
    page.locator("#lens-run").click()
    expect(page.locator("#lens-grid .js-plotly-plot")).to_be_visible(timeout=180_000)
    title, svg = page.locator("#lens-grid .gtitle").bounding_box(), page.locator("#lens-grid .main-svg").first.bounding_box()
    assert title["x"] + title["width"] <= svg["x"] + svg["width"], (title, svg)  # no note cut off at the edge
    page.close()


def test_a_fresh_start_walks_every_preset_and_tab(browser, tmp_path):  # noqa: F811
    """A fresh `python app.py`, as the README starts it: every preset from the menu (the shipped ones load and
    answer on every tab with their own set and plan; the Hub ones fill the fields and wait for a language
    expert), then a shipped sweep on the Sweeps tab, its "set" column naming the experts."""
    from playwright.sync_api import expect

    from layerswap.evaluation.mgsm import languages
    from layerswap.models.presets import presets

    app = launch_app(tmp_path, mgsm_dir=None)
    url = next(app)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="load")
        expect(page.locator("#status")).to_contain_text("Models ready", timeout=180_000)
        for name, p in presets().items():
            page.get_by_role("tab", name="Build & ask").click()
            for attempt in range(3):  # a pick while the last preset's views still redraw the menu can be lost
                pick_preset(page, p.label[:40])
                try:
                    expect(page.locator("#math input, #math textarea")).to_have_value(p.math, timeout=20_000)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            if not p.lang:  # a Hub trio: the visitor types a language expert; nothing is loaded meanwhile
                expect(page.locator("#preset-note")).to_contain_text("Type a language expert")
                continue
            org = p.math.removeprefix("assets:").split("/")[0]
            pair = A / p.math.removeprefix("assets:").rsplit("/", 1)[0]
            if not (pair / "results.json").is_file():  # a family not measured as a pair (demo3): its own set,
                expect(page.locator("#test-set")).to_contain_text(f"assets:{org}/mgsm", timeout=120_000)
                table = json.loads((A / org / "family_table.json").read_text())  # and its table's swap plan
                lang = p.lang.removeprefix(f"assets:{org}/lang_")
                expect_plan(page, table["recipes"][lang]["swap"]["plan"])
                no_error_toast(page)
                continue
            res = json.loads((pair / "results.json").read_text())
            target = languages(A / org / "mgsm")[res["target_language"]].name
            expect(page.locator("#test-set")).to_contain_text(f"assets:{org}/mgsm", timeout=120_000)
            expect_plan(page, res["recommended_plan"])
            expect(page.locator("#mgsm-lang input")).to_have_value(f"{target} ({res['target_language']})")
            page.locator("#ask").click()
            expect(page.locator("#answer-merged")).to_contain_text("flexible:", timeout=180_000)
            expect(page.locator("#prompt")).to_contain_text(f"answers from swap b={res['recommended_plan']['b']}")
            page.get_by_role("tab", name="Where each expert changed").click()
            expect(page.locator("#heatmap")).to_contain_text(f"plan b={res['recommended_plan']['b']}", timeout=180_000)
            expect(page.locator("#lens-lang input")).to_have_value(f"{target} ({res['target_language']})")
            page.locator("#lens-run").click()
            expect(page.locator("#lens-summary")).to_contain_text("Token classes:", timeout=180_000)
            page.get_by_role("tab", name="Evaluate").click()
            # the menus follow the new models (`on_models`): run once the preset's target is the one checked
            checked = page.locator("#eval-langs label:has(input:checked)")
            expect(checked).to_contain_text(f"({res['target_language']})", timeout=60_000)
            expect(checked).to_have_count(1)
            page.locator("#eval-limit input").fill("2")
            page.locator("#eval-run").click()
            expect(page.locator("#eval-status")).to_contain_text("Done:", timeout=180_000)
            expect(page.locator("#eval-table")).to_contain_text(res["target_language"])
            no_error_toast(page)
        page.get_by_role("tab", name="Sweeps").click()
        page.locator("#sweep-file input").click()
        page.get_by_role("option", name="2-transition.yaml").click()
        page.get_by_label("Questions per language (0 = the file's setting)").fill("2")
        page.locator("#sweep-run").click()
        expect(page.locator("#sweep-status")).to_contain_text("finished", timeout=600_000)
        expect(page.locator("#sweep-table")).to_contain_text("assets:demo/{math, lang}")
        no_error_toast(page)
        page.close()
    finally:
        app.close()


def test_round_3_adapter_export_stop_and_the_pages_words(browser, app_url, tmp_path):  # noqa: F811
    """Issue 41, points 11, 12 and 14 on the page: "Export as PEFT adapter" shows only for adapter experts (not for
    the demo's full models); a shipped LoRA pair opens on its organism's plan and exports as a LoRA adapter; the
    page's messages name its controls, never a CLI flag; Stop on the Sweeps tab after a sweep finished says that
    nothing runs (it said "Stopping your running job…" for good)."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url, wait_until="load")
    expect(page.locator("#status")).to_contain_text("Models ready", timeout=180_000)
    expect(page.locator("#export")).to_be_visible()
    expect(page.locator("#export-adapter")).to_be_hidden()  # full-model experts

    # point 12: a tiny sweep runs to the end, then Stop
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(f"name: tiny\nexperts: {{math: {A}/demo/math, lang: {A}/demo/lang, base: {A}/demo/base}}\n"
                     "recipes: [{name: b2, plan: {b: 2, u: 0, tb: 0, tu: 0}}]\n"
                     f"test_sets: [{{path: {A}/demo/mgsm, langs: [xx]}}]\neval: {{max_new_tokens: 8}}\n")
    page.get_by_role("tab", name="Sweeps").click()
    page.get_by_label("…or a sweep file on this machine").fill(str(sweep))
    page.get_by_label("Results file (default: a file of your own session)").fill(str(tmp_path / "tiny.jsonl"))
    page.get_by_label("Questions per language (0 = the file's setting)").fill("1")
    page.locator("#sweep-run").click()
    expect(page.locator("#sweep-status")).to_contain_text("finished", timeout=300_000)
    page.locator("#sweep-stop").click()
    expect(page.locator("#sweep-status")).to_contain_text("Nothing of yours is running", timeout=30_000)
    page.wait_for_timeout(3000)
    expect(page.locator("#sweep-status")).not_to_contain_text("Stopping")

    # points 11 and 14: a shipped LoRA pair (the shared-base check warns: without Force, a refusal in page terms)
    page.get_by_role("tab", name="Build & ask").click()
    for field, ref in (("base", "demo/base"), ("math", "demo/ablation/math_lora"), ("lang", "demo/ablation/lang_lora")):
        page.locator(f"#{field} input, #{field} textarea").fill(f"assets:{ref}")
    page.locator("#load").click()
    toast = page.locator("[data-testid=toast-body]")
    expect(toast).to_contain_text("tick Force", timeout=120_000)
    assert not re.search(r"--[a-z]", toast.first.inner_text()), toast.first.inner_text()
    page.locator("[data-testid=toast-body] ~ button, .toast-close").first.click()
    page.get_by_label("Force: load even if the experts seem not to share the base").check()
    page.locator("#load").click()
    expect(page.locator("#report")).to_contain_text("Loaded in", timeout=180_000)
    report = page.locator("#report").inner_text()
    assert "warning" in report and "tick Force" in report and not re.search(r"--[a-z]", report), report
    expect_plan(page, recommended("demo"))  # the organism's plan, not the literature's scaled
    expect(page.locator("#export-adapter")).to_be_visible()
    page.locator("#out-dir input, #out-dir textarea").fill(str(tmp_path / "lora"))
    page.locator("#export-adapter").click()
    expect(page.locator("#export-status")).to_contain_text("lora adapter (PEFT)", timeout=120_000)
    assert json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert json.loads((tmp_path / "lora" / "layerswap.json").read_text())["recipe"]["plan"]["b"] == recommended("demo")["b"]

    pick_preset(page, "Demo organism (offline")  # back to the full demo experts: the adapter export goes
    expect(page.locator("#test-set")).to_contain_text("Kovani (xx)", timeout=120_000)
    expect(page.locator("#export-adapter")).to_be_hidden(timeout=60_000)
    page.close()
