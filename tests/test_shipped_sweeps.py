"""The shipped sweep files say true things about the models they run (issue 33, point 7): every layer count, the
organism's plan, the spread and alternating maps, which sets the shared-base check flags (hence `force`), and how
far the flagged experts moved. Checked against the models themselves, not against layerswap's own summaries."""

from __future__ import annotations

import json
import re

import pytest
from safetensors import safe_open

from layerswap import Checkpoint, Plan
from layerswap.models.adapters import open_expert
from layerswap.models.pairing import check_mergeable
from layerswap.models.presets import assets_dir
from layerswap.sweeps import load_spec

SWEEPS = sorted((assets_dir() / "sweeps").glob("*.yaml"))
DEMO = assets_dir() / "demo"


def comments(path) -> str:
    return " ".join(line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#"))


def organism_plan() -> dict:
    raw = json.loads((DEMO / "results.json").read_text())["recommended_plan"]
    return {k: raw[k] for k in ("b", "u", "tb", "tu")}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_layer_counts_and_the_organisms_plan_are_the_models(path):
    spec = load_spec(path)
    L = {Checkpoint.open(s.base).num_layers for s in spec.expert_sets}  # every set's base (its experts' shape)
    text = comments(path)
    for n in re.findall(r"(\d+) layers", text) + re.findall(r"of the organism's (\d+) layers", text):
        assert {int(n)} == L, f"{path.name} says {n} layers; its experts have {L}"
    for name in [p.name for p in spec.points if "the organism's plan" in p.name] + (
            ["recommended"] if "recommended plan (b=" in text else []):
        said = re.search(r"b=(\d+),? u=(\d+)", name if name != "recommended" else text.split("recommended plan")[1])
        assert {"b": int(said[1]), "u": int(said[2])} == {k: organism_plan()[k] for k in ("b", "u")}, path.name
    for p in spec.points:
        if p.recipe.plan is not None and p.recipe.plan.kind == "swap" and "organism's plan" in p.name:
            assert {k: getattr(p.recipe.plan, k) for k in ("b", "u", "tb", "tu")} == organism_plan()


def test_the_location_files_maps_are_what_it_says():
    path = assets_dir() / "sweeps" / "3-location.yaml"
    spec, text = load_spec(path), comments(path)
    L = Checkpoint.open(spec.expert_sets[0].math).num_layers
    spread = next(p for p in spec.points if p.name.startswith("spread"))
    said = [int(x) for x in re.search(r"spread evenly \(([\d, ]+)\)", text)[1].split(",")]
    assert [i for i, w in enumerate(spread.recipe.plan.layer_weights(L)) if w == 1] == said
    alternating = next(p for p in spec.points if p.name.startswith("alternating"))
    n, of = map(int, re.search(r"every other layer: (\d+) of (\d+)", text).groups())
    assert sum(alternating.recipe.plan.layer_weights(L)) == n and of == L
    for p in spec.points:  # "at equal counts": 3 layers each, but alternating
        if not p.name.startswith("alternating"):
            assert sum(p.recipe.plan.layer_weights(L)) == 3, p.name
    assert Plan(kind="alternating").layer_weights(L) == alternating.recipe.plan.layer_weights(L)


def test_the_transition_files_language_expert_changed_only_the_bottom():
    """2-transition.yaml: 'its language expert changed only the embeddings and layers 0-1'."""
    def tensors(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as h:
            return {k: h.get_tensor(k) for k in h.keys()}

    base, lang = tensors(DEMO / "base"), tensors(DEMO / "lang")
    changed = {k for k in base if not (base[k] == lang[k]).all()}
    layers = {int(k.split(".")[2]) for k in changed if k.startswith("model.layers.")}
    assert layers == {0, 1} and {k for k in changed if not k.startswith("model.layers.")} == {"model.embed_tokens.weight"}


@pytest.mark.parametrize("path", [p for p in SWEEPS if "force" in p.read_text()], ids=lambda p: p.name)
def test_forced_sets_are_the_ones_the_shared_base_check_flags(path):
    """Every set the check flags is forced or is a refusal the file shows on purpose ("not forced"), and the
    distances the comments quote for the flagged experts ("moved A-B from it") are theirs."""
    spec, text = load_spec(path), comments(path)
    moved = []
    for s in spec.expert_sets:
        check = check_mergeable(open_expert(s.math, s.base), open_expert(s.lang, s.base), Checkpoint.open(s.base),
                                force=s.force)
        if not check.report.ok:
            assert "different shapes" in s.name, s.name  # refused on headers, as the file says
            continue
        flagged = check.pairing.suspicious
        assert not flagged or s.force or "not forced" in s.name, (s.name, flagged)
        if flagged and s.force:
            moved.append(max(flagged.values()))
    said = re.search(r"move[ds]? (\d\.\d+)(?:-(\d\.\d+))? from", text)
    if "force: true" in path.read_text() and said:
        lo, hi = float(said[1]), float(said[2] or said[1])
        assert (round(min(moved), 2), round(max(moved), 2)) == (lo, hi), (path.name, moved)


def test_sweep_progress_from_the_first_second_and_an_eta_from_measured_points(tmp_path, trio):
    """The runner says what it does before anything loads (points, then what is loading), names an unnamed expert
    set by its experts, and its ETA is the measured points' own time (their records' seconds) per point times the
    points left: loading the experts (made slow here by the listener itself) is not counted."""
    import time

    import yaml

    from layerswap.sweeps import load_results, run_sweep
    from layerswap.sweeps.report import results_table
    from tests.helpers import DEMO_MGSM

    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({
        "experts": {"math": str(trio["math"]), "lang": str(trio["lang"]), "base": str(trio["base"])},
        "recipes": [{"name": f"b={b}", "plan": {"b": b, "u": 0, "tb": 0, "tu": 0}} for b in (1, 2)],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx"]}], "eval": {"limit": 2, "max_new_tokens": 4},
        "engine": {"engine": "transformers", "device": "cpu"}}))
    seen: list[tuple[float, str]] = []

    def listen(fraction: float, text: str) -> None:
        seen.append((fraction, text))
        if text.endswith("loading the experts: reading checkpoint headers"):
            time.sleep(2.0)  # a slow disk: what an ETA over elapsed time would count

    out = tmp_path / "r.jsonl"
    run = run_sweep(str(f), out, progress=listen)
    total = len(run.rows)  # the two experts and the two merges
    name = f"{trio['math'].parent}/{{math, lang}}"
    assert seen[0] == (0.0, f"0/{total} points · starting")
    assert seen[1][1] == f"0/{total} points · {name}: loading the experts"
    assert any("loading the experts: reading checkpoint headers" in t for _, t in seen[:5])
    records = load_results(out)
    assert all(r["set"] == name for r in run.rows) and {r["set"] for r in results_table(run.rows)} == {name}
    etas = [(fr, t) for fr, t in seen if "ETA" in t]
    assert etas and not any("ETA" in t for _, t in seen[:seen.index(etas[0])])
    for fr, t in etas:
        done = int(t.split("/")[0])
        measured = sum(r["seconds"] for r in records[:done])
        left = total - fr * total  # points left, the current one's finished part excluded
        m, sec = re.search(r"ETA (\d+)m(\d\d)s", t).groups()
        assert abs(60 * int(m) + int(sec) - measured / done * left) <= 1, (t, measured, done, left)
