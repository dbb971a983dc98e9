"""Issue 40 in the page: a loaded family's heatmaps per language and its export (one folder per language, in the
visitor's own folder), through gradio_client against `python app.py`, checked against the library's pair analysis
and pair export of the same models."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from layerswap import Checkpoint, Plan, export_merge
from layerswap.analysis import analyze
from tests.helpers import launch_app, read_dir, shown

BASE, MATH_REF = "assets:demo/base", "assets:demo/math"
FAMILY = "xx=assets:demo/lang\nen=assets:demo/unlocalised/lang"
PLAN_ARGS = (2, 1, 1, 1, "flat", 0.5, "neighbour")
HEAT = (["math", "lang", "merged"], "relative", "cosine", 1.0, "raw", "")  # no per-language plans


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app with its scratch (where a local page's visitors' folders live) under the test's own folder."""
    work = tmp_path_factory.mktemp("famviews")
    (work / "scratch").mkdir()
    url = next(gen := launch_app(work, mgsm_dir=None, env_extra={"LAYERSWAP_SCRATCH": str(work / "scratch")}))
    yield work, Client(url, verbose=False)
    gen.close()


@pytest.fixture(scope="module")
def cks():
    return {"base": Checkpoint.open(BASE), "math": Checkpoint.open(MATH_REF), "xx": Checkpoint.open("assets:demo/lang"),
            "en": Checkpoint.open("assets:demo/unlocalised/lang")}


def _z(trace) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in trace["z"]], dtype=float)


def test_a_second_languages_heatmap_is_its_pair_analysis_with_the_plan_overlay(app, cks, tmp_path):
    _, client = app
    with pytest.raises(AppError, match="Load a family first"):
        client.predict("en", *HEAT, *PLAN_ARGS, api_name="/family_heatmap")
    client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
    with pytest.raises(AppError, match="one of the family's languages"):
        client.predict("de", *HEAT, *PLAN_ARGS, api_name="/family_heatmap")
    heat, summary, profile, *_ = client.predict("en", *HEAT, *PLAN_ARGS, api_name="/family_heatmap")
    fig = json.loads(shown(heat)["plot"])
    assert summary.startswith("**Language en:**")
    an = analyze(cks["base"], cks["math"], cks["en"], ks=(1.0,), cache=tmp_path / "cache")
    np.testing.assert_allclose(_z(fig["data"][1]), an.grid(an.values("lang", "relative")), rtol=1e-9)
    np.testing.assert_allclose(_z(fig["data"][0]), an.grid(an.values("math", "relative")), rtol=1e-9)
    merged = an.merged(Plan(*PLAN_ARGS), cks["math"], cks["en"], cks["base"])
    np.testing.assert_allclose(_z(fig["data"][2]), an.grid(an.values("merged", "relative", merged=merged)), rtol=1e-9)
    assert fig["layout"]["shapes"]  # the plan drawn on top
    np.testing.assert_allclose(json.loads(shown(profile)["plot"])["data"][1]["y"],
                               an.layer_profile("lang", "relative"), rtol=1e-9)
    # the tab's own redraw (a control or the plan changing) keeps that language
    again, summary2, *_ = client.predict(*HEAT, *PLAN_ARGS, api_name="/heatmap")
    assert summary2.startswith("**Language en:**")
    np.testing.assert_allclose(_z(json.loads(shown(again)["plot"])["data"][1]), _z(fig["data"][1]), rtol=0)
    # a per-language plan line gives en its own plan: that plan is drawn and its merged panel is that plan's
    with pytest.raises(AppError, match="Per-language plan for de"):
        client.predict("en", *HEAT[:-1], "de=1,1,0,0", *PLAN_ARGS, api_name="/family_heatmap")
    own, summary4, *_ = client.predict("en", *HEAT[:-1], "xx=3,1,0,0\nen=1,1,0,0", *PLAN_ARGS,
                                       api_name="/family_heatmap")
    assert summary4.startswith("**Language en:**") and "**Its own plan:** " in summary4 and "b=1 u=1" in summary4
    own_merged = an.merged(Plan(1, 1, 0, 0, *PLAN_ARGS[4:]), cks["math"], cks["en"], cks["base"])
    got = _z(json.loads(shown(own)["plot"])["data"][2])
    np.testing.assert_allclose(got, an.grid(an.values("merged", "relative", merged=own_merged)), rtol=1e-9)
    assert not np.allclose(np.nan_to_num(got), np.nan_to_num(_z(fig["data"][2])))  # not the page's plan
    # back to the pair above: its own language expert (assets:demo/lang) differs from en's
    pair, summary3, *_ = client.predict("pair", *HEAT, *PLAN_ARGS, api_name="/family_heatmap")
    assert not summary3.startswith("**Language")
    assert not np.allclose(np.nan_to_num(_z(json.loads(shown(pair)["plot"])["data"][1])),
                           np.nan_to_num(_z(fig["data"][1])))


def test_export_writes_one_folder_per_language_in_the_visitors_folder(app, cks, tmp_path):
    work, client = app
    client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
    with pytest.raises(AppError, match="Per-language plan"):
        client.predict("de=1,1,0,0", *PLAN_ARGS, api_name="/export_family")
    before = {p for p in work.rglob("*") if "scratch" not in p.relative_to(work).parts[:1]}
    status, download = client.predict("en=1,1,0,0", *PLAN_ARGS, api_name="/export_family")
    assert status.startswith("Wrote `") and "`: 2 merged models" in status and "(its own plan)" in status
    zipped = shown(download)
    with zipfile.ZipFile(zipped if isinstance(zipped, str) else zipped["value"]) as z:
        z.extractall(tmp_path / "got")
    plans = {"xx": Plan(*PLAN_ARGS), "en": Plan(1, 1, 0, 0, *PLAN_ARGS[4:])}
    for code, plan in plans.items():
        pair = export_merge(cks["math"], cks[code], plan, tmp_path / f"pair-{code}", base=cks["base"],
                            languages=[code])
        a, b = read_dir(tmp_path / "got" / code), read_dir(pair.out)
        assert a.keys() == b.keys() and all(a[n].equal(b[n]) for n in a), code
        assert "mergekit_yaml" in json.loads((tmp_path / "got" / code / "layerswap.json").read_text())
        assert (tmp_path / "got" / code / "README.md").is_file()
    # written only in the visitor's own folder under the served root: nothing new elsewhere in the app's folder
    written = [p for p in (work / "scratch").rglob("layerswap-family") if p.is_dir()]
    assert len(written) == 1 and sorted(x.name for x in written[0].iterdir() if x.is_dir()) == ["en", "xx"]
    assert status.startswith(f"Wrote `{written[0]}`")  # the local page names its folder, as Export does
    after = {p for p in work.rglob("*") if "scratch" not in p.relative_to(work).parts[:1]}
    assert not {p for p in after - before if "cache" not in p.relative_to(work).parts[:1] and p.name != "app.log"}


def test_hosted_the_familys_export_is_held_to_the_visitors_disk(tmp_path_factory):
    """Hosted: the family's export goes to the visitor's folder under the served root, within its disk budget: over
    it, refused with the numbers and nothing written."""
    work = tmp_path_factory.mktemp("famhosted")
    (work / "files").mkdir()
    env = {"LAYERSWAP_HOSTED": "1", "LAYERSWAP_FILES_ROOT": str(work / "files"),
           "LAYERSWAP_MAX_VISITOR_DISK_BYTES": "1000"}
    gen = launch_app(work, mgsm_dir=None, env_extra=env)
    client = Client(next(gen), verbose=False)
    try:
        client.predict(BASE, MATH_REF, FAMILY, False, api_name="/load_family")
        with pytest.raises(AppError, match="per visitor"):
            client.predict("", *PLAN_ARGS, api_name="/export_family")
        assert not list((work / "files").rglob("layerswap-family*"))
        _, summary, *_ = client.predict("xx", *HEAT, *PLAN_ARGS, api_name="/family_heatmap")
        assert summary.startswith("**Language xx:**")
    finally:
        gen.close()


def test_a_family_without_a_base_has_no_language_heatmaps(app):
    _, client = app
    client.predict("", MATH_REF, FAMILY, False, api_name="/load_family")
    with pytest.raises(AppError, match="compare its experts with their base"):
        client.predict("en", *HEAT, *PLAN_ARGS, api_name="/family_heatmap")
    _, summary, *_ = client.predict(*HEAT, *PLAN_ARGS, api_name="/heatmap")  # the pair above, as before
    assert not summary.startswith("**Language")
