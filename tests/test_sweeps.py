"""Sweeps: every recipe is merged and evaluated with the loaded experts, and tabulated."""

from __future__ import annotations

import csv

import pytest

from layerswap import MethodConfig, Plan, Recipe, UserError
from layerswap.cli import main as cli
from layerswap.evaluation import EvalConfig
from layerswap.sweeps import SweepPoint, ablation_suite, run_sweep, swap_grid
from layerswap.workbench import Workbench
from tests.helpers import DEMO_MGSM


def _outputs(row, model):
    return [(r.lang, r.index, r.output) for r in row.report.results if r.model == model]


def test_sweep_rows_are_the_recipes_merges(trio):
    wb = Workbench(engine="transformers")
    wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    cfg = EvalConfig(langs=["xx", "en"], limit=3, max_new_tokens=6, source=str(DEMO_MGSM))
    points = [SweepPoint("math itself", Recipe(plan=Plan(b=0, u=0, tb=0, tu=0))),
              SweepPoint("all language", Recipe(plan=Plan(b=6, u=0, tb=0, tu=0))),
              SweepPoint("swap", Recipe(plan=Plan(b=1, u=1, tb=1, tu=1))),
              SweepPoint("soup", Recipe(MethodConfig("soup")))]
    res = run_sweep(wb, points, cfg)
    assert [r.name for r in res.rows] == ["math expert", "language expert", "math itself", "all language", "swap", "soup"]
    by = {r.name: r for r in res.rows}
    assert _outputs(by["math itself"], "merged model") == _outputs(by["math expert"], "math expert")
    assert _outputs(by["all language"], "merged model") == _outputs(by["language expert"], "language expert")
    assert _outputs(by["swap"], "merged model") != _outputs(by["math expert"], "math expert")
    assert by["swap"].layer_weights == [1, 0.5, 0, 0, 0.5, 1] and by["soup"].layer_weights is None
    assert all(sum(r.n.values()) == 6 for r in res.rows)
    assert res.best().kind == "merge"
    text = res.table_text()
    assert "math expert" in text and "one standard error" in text


def test_grids_and_suites():
    g = swap_grid(6, b=range(0, 3), u=range(0, 2), t=(0, 1))
    assert SweepPoint("swap b=0 u=0 t=0", Recipe(plan=Plan(b=0, u=0, tb=0, tu=0))) in g
    plans = [p.recipe.plan for p in g]
    assert all(p.b + p.u + 2 * p.tb <= 6 for p in plans)
    assert not any(p.b == p.u == 0 and p.tb for p in plans)
    with pytest.raises(UserError, match="No \\(b, u, t\\)"):
        swap_grid(2, b=[3], u=[3])
    names = [p.name for p in ablation_suite(8, Plan(b=2, u=1, tb=1, tu=1))]
    for must in ("no transition zone", "middle 3 layers", "alternating", "soup 50/50", "TIES (density 0.2)",
                 "attention only", "inverse (language middle, math outer)"):
        assert any(n.startswith(must) for n in names), must
    assert not any("TIES" in n for n in (p.name for p in ablation_suite(8, with_base=False)))


def test_sweep_cli(trio, tmp_path, capsys):
    rc = cli(["sweep", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b-values", "0-1",
              "--u-values", "0-1", "--t-values", "0", "--langs", "xx", "--limit", "2", "--max-new-tokens", "4",
              "--mgsm-dir", str(DEMO_MGSM), "--engine", "transformers", "-o", str(tmp_path / "s.csv"),
              "--plot", str(tmp_path / "s.html"), "-q"])
    out = capsys.readouterr().out
    assert rc == 0 and "4 recipes on 6 layers" in out and "best merge" in out
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert len(rows) == 2 * (2 + 4) and {r["metric"] for r in rows} == {"flexible", "strict"}
    assert "plotly" in (tmp_path / "s.html").read_text().lower()
