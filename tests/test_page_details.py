"""The smaller things of a newcomer's first hour (issue 33, point 8), below the page: the overlap panel says why its
cells are grey and keeps its row labels, a one-value panel still has a readable scale, a revert is named in the
heatmap's subtitle and the analysis summary, the lens grid's notes fit its narrowest width, and Export's default
folder is outside the checkout. The page itself: tests/test_first_hour.py::test_the_smaller_things."""

from __future__ import annotations

import pytest

from layerswap import Checkpoint, Plan
from layerswap.analysis import analyze
from layerswap.analysis.lens import LensConfig, lens_grid, run_lens
from layerswap.analysis.plots import analysis_heatmaps
from tests.helpers import DEMO, DEMO_MGSM, REPO


@pytest.fixture(scope="module")
def demo_analysis():
    c = {r: Checkpoint.open(DEMO / r) for r in ("base", "math", "lang")}
    return analyze(c["base"], c["math"], c["lang"], ks=(1.0,), cache=False), c


def test_the_overlap_panel_is_labelled_and_says_why_it_is_grey(demo_analysis):
    """The organism's experts touch disjoint tensors: the cosine of their changes is undefined in every cell."""
    an, _ = demo_analysis
    fig = analysis_heatmaps(an, ["math", "overlap"], plan=Plan(b=2, u=0, tb=0, tu=0, revert=(3,)))
    titles = [a.text for a in fig.layout.annotations]
    assert "every cell grey" in titles[1] and "one expert left the tensor unchanged" in titles[1]
    assert "grey" not in titles[0]
    for axis in (fig.layout.yaxis, fig.layout.yaxis2):  # the rows named even where no cell has a value
        assert list(axis.categoryarray) == an.row_labels and tuple(axis.range) == (len(an.row_labels) - 0.5, -0.5)
    assert "revert 3 to base" in fig.layout.title.text  # the subtitle names the whole plan
    jac = analysis_heatmaps(an, ["overlap"], overlap_metric="jaccard", k=1.0)
    trace = jac.data[0]
    assert trace.zmax - trace.zmin >= 1.0  # disjoint experts: every Jaccard is 0, the scale still reads 0-100 %
    assert "neither expert has an entry" in jac.layout.annotations[0].text


def test_the_analysis_summary_names_a_revert(demo_analysis):
    an, c = demo_analysis
    plan = Plan(b=2, u=0, tb=0, tu=0, revert=(3, 4))
    merged = an.merged(plan, c["math"], c["lang"], c["base"])
    assert "Merged model (plan b=2 u=0 tb=0 tu=0, revert 3-4 to base" in an.report(1.0, merged)


def test_the_lens_grids_notes_fit_its_narrowest_width(trio):
    from layerswap.analysis.lens.figures import SUBTITLE_WIDTH

    res = run_lens(trio["math"], trio["lang"], Plan(b=1, u=1, tb=0, tu=0), base=trio["base"], device="cpu",
                   config=LensConfig("xx", index=0, batch=3, source=DEMO_MGSM, answer_tokens=2), forward="stream")
    fig = lens_grid(res)
    notes = fig.layout.title.text.split("<br>")[1:]
    assert len(notes) == 3 and "outlined on the merged model" in notes[-1]
    # at subtitle size a character is at most ~6.5 px wide: each line fits between the margins
    assert all(6.5 * len(n.replace("<sup>", "").replace("</sup>", "")) <= SUBTITLE_WIDTH - 100 for n in notes)
    assert fig.layout.width >= SUBTITLE_WIDTH


def test_exports_land_outside_the_checkout():
    from layerswap.ui.tabs import build

    src = (REPO / "layerswap" / "ui" / "tabs" / "build.py").read_text()
    assert 'Path("~") / "layerswap-exports" / EXPORT_NAME' in src and build.EXPORT_NAME
    assert "/exports/" in (REPO / ".gitignore").read_text().splitlines()
