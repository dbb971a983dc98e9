"""Issue 40 in the page: a family of language experts loaded under Models, its table and plot in Evaluate
(gradio_client against `python app.py` with the demo organism; the browser's side is in tests/test_browser.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from layerswap.evaluation import mgsm
from layerswap.evaluation.table import LANG, MATH
from layerswap.models.family import MAX_LANGS
from layerswap.serving.hosting import Policy
from tests.helpers import DEMO_MGSM, shown

BASE, MATH_REF = "assets:demo/base", "assets:demo/math"
FAMILY = "xx=assets:demo/lang\nen=assets:demo/unlocalised/lang"


@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


def _cells(md: str) -> dict[tuple[str, str], float | None]:
    """(model, language) -> accuracy (%) of the family's Markdown table; None for a cell not evaluated yet."""
    lines = md.strip().splitlines()
    langs = [c.strip() for c in lines[0].split("|")][1:]
    out = {}
    for line in lines[2:]:
        model, *cells = [c.strip() for c in line.split("|")]
        for lang, cell in zip(langs, cells):
            out[(model, lang)] = None if cell == "–" else float(cell.split()[0])
    return out


def test_family_loads_and_its_table_fills_in_and_agrees_with_the_pair_evaluation(client):
    report = client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
    assert report.startswith("**Family loaded:**") and "2 language experts, 8 layers" in report
    assert "**xx**" in report and "**en**" in report and "shared base" in report

    job = client.submit(["swap", "soup"], "", 2, 0, "native_cot", 16, api_name="/evaluate_family")
    status, table, bars, saved = job.result(timeout=600)
    seen = [shown(o[1]) for o in job.outputs() if isinstance(shown(o[1]), str)]
    assert status.startswith("**Done:** 16 answers") and "xx, en: swap b=" in status
    cells = _cells(shown(table))
    assert set(cells) == {(m, lang) for m in (MATH, LANG, "swap", "soup") for lang in ("xx", "en", "average")}
    assert all(v is not None and 0 <= v <= 100 for v in cells.values())
    assert cells[("swap", "average")] == pytest.approx((cells[("swap", "xx")] + cells[("swap", "en")]) / 2, abs=0.06)
    partial = [_cells(md) for md in seen[:-1]]  # per model as it finishes: the experts before the merges
    assert any(c[(MATH, "xx")] is not None and c[("swap", "xx")] is None for c in partial), seen
    assert any(c[("swap", "xx")] is not None and c[("soup", "xx")] is None for c in partial), seen
    fig = json.loads(shown(bars)["plot"])
    assert [t["name"] for t in fig["data"]] == [MATH, LANG, "swap", "soup"]
    assert fig["data"][0]["x"] == ["xx", "en", "average"] and fig["data"][0]["error_y"]["visible"]
    data = json.loads(Path(shown(saved) if isinstance(shown(saved), str) else shown(saved)["value"]).read_text())
    assert data["family"]["languages"] == {"xx": "assets:demo/lang", "en": "assets:demo/unlocalised/lang"}
    assert data["protocol"]["limit"] == 2 and set(data["recipes"]["en"]) == {"swap", "soup"}
    for (model, lang), acc in cells.items():
        if lang != "average":
            assert data["results"][lang][model]["n"] == 2 and 100 * data["results"][lang][model]["accuracy"] == acc

    # the pair's own evaluation (the xx expert loaded above, its merge of the same page plan) agrees with the
    # family's xx column
    _, pair, *_ = client.predict(["xx"], ["math", "lang", "merged"], 2, 0, "native_cot", 16, api_name="/evaluate")
    row = {r[0]: r for r in shown(pair)["data"]}["xx"]
    headers = shown(pair)["headers"]
    for model, pair_model in ((MATH, MATH), (LANG, LANG), ("swap", "merged model")):
        assert row[headers.index(f"{pair_model} (flexible)")] == pytest.approx(cells[(model, "xx")], abs=0.06)


def test_one_language_can_have_its_own_plan(client):
    client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
    status, table, *_ = client.predict(["swap"], "en=1,1,0,0", 1, 0, "native_cot", 16, api_name="/evaluate_family")
    assert status.startswith("**Done:** 6 answers"), status
    assert re.search(r" · xx: swap b=2 u=0 tb=0 tu=0.* · en: swap b=1 u=1 tb=0 tu=0", status), status
    # the family's engine plan, asked once: the outcome that runs and why (the demo's experts: transformers)
    assert re.search(r"\n\nEngines: family plan: (resident|reload); A family of 2 \(5 models\)", status), status
    for plans, msg in [("ja=1,1,0,0", "CODE one of the family's \\(xx, en\\)"), ("en=1,1", "four whole numbers"),
                       ("en=1,1,0,0\nen=2,0,0,0", "Two per-language plans for en"),
                       ("en=99,0,0,0", "exceeds the model.s 8 layers")]:
        with pytest.raises(AppError, match=msg):
            client.predict(["swap"], plans, 1, 0, "native_cot", 16, api_name="/evaluate_family")


def test_the_family_strip_shows_each_languages_merge(client, app_url):
    """/family_strip (the Models section's strip, following Load family, the plan lines and the plan controls): a row
    per language, its cells the layer weights of its own plan or the page's, restated independently
    (`expected_layer_weights`); a mistake in the lines is said in words, a method without a layer map keeps every
    row the page's, and a visitor without a family sees none."""
    from layerswap import Plan
    from tests.helpers import expected_layer_weights

    client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
    page = (2, 1, 1, 1, "flat", 0.5, "neighbour")  # b, u, tb, tu, transition, its weight, non-layer
    fig, note = client.predict("en=1,1,0,0", *page, api_name="/family_strip")
    heat = json.loads(shown(fig)["plot"])["data"][0]
    assert heat["y"] == ["en", "xx"]  # drawn from the bottom: the family's first language on top
    want = {"xx": Plan(b=2, u=1, tb=1, tu=1, transition_weight=0.5), "en": Plan(b=1, u=1, tb=0, tu=0)}
    for code, row in zip(heat["y"], heat["z"]):
        assert row == pytest.approx(expected_layer_weights(want[code], 8)), code
    assert "xx: swap b=2 u=1 tb=1 tu=1" in note and "en: swap b=1 u=1 tb=0 tu=0" in note and "(its own)" in note
    fig, note = client.predict("en=1,1", *page, api_name="/family_strip")
    assert fig["visible"] is False and "four whole numbers" in note
    soup = dict(zip(("method", "weight"), ("soup", 0.3)))
    fig, note = client.predict("en=1,1,0,0", *page, api_name="/family_strip", **soup)
    heat = json.loads(shown(fig)["plot"])["data"][0]
    assert heat["z"] == [[0.5] * 8, [0.5] * 8] and "(its own)" not in note  # every tensor blended alike
    fig, note = Client(app_url, verbose=False).predict("en=1,1,0,0", *page, api_name="/family_strip")
    assert fig["visible"] is False and note == ""  # another visitor: no family loaded


def test_stop_ends_the_family_evaluation_and_keeps_what_was_answered(client):
    client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
    job = client.submit(["swap"], "", 0, 0, "native_cot", 16, api_name="/evaluate_family")  # every question: minutes
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until it is answering
        st = job.status()
        if st.progress_data and any((p.progress or 0) > 0 for p in st.progress_data):
            break
        time.sleep(0.5)
    said = client.predict(api_name="/stop_family")
    assert "**Stopped** your job" in said or "**Stopping** your job" in said, said
    status, table, bars, _ = job.result(timeout=300)
    n = int(status.split("answers")[0].split()[-1])
    assert status.startswith("**Cancelled:**") and 0 < n < 3 * 2 * len(mgsm.load("xx", DEMO_MGSM)), status
    assert shown(table).splitlines()[0] == "model | xx | en | average" and "(partial)" in shown(bars)["plot"]


@pytest.mark.parametrize("family, msg", [
    ("xx=assets:demo/lang\nxx=assets:demo/unlocalised/lang", r"Two language experts for xx"),
    ("xx=assets:demo/lang\nja=assets:demo/lang", r"ja=assets:demo/lang: The MGSM set .* has no language ja"),
    ("xx=assets:demo/lang\nen=assets:demo/ablation/other_shape", r"The en expert \(assets:demo/ablation/other_shape\) "
                                                                  r"does not fit this family"),
    ("\n".join(f"l{i}x=assets:demo/lang" for i in range(MAX_LANGS + 1)), r"at most 8 are allowed here"),
    ("assets:demo/lang", r"every language expert needs its MGSM language"),
])
def test_bad_families_are_one_line_refusals_and_keep_what_was_loaded(client, family, msg):
    ok = client.predict(BASE, MATH_REF, "en=assets:demo/unlocalised/lang", False, api_name="/load_family")
    assert ok.startswith("**Family loaded:**")
    with pytest.raises(AppError) as e:
        client.predict(BASE, MATH_REF, family, False, api_name="/load_family")
    said = str(e.value)
    assert re.search(msg, said) and "\n" not in said.strip(), said
    # the family loaded before is kept: it still evaluates (one language, the swap)
    status, table, *_ = client.predict(["swap"], "", 1, 0, "native_cot", 16, api_name="/evaluate_family")
    assert status.startswith("**Done:** 3 answers") and shown(table).splitlines()[0] == "model | en | average"


def test_no_family_no_methods_and_an_empty_family_keep_the_pair_page(client):
    with pytest.raises(AppError, match="Choose at least one merge"):
        client.predict([], "", 1, 0, "native_cot", 16, api_name="/evaluate_family")
    said = client.predict(BASE, MATH_REF, "  \n", False, api_name="/load_family")
    assert said.startswith("No family: the page evaluates the pair above")
    with pytest.raises(AppError, match="Load a family first"):
        client.predict(["swap"], "", 1, 0, "native_cot", 16, api_name="/evaluate_family")


def test_a_links_family_is_read_back_bounded():
    from layerswap.ui import controls, family
    from layerswap.ui.controls import query_string

    local, hosted = SimpleNamespace(policy=Policy()), SimpleNamespace(policy=Policy(hosted=True))
    q = query_string(("b", "m", "l"), (), "evaluate", ["sw=org/sw", "te=org/te"])
    assert "family=sw%3Dorg%2Fsw%0Ate%3Dorg%2Fte" in q and "family" not in query_string(("b", "m", "l"), ())
    assert family.restore(local, {"family": "sw=org/sw\nte=org/te"})[0]["value"] == "sw=org/sw\nte=org/te"
    assert family.restore(hosted, {"family": "sw=org/sw\nte=org/te"})[0]["value"] == "sw=org/sw\nte=org/te"
    for bad in ["sw=/srv/models/sw", "\n".join(f"l{i}x=org/m" for i in range(5)), "SW=org/sw", "sw=a\nsw=b",
                "x" * 20_000, "sw=org/" + "x" * 2000]:
        assert "value" not in family.restore(hosted, {"family": bad})[0], bad  # refused: the text area stays as it is
    # the per-language plans: written normalised, read back with every number bounded by its field
    q = query_string(("b", "m", "l"), (), "analysis", ["sw=org/sw"], controls.plan_specs("sw=2, 1,0,0"))
    assert "family_plans=sw%3D2%2C1%2C0%2C0" in q
    assert family.restore(hosted, {"family_plans": "sw=2,1,0,0\nte = 3 1 1 1"})[1]["value"] == "sw=2,1,0,0\nte=3,1,1,1"
    for bad in ["sw=2,1,0", "sw=2,1,0,0\nsw=1,1,1,1", "SW=2,1,0,0", "sw=99999,1,0,0", "sw=a,b,c,d", "x" * 20_000,
                "\n".join(f"l{i}x=1,1,1,1" for i in range(9)), "/etc=1,1,1,1"]:
        assert "value" not in family.restore(hosted, {"family_plans": bad})[1], bad


def test_hosted_mode_caps_the_family_and_takes_hub_ids_only():
    from layerswap.core.errors import UserError
    from layerswap.ui import family

    hosted = SimpleNamespace(policy=Policy(hosted=True))
    four = "\n".join(f"l{i}x=org/m{i}" for i in range(4))
    assert family.parse(hosted, "org/math", "", four).codes == ("l0x", "l1x", "l2x", "l3x")
    with pytest.raises(UserError, match=r"5 lines of language experts; at most 4 are allowed here: drop l4x=org/m4"):
        family.parse(hosted, "org/math", "", four + "\nl4x=org/m4")
    with pytest.raises(UserError, match="l1x expert"):
        family.parse(hosted, "org/math", "", "l0x=org/m0\nl1x=/srv/models/m1")
    with pytest.raises(UserError, match="characters of language experts"):
        family.parse(hosted, "org/math", "", "x" * (family.MAX_TEXT + 1))


def test_a_family_preset_fills_the_lines():
    """A preset with ``langs:`` (the demo3 family's) fills the family's text area; a pair's preset leaves it."""
    from layerswap.ui import family

    ctx = SimpleNamespace(presets={"fam": SimpleNamespace(langs=(("qa", "assets:demo3/lang_qa"),
                                                                 ("qb", "assets:demo3/lang_qb"))),
                                   "pair": SimpleNamespace(langs=())})
    assert family.preset_lines(ctx, None, "fam")["value"] == "qa=assets:demo3/lang_qa\nqb=assets:demo3/lang_qb"
    assert "value" not in family.preset_lines(ctx, None, "pair") and "value" not in family.preset_lines(ctx, None, 3)


def test_the_heatmaps_draw_a_languages_own_plan_only_for_a_layer_swap():
    """`family_views.overlay`: the chosen language's own line replaces the page's b,u,tb,tu (the rest kept); the pair
    above, a language without a line, and a page plan that is not a layer swap keep the page's recipe."""
    from layerswap.models.family import Family
    from layerswap.recipe.fields import LINK_KEYS
    from layerswap.ui import family_views
    from layerswap.ui.controls import read_plan
    from layerswap.ui.family import Loaded

    def controls(**by_key):
        return read_plan(tuple(by_key.get(k) for k in LINK_KEYS))

    swap, soup = controls(b=2, u=0, tb=0, tu=0, transition="ramp"), controls(method="soup")
    v = SimpleNamespace(family=Loaded(Family.parse("m", ["xx=a", "en=b"], "base"), None, None), family_lang="en")
    got = family_views.overlay(v, "en=1,1,0,0", swap)
    assert (got.plan.b, got.plan.u, got.plan.tb, got.plan.tu, got.plan.transition) == (1, 1, 0, 0, "ramp")
    assert family_views.overlay(v, "xx=3,1,0,0", swap) is swap.recipe  # no line for en
    assert family_views.overlay(v, "en=1,1,0,0", soup) is soup.recipe and soup.recipe.plan is None
    v.family_lang = None  # the pair above
    assert family_views.overlay(v, "en=1,1,0,0", swap) is swap.recipe
