"""Sweeps: sweep files, the resumable results file (SIGKILL mid-run, damaged last line), refused expert sets,
tables and plots, the flag form, and the in-memory evaluate_points."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from layerswap import MethodConfig, Plan, Recipe, UserError
from layerswap.cli import main as cli
from layerswap.shipped.demo import make_tiny_llama, perturb
from layerswap.evaluation.run import EvalConfig
from layerswap.models.checkpoints import Checkpoint
from layerswap.sweeps import ResultsLog, SweepPoint, load_results, load_spec
from layerswap.sweeps.report import (accuracy_heatmap, recipe_bars, results_table, stats_table, sweep_curves,
                                     table_text, write_csv, write_html)
from layerswap.sweeps import ablation_suite, evaluate_points, run_sweep, swap_grid
from layerswap.serving.workbench import Workbench
from tests.helpers import DEMO_MGSM, REPO


def _sweep_file(tmp_path, trio, **over) -> str:
    d = {
        "name": "tiny",
        "experts": {"math": str(trio["math"]), "lang": str(trio["lang"]), "base": str(trio["base"])},
        "grid": {"name": "b={b} u={u}", "recipe": {"plan": {"tb": 0, "tu": 0}}, "vary": {"b": [0, 1, 5], "u": [0, 2]}},
        "recipes": [{"name": "soup", "method": {"name": "soup", "weight": 0.5}},
                    {"name": "revert 2", "plan": {"b": 1, "u": 1, "tb": 0, "tu": 0, "revert": [2]}}],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx", "en"]}],
        "eval": {"limit": 2, "max_new_tokens": 4},
        "engine": {"engine": "transformers", "device": "cpu"},
        "stats": True,
    }
    d.update(over)
    d = {k: v for k, v in d.items() if v is not None}
    f = tmp_path / "sweep.yaml"
    f.write_text(yaml.safe_dump(d))
    return str(f)


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("seconds",)} for r in rows]


def test_sweep_files_expand_and_refuse_clearly(tmp_path, trio):
    spec = load_spec(_sweep_file(tmp_path, trio))
    names = [p.name for p in spec.points]
    assert names == ["soup", "revert 2", "b=0 u=0", "b=0 u=2", "b=1 u=0", "b=1 u=2", "b=5 u=0", "b=5 u=2"]
    assert spec.points[3].recipe == Recipe(plan=Plan(b=0, u=2, tb=0, tu=0)) and spec.points[3].from_grid
    assert spec.points[0].recipe.plan is None
    rel = tmp_path / "sub"
    rel.mkdir()
    (rel / "s.yaml").write_text("experts: {math: ../m, lang: ../l}\nrecipes: [{plan: {b: 1}}]\n"
                                f"test_sets: [{DEMO_MGSM}]\nlangs: [xx]\nbuild: make experts\n")
    spec = load_spec(rel / "s.yaml")
    assert spec.expert_sets[0].math == str(tmp_path / "m")
    with pytest.raises(UserError, match=r"2 expert folders are missing: .*/m, .*/l\. Build them with: make experts"):
        run_sweep(spec, tmp_path / "r.jsonl")
    for over, msg in [({"grid": {"vary": {"bottom": [1]}}}, "grid cannot vary 'bottom'"),
                      ({"recipez": []}, "unknown key recipez"),
                      ({"recipes": [{"name": "x", "method": "soup", "plan": {"b": 1}}]}, "takes no layer map"),
                      ({"test_sets": [{"path": str(DEMO_MGSM), "langs": ["zz"]}]}, "Unknown MGSM language code zz"),
                      ({"recipes": [{"name": "a", "plan": {"b": 1}}, {"name": "a", "plan": {"b": 2}}]}, "repeated: a")]:
        with pytest.raises(UserError, match=msg):
            load_spec(_sweep_file(tmp_path, trio, **over))


def test_run_resume_and_a_damaged_last_line(tmp_path, trio):
    f = _sweep_file(tmp_path, trio)
    out = tmp_path / "r.jsonl"
    run = run_sweep(f, out)
    # b=5 u=2 needs 7 of the 6 layers: left out; 7 recipes on 1 test set + 2 experts + statistics
    assert run.left_out == {f"{trio['math'].parent}/{{math, lang}}": 1} and run.ran == 1 + 2 + 7 == len(run.rows)
    rows = load_results(out)
    assert _strip(rows) == _strip(run.rows) and len({r["key"] for r in rows}) == len(rows)
    by = {r["name"]: r for r in rows}
    assert by["b=0 u=0"]["correct_flexible"] == by["math expert"]["correct_flexible"]
    assert by["revert 2"]["reverted"] == [2] and by["revert 2"]["layer_weights"] == [1, 0, 0, 0, 0, 1]
    assert by["soup"]["recipe"] == {"method": {"name": "soup", "weight": 0.5}}
    assert set(by["math expert"]["experts"]) == {"math", "lang", "base"}
    assert by["math expert"]["eval"] == {"langs": ["xx", "en"], "limit": 2, "max_new_tokens": 4}
    assert by["model-level statistics"]["relative_change"]["math"] > 0
    again = run_sweep(f, out)
    assert again.ran == 0 and _strip(again.rows) == _strip(rows)
    # a write cut short (power loss): the last line has no newline; it is cut off and that point redone
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 40])
    redo = run_sweep(f, out)
    assert redo.ran == 1 and redo.repaired and "line 10" in redo.repaired
    assert _strip(load_results(out)) == _strip(rows)
    # damage before the end is refused with the line number
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + "{oops\n" + "".join(lines[1:]))
    with pytest.raises(UserError, match="line 2 is not valid JSON, and records follow it"):
        run_sweep(f, out)


def test_a_second_writer_is_refused(tmp_path):
    with ResultsLog(tmp_path / "r.jsonl"):
        with pytest.raises(UserError, match="being written by another sweep"):
            ResultsLog(tmp_path / "r.jsonl")


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, trio):
    # the property does not depend on the evaluation's size: the smallest one of _sweep_file (2 questions,
    # 4 tokens) keeps every point long enough to be killed between lines
    f = _sweep_file(tmp_path, trio, stats=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "layerswap.cli", "sweep", f, "-q"]
    run_sweep(f, tmp_path / "whole.jsonl")  # the uninterrupted run, in this process (the CLI is killed below)
    whole = load_results(tmp_path / "whole.jsonl")
    killed = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(cmd + ["-o", str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if killed.exists() and killed.read_bytes().count(b"\n") >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"
    partial = killed.read_bytes().count(b"\n")
    assert 3 <= partial < len(whole)
    subprocess.run(cmd + ["-o", str(killed)], check=True, env=env, timeout=300, capture_output=True)
    resumed = load_results(killed)
    raw = [json.loads(x)["key"] for x in killed.read_text().splitlines()]
    assert len(raw) == len(set(raw)) == len(whole)  # every point exactly once
    assert _strip(resumed) == _strip(whole)


def test_different_shapes_are_refused_and_a_forced_base_mismatch_runs(tmp_path, trio, tokenizer):
    wide = make_tiny_llama(tmp_path / "wide", layers=6, hidden=96, seed=3, tokenizer=tokenizer)
    other = perturb(make_tiny_llama(tmp_path / "other_base", layers=6, seed=9, tokenizer=tokenizer),
                    tmp_path / "other_lang", scale=0.05, seed=4)
    sets = [{"name": "shapes differ", "math": str(trio["math"]), "lang": str(wide)},
            {"name": "other base, forced", "math": str(trio["math"]), "lang": str(other), "base": str(trio["base"]),
             "force": True}]
    f = _sweep_file(tmp_path, trio, expert_sets=sets, experts=None, grid=None, stats=True,
                    recipes=[{"name": "swap", "plan": {"b": 1, "u": 1}}])
    run = run_sweep(f, tmp_path / "r.jsonl")
    refused = [r for r in run.rows if r["kind"] == "refused"]
    assert len(refused) == 1 and refused[0]["set"] == "shapes differ" and "shape" in refused[0]["message"]
    forced = [r for r in run.rows if r["set"] == "other base, forced"]
    stats = next(r for r in forced if r["kind"] == "stats")
    assert stats["pairing"]["suspicious"] and stats["pairing"]["distances"]["lang-base"] > 0.5
    assert next(r for r in forced if r["kind"] == "merge")["pairing_forced"] is True
    rows = stats_table(run.rows)
    assert rows[0]["refused"] and rows[1]["sampled lang-base"] > 0.5
    assert run_sweep(f, tmp_path / "r.jsonl").ran == 0  # the refusal is a finished point too


def test_tables_and_figures(tmp_path, trio):
    run = run_sweep(_sweep_file(tmp_path, trio), tmp_path / "r.jsonl")
    table = results_table(run.rows)
    row = next(r for r in table if r["recipe"] == "b=1 u=2")
    assert set(row) >= {"xx", "xx ±", "en", "en ±", "average", "average ±", "max", "n", "var b", "var u"}
    assert row["max"] == max(row["xx"], row["en"]) and row["n"] == 4
    text = table_text(run.rows)
    assert "| recipe | xx | en | average | max | n |" in text and "math expert" in text
    heat = accuracy_heatmap(run.rows)
    assert list(heat.data[0].x) == [0, 1, 5] and list(heat.data[0].y) == [0, 2]
    bars = recipe_bars(run.rows)
    assert len(bars.data[0].y) == 7 and len(bars.layout.shapes) == 2  # two experts as lines
    with pytest.raises(UserError, match="vary one setting"):
        sweep_curves(run.rows)
    rows = list(csv.DictReader(open(write_csv(run.rows, tmp_path / "t.csv"))))
    assert len(rows) == 9 and rows[0]["xx ±"] != ""
    page = write_html(run.rows, tmp_path / "t.html").read_text()
    assert page.count("plotly.js") >= 1 and "Experts" in page and "b=1 u=2" in page


def test_bars_of_several_expert_sets_mark_each_sets_own_experts(tmp_path, trio):
    """Several sets: each set's experts are ticks on that set's bars, not lines across every set's bars."""
    sets = [{"name": n, "math": str(trio[m]), "lang": str(trio["lang"]), "base": str(trio["base"])}
            for n, m in (("A", "math"), ("B", "base"))]  # B: the base stands in for a (weaker) math expert
    f = _sweep_file(tmp_path, trio, expert_sets=sets, experts=None, grid=None, stats=False,
                    recipes=[{"name": "swap", "plan": {"b": 1, "u": 1}}, {"name": "soup", "method": "soup"}])
    run = run_sweep(f, tmp_path / "r.jsonl")
    bars = recipe_bars(run.rows)
    assert not bars.layout.shapes and list(bars.data[0].y) == ["A · mgsm · swap", "A · mgsm · soup",
                                                               "B · mgsm · swap", "B · mgsm · soup"]
    ref = {(r["set"], r["recipe"]): r["average"] for r in results_table(run.rows)}
    assert {t.name for t in bars.data[1:]} == {"math expert", "language expert"}
    for trace in bars.data[1:]:
        assert len(trace.x) == 4
        for x, y in zip(trace.x, trace.y):
            assert x == pytest.approx(ref[(y.split(" · ")[0], trace.name)], abs=0.051)


def test_one_dimensional_sweeps_get_curves(tmp_path, trio):
    f = _sweep_file(tmp_path, trio, recipes=None,
                    grid={"name": "tw={transition_weight}", "recipe": {"plan": {"b": 1, "u": 1, "tb": 1, "tu": 1}},
                          "vary": {"transition_weight": [0.0, 0.5, 1.0]}}, stats=False)
    run = run_sweep(f, None)
    fig = sweep_curves(run.rows)
    assert [list(t.x) for t in fig.data] == [[0.0, 0.5, 1.0]] * 3 and fig.data[-1].name == "average"


def test_flag_form_and_file_form_cli(trio, tmp_path, capsys):
    rc = cli(["sweep", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b-values", "0-1",
              "--u-values", "0-1", "--t-values", "0", "--langs", "xx", "--limit", "2", "--max-new-tokens", "4",
              "--mgsm-dir", str(DEMO_MGSM), "--engine", "transformers", "-o", str(tmp_path / "s.csv"),
              "--plot", str(tmp_path / "s.html"), "-q"])
    out = capsys.readouterr().out
    assert rc == 0 and "4 recipes x 1 expert set(s)" in out and "best merge" in out
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert len(rows) == 2 + 4 and {r["recipe"] for r in rows} >= {"math expert", "swap b=1 u=1 t=0"}
    assert "plotly" in (tmp_path / "s-heatmap.html").read_text().lower()
    f = _sweep_file(tmp_path, trio, grid=None, stats=False)
    assert cli(["sweep", f, "-o", str(tmp_path / "r.jsonl"), "--html", str(tmp_path / "r.html"), "-q"]) == 0
    assert "4 point(s) run now" in capsys.readouterr().out
    assert cli(["sweep", f, "-o", str(tmp_path / "r.jsonl"), "--limit", "1", "-q"]) == 0  # other settings: new points
    assert "4 point(s) run now, 0 already" in capsys.readouterr().out
    assert len(load_results(tmp_path / "r.jsonl")) == 8
    assert cli(["sweep", f, "--math", "x"]) == 2
    assert "names the experts; drop --math" in capsys.readouterr().err


def _outputs(row, model):
    return [(r.lang, r.index, r.output) for r in row.report.results if r.model == model]


def test_evaluate_points_in_memory(trio):
    wb = Workbench(engine="transformers")
    wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    cfg = EvalConfig(langs=["xx", "en"], limit=3, max_new_tokens=6, source=str(DEMO_MGSM))
    points = [SweepPoint("math itself", Recipe(plan=Plan(b=0, u=0, tb=0, tu=0))),
              SweepPoint("all language", Recipe(plan=Plan(b=6, u=0, tb=0, tu=0))),
              SweepPoint("swap", Recipe(plan=Plan(b=1, u=1, tb=1, tu=1))),
              SweepPoint("soup", Recipe(MethodConfig("soup")))]
    res = evaluate_points(wb, points, cfg)
    assert [r.name for r in res.rows] == ["math expert", "language expert", "math itself", "all language", "swap", "soup"]
    by = {r.name: r for r in res.rows}
    assert _outputs(by["math itself"], "merged model") == _outputs(by["math expert"], "math expert")
    assert _outputs(by["all language"], "merged model") == _outputs(by["language expert"], "language expert")
    assert by["swap"].layer_weights == [1, 0.5, 0, 0, 0.5, 1] and by["soup"].layer_weights is None
    assert res.best().kind == "merge" and "one standard error" in res.table_text()


def test_grids_and_suites():
    g = swap_grid(6, b=range(3), u=range(2), t=(0, 1))
    assert SweepPoint("swap b=0 u=0 t=0", Recipe(plan=Plan(b=0, u=0, tb=0, tu=0)), (("b", 0), ("u", 0), ("t", 0)),
                      from_grid=True) in g
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


@pytest.mark.parametrize("name", ["1-counts", "2-transition", "3-location", "4-divergence", "5-peft", "6-bases"])
def test_shipped_sweep_files(name, tmp_path):
    import dataclasses

    from layerswap.sweeps.spec import fit_points

    spec = load_spec(REPO / "assets" / "sweeps" / f"{name}.yaml")
    fit_points(spec.points, Checkpoint.open(REPO / "assets" / "demo" / "math").num_layers)  # fits the organism
    assert not spec.missing() and spec.include_experts  # every expert they name ships (assets/demo/ablation for 4-6)
    if name[0] in "456":  # a deleted extra expert stops the sweep at once with the command that builds it again
        assert spec.build == "python scripts/build_demo_experts.py --ablation-experts"
        spec.expert_sets[-1] = dataclasses.replace(spec.expert_sets[-1], lang=str(tmp_path / "gone"))
        with pytest.raises(UserError, match="Build them with: python scripts/build_demo_experts.py --ablation"):
            run_sweep(spec, None)


def test_a_results_file_is_reused_from_another_clone(tmp_path, trio, monkeypatch):
    """Records are keyed by the models' content, not their place or file times, and name them portably: the same
    experts copied elsewhere (a fresh clone) find every point of the file done."""
    import shutil

    monkeypatch.chdir(tmp_path)
    here = tmp_path / "clone1"
    for r in ("base", "math", "lang"):
        shutil.copytree(trio[r], here / r)
    f = _sweep_file(tmp_path, {r: here / r for r in ("base", "math", "lang")}, stats=None,
                    grid={"name": "b={b}", "recipe": {"plan": {"tb": 0, "tu": 0, "u": 0}}, "vary": {"b": [1]}},
                    recipes=None)
    out = tmp_path / "r.jsonl"
    first = run_sweep(f, out)
    assert first.ran == 3
    rec = load_results(out)[0]
    assert rec["experts"]["math"]["ref"] == "clone1/math" and str(tmp_path) not in out.read_text()
    time.sleep(0.01)
    other = tmp_path / "clone2"
    for r in ("base", "math", "lang"):
        shutil.copytree(trio[r], other / r, copy_function=shutil.copy)  # new files, new mtimes
    f2 = _sweep_file(tmp_path, {r: other / r for r in ("base", "math", "lang")}, stats=None,
                     grid={"name": "b={b}", "recipe": {"plan": {"tb": 0, "tu": 0, "u": 0}}, "vary": {"b": [1]}},
                     recipes=None)
    assert run_sweep(f2, out).ran == 0
    # a changed weight is another model
    from safetensors.torch import load_file, save_file

    sd = load_file(other / "lang" / "model.safetensors")
    name = next(n for n in sd if "layers.0.mlp" in n)
    sd[name] = sd[name].clone()
    sd[name][0, 0] += 0.01
    save_file(sd, other / "lang" / "model.safetensors", metadata={"format": "pt"})
    assert run_sweep(f2, out).ran == 3  # another expert set: every point again


def test_exact_intervals_paired_average_and_comparisons(tmp_path, trio):
    from layerswap.sweeps.report import paired_comparison, scores

    run = run_sweep(_sweep_file(tmp_path, trio, eval={"limit": 4, "max_new_tokens": 4}), tmp_path / "r.jsonl")
    r = next(x for x in run.rows if x["kind"] == "merge")
    s = scores(r)
    for lang in ("xx", "en"):
        k = r["correct_flexible"][lang].count("1")
        assert s["ci"][lang][0] <= 100 * k / 4 <= s["ci"][lang][1]
    if r["correct_flexible"]["xx"] == r["correct_flexible"]["en"]:  # same outcomes: the average is one language
        assert s["average_se"] == pytest.approx(s["se"]["xx"] * (4 / 3) ** 0.5)
    zero = dict(r, accuracy={"flexible": {"xx": 0.0, "en": 0.0}}, correct_flexible={"xx": "0000", "en": "0000"})
    assert scores(zero)["ci"]["xx"] == pytest.approx((0.0, 60.24), abs=0.01)  # 0/4: [0, 1 - 0.025^(1/4)]
    assert "0.0 [0.0, 60.2]" in table_text([zero])
    c = paired_comparison(r, zero, "xx")
    assert c["only_b"] == 0 and c["only_a"] == r["correct_flexible"]["xx"].count("1")
    assert c["p"] == pytest.approx(min(1.0, 2 * 0.5 ** c["only_a"]))
