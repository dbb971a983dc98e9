"""A plan that reverts layers, for every kind of map, in every view: export (API and CLI), in-memory merge,
strip, analysis panels (merged included, API and CLI), mergekit YAML (rebuilt by mergekit), card, share link.

The expected sources are written out here per layer, independently of layerswap's planner.
"""

from __future__ import annotations

import csv
import json
import random
import re
from urllib.parse import parse_qsl

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from layerswap import Checkpoint, Plan, Recipe, export_merge, merge_in_memory
from layerswap.analysis import analyze
from layerswap.cli import main as cli
from layerswap.merge.interop import mergekit_config
from layerswap.recipe.plans import KINDS
from layerswap.recipe.sources import Sources
from layerswap.analysis.plots import analysis_heatmaps, layer_strip
from layerswap.ui import controls
from tests.helpers import expected_tensor, read_dir
from tests.test_analysis_merged import merged_reference
from tests.test_interop import assert_same_tensors, run_mergekit

L = 6
_RANDOM = set(random.Random(4).sample(range(L), 3))
# kind -> (plan, the map's language weight per layer before the revert, non-layer rule)
CASES = {
    "swap": (Plan(b=2, u=1, tb=1, tu=0, revert=(3,)), [1, 1, 0.5, 0, 0, 1]),
    "weights": (Plan(kind="weights", weights=(0.3, 1.0, 0.6, 0.0, 1.0, 0.25), non_layer="lang", revert=(1, 4)),
                [0.3, 1, 0.6, 0, 1, 0.25]),
    "middle": (Plan(kind="middle", k=2, revert=(2,)), [0, 0, 1, 1, 0, 0]),
    "random": (Plan(kind="random", k=3, seed=4, non_layer="math", revert=(0, 5)),
               [1 if i in _RANDOM else 0 for i in range(L)]),
    "alternating": (Plan(kind="alternating", offset=1, non_layer="avg", revert=(5,)), [0, 1, 0, 1, 0, 1]),
}
BASE = "base model (fine-tuning reverted)"


def test_every_kind_is_covered():
    assert set(CASES) == set(KINDS)


def _non_layer_weight(plan: Plan, name: str, mapw: list[float]) -> float:
    fixed = {"math": 0.0, "lang": 1.0, "avg": 0.5}
    if plan.non_layer in fixed:
        return fixed[plan.non_layer]
    return mapw[0] if "embed_tokens" in name else mapw[-1]


def _expected(trio, plan: Plan, mapw: list[float]) -> dict[str, torch.Tensor]:
    """The merge as the plan defines it: reverted layers are the base's tensors, the rest the map's blend."""
    sd = {r: read_dir(trio[r]) for r in ("base", "math", "lang")}
    out = {}
    for name, m in sd["math"].items():
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else None
        if layer in plan.revert:
            out[name] = sd["base"][name]
        else:
            w = mapw[layer] if layer is not None else _non_layer_weight(plan, name, mapw)
            out[name] = expected_tensor(m, sd["lang"][name], float(w))
    return out


def _flags(trio, plan: Plan) -> list[str]:
    f = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"]),
         "--map", plan.kind, "--non-layer", plan.non_layer, "--revert", ",".join(map(str, plan.revert))]
    if plan.kind == "swap":
        f += ["--b", str(plan.b), "--u", str(plan.u), "--tb", str(plan.tb), "--tu", str(plan.tu)]
    if plan.kind == "weights":
        f += ["--layer-weights", ",".join(repr(w) for w in plan.weights)]
    if plan.kind in ("middle", "random"):
        f += ["--map-k", str(plan.k), "--seed", str(plan.seed)]
    if plan.kind == "alternating":
        f += ["--offset", str(plan.offset)]
    return f


@pytest.fixture(scope="module")
def cks(trio_bf16):
    return {r: Checkpoint.open(trio_bf16[r]) for r in ("base", "math", "lang")}


@pytest.fixture(scope="module")
def an(cks):
    return analyze(cks["base"], cks["math"], cks["lang"], ks=(1.0,), cache=False)


@pytest.fixture(scope="module")
def exported(trio_bf16, cks, tmp_path_factory) -> dict[str, tuple[int, object]]:
    """Per kind: the Python API's export (ours), the CLI's mergekit YAML (exit code, merge.yml) and mergekit's
    rebuild from it (theirs); mergekit runs once over every kind."""
    done = {}
    for kind, (plan, _) in CASES.items():
        d = tmp_path_factory.mktemp(f"revert-{kind}")
        export_merge(cks["math"], cks["lang"], plan, d / "ours", base=cks["base"])
        done[kind] = (cli(["export-yaml", *_flags(trio_bf16, plan), "-o", str(d / "merge.yml")]), d)
    run_mergekit([(d / "merge.yml", d / "theirs") for rc, d in done.values() if rc == 0])
    return done


@pytest.mark.parametrize("kind", list(CASES))
def test_export_memory_yaml_and_card(trio_bf16, cks, exported, tmp_path, kind):
    plan, mapw = CASES[kind]
    want = _expected(trio_bf16, plan, mapw)
    # Python API export, and the CLI's: the same tensors, reverted layers byte for byte the base's
    rc, d = exported[kind]
    assert cli(["merge", *_flags(trio_bf16, plan), "-o", str(tmp_path / "cli"), "-q"]) == 0
    base = read_dir(trio_bf16["base"])
    for out in (d / "ours", tmp_path / "cli"):
        got = read_dir(out)
        assert set(got) == set(want)
        for name, t in want.items():
            assert torch.equal(got[name], t), (out, name)
            if any(f"layers.{i}." in name for i in plan.revert):
                assert got[name].view(torch.uint8).tolist() == base[name].view(torch.uint8).tolist()
    # in memory, as the workbench merges
    sd = {r: read_dir(trio_bf16[r]) for r in ("base", "math", "lang")}
    mem = merge_in_memory(sd["math"], sd["lang"], L, plan, base=sd["base"].__getitem__, arch=cks["math"].arch)
    assert all(torch.equal(mem[n], want[n]) for n in want)
    # the mergekit YAML (CLI = API), and mergekit rebuilds the same weights from it
    assert rc == 0
    assert yaml.safe_load((d / "merge.yml").read_text()) == mergekit_config(cks["math"], cks["lang"], plan, cks["base"])
    assert_same_tensors(d)
    # the card: reverted layers, the map's weights, one row per layer saying where it comes from
    prov = json.loads((d / "ours" / "layerswap.json").read_text())
    assert prov["reverted_layers"] == sorted(plan.revert) and prov["layer_weights_lang"] == mapw
    card = (d / "ours" / "README.md").read_text()
    for i in range(L):
        row = rf"^\| {i} \| – \| {re.escape(BASE)} \|$" if i in plan.revert else rf"^\| {i} \| {mapw[i]:.4g} \| "
        assert re.search(row, card, re.MULTILINE), (i, card)


@pytest.mark.parametrize("kind", list(CASES))
def test_strip_analysis_and_share_link(trio_bf16, cks, an, tmp_path, kind):
    plan, mapw = CASES[kind]
    # the strip: blue B on reverted layers, the map's weight elsewhere
    for fig in (layer_strip(plan, L), controls.strip_figure(Sources(Recipe(plan=plan), L))):
        z, marks = fig.data[0].z[0], fig.data[1].text[0]
        assert [z[i] is None for i in range(L)] == [i in plan.revert for i in range(L)]
        assert [z[i] for i in range(L) if i not in plan.revert] == [mapw[i] for i in range(L) if i not in plan.revert]
        assert [i for i, t in enumerate(marks) if t == "B"] == sorted(plan.revert)
    # the merged model's statistics against the written merge (float64 reference)
    export_merge(cks["math"], cks["lang"], plan, tmp_path / "merged", base=cks["base"])
    ref = merged_reference(trio_bf16, tmp_path / "merged", (1.0,))
    ms = an.merged(plan, cks["math"], cks["lang"], cks["base"])
    names = [t.name for t in an.tensors]
    for panel, vs in (("merged", "base"), ("merged-math", "math"), ("merged-lang", "lang")):
        got = an.values(panel, "relative", merged=ms)
        for i, n in enumerate(names):
            assert got[i] == pytest.approx(ref[vs]["relative"][n], rel=1e-5, abs=1e-12), (panel, n)
    lo, hi = ms.topk_at(1.0).bounds()
    for i, n in enumerate(names):
        assert lo[i] - 1e-12 <= ref["topk"][1.0][n] <= hi[i] + 1e-12, n
    reverted = [i for i, t in enumerate(an.tensors) if t.layer in plan.revert]
    assert reverted and all(n not in ms.streamed for n in np.array(names)[reverted])  # known exactly, not read
    fig = analysis_heatmaps(an, ["math", "lang", "merged", "merged-math", "merged-lang"], merged=ms, plan=plan)
    assert len(fig.data) == 5 and "reverted to the base" in fig.layout.title.text
    # the share link carries the revert and restores the same recipe
    values = [plan.b, plan.u, plan.tb, plan.tu, plan.transition, plan.transition_weight, plan.non_layer, plan.kind,
              ",".join(map(str, plan.weights)) if plan.weights else "", plan.k, plan.seed, plan.offset, plan.modules,
              "layer_swap", 0.5, 1.0, 0.2, 0.9, "1,1", ",".join(map(str, plan.revert))]
    q = controls.query_string(("b/", "m/", "l/"), values, "analysis")
    updates, tab = controls.restore(dict(parse_qsl(q.lstrip("?"))))
    assert tab == "analysis"
    restored = [u.get("value", v) for u, v in zip(updates, values)]  # a link leaves out empty values (kept as they are)
    assert restored == [v for v in values] and "revert=" in q
    assert controls.read_plan(restored).recipe.to_dict() == Recipe(plan=plan).to_dict()  # as the page's events read it


@pytest.mark.parametrize("kind", list(CASES))
def test_diff_cli_shows_the_merged_panels(trio_bf16, tmp_path, kind, capsys):
    """`layerswap diff --revert ...` (the issue's failing command) draws every panel and writes the merged columns."""
    plan, _ = CASES[kind]
    out, table = tmp_path / "heat.html", tmp_path / "all.csv"
    rc = cli(["diff", *_flags(trio_bf16, plan), "--panels", "math,lang,merged", "-o", str(out), "--csv", str(table),
              "--no-cache", "-q", "--top", "0"])
    assert rc == 0, capsys.readouterr().err
    assert "Merged model" in capsys.readouterr().out and out.is_file()
    rows = list(csv.DictReader(table.open()))
    for r in rows:
        if r["layer"] and int(r["layer"]) in plan.revert:
            assert r["merged_source"] == BASE and float(r["relative_merged"]) == 0.0 and r["w_lang"] == ""
            assert float(r["relative_merged_vs_math"]) == pytest.approx(float(r["relative_math"]))
    assert cli(["diff", *_flags(trio_bf16, plan), "--panels", "math,lang", "--no-cache", "-q", "--top", "0"]) == 0


def test_the_workbench_builds_and_analyses_a_revert(trio):
    """The app's path: Build with a revert, then the analysis with the merged panels."""
    from layerswap.serving.workbench import Workbench

    plan = Plan(b=1, u=1, tb=1, tu=0, revert=(3,))
    wb = Workbench(engine="transformers")
    try:
        wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
        wb.build(plan)
        merged_sd = wb.engines["merged"].state_dict()
        base = load_file(str(trio["base"] / "model.safetensors"))
        for name, t in base.items():
            if ".layers.3." in name:
                assert torch.equal(merged_sd[name], t), name
        ms = wb.merged_stats(plan)
        rel = wb.analysis().values("merged", "relative", merged=ms)
        assert all(rel[i] == 0.0 for i, t in enumerate(wb.analysis().tensors) if t.layer == 3)
    finally:
        wb.close()
