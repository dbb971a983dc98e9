"""Sweeps on Ray: a two-actor local cluster writes the same records as the sequential runner."""

from __future__ import annotations

import pytest
import yaml

from layerswap.sweeps import load_results, run_sweep, sweep_results
from tests.helpers import DEMO_MGSM


def test_two_actors_give_the_sequential_results(tmp_path, trio):
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray")
    from layerswap.sweeps.ray import run_sweep_ray

    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({
        "experts": {"math": str(trio["math"]), "lang": str(trio["lang"]), "base": str(trio["base"])},
        "grid": {"recipe": {"plan": {"tb": 0, "tu": 0}}, "vary": {"b": [0, 1, 2], "u": [0, 1]}},
        "recipes": [{"name": "soup", "method": "soup"}],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx", "en"]}], "eval": {"limit": 2, "max_new_tokens": 6},
        "engine": {"engine": "transformers", "device": "cpu"}, "stats": True}))
    run_sweep(f, tmp_path / "seq.jsonl")
    par = run_sweep_ray(f, tmp_path / "ray.jsonl", actors=2, threads=1)
    assert par.ran == 1 + 2 + 7 and not par.cancelled

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    seq_rows, ray_rows = sweep_results(f, tmp_path / "seq.jsonl"), sweep_results(f, tmp_path / "ray.jsonl")
    assert len(ray_rows) == len(load_results(tmp_path / "ray.jsonl")) == 10
    assert strip(ray_rows) == strip(seq_rows)
    again = run_sweep_ray(f, tmp_path / "ray.jsonl", actors=2, threads=1)  # resumes like the sequential runner
    assert again.ran == 0


def test_actors_get_the_gpus_their_tensor_parallel_engines_span(tmp_path, trio):
    """A sweep whose engine spans 2 GPUs refuses actors with fewer, before any Ray cluster starts."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray")
    from layerswap import UserError
    from layerswap.sweeps.ray import run_sweep_ray

    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({
        "experts": {"math": str(trio["math"]), "lang": str(trio["lang"])}, "recipes": [{"name": "soup", "method": "soup"}],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx"]}], "engine": {"engine": "vllm", "tensor_parallel_size": 2}}))
    with pytest.raises(UserError, match="spans tensor_parallel_size=2 GPUs.*--ray-gpus 2"):
        run_sweep_ray(f, tmp_path / "r.jsonl", actors=2, gpus_per_actor=1)
    assert not (tmp_path / "r.jsonl").exists()


def test_a_ray_worker_switches_a_familys_languages_in(tmp_path):
    """A worker handed the next member of the family it holds switches the language expert in (the math expert's
    checkpoint stays), as the sequential runner does; another family, or a pair, loads afresh. On Ray, a family
    sweep gives the sequential runner's records."""
    from layerswap.engines import EngineSettings
    from layerswap.sweeps.ray import Worker

    def held(wb):
        return id(wb), id(wb.checkpoints["math"]), wb.checkpoints["lang"].path.name

    w = Worker(EngineSettings(engine="transformers", device="cpu"))
    qa, qb = ("assets:demo3/math", "assets:demo3/lang_qa", "assets:demo3/base", False, "fam"), \
        ("assets:demo3/math", "assets:demo3/lang_qb", "assets:demo3/base", False, "fam")
    first, second = w.run(qa, held), w.run(qb, held)
    assert first[:2] == second[:2] and (first[2], second[2]) == ("lang_qa", "lang_qb")
    assert (w.loads, w.switches) == (1, 1)
    assert w.run(qb, held) == second and (w.loads, w.switches) == (1, 1)  # the same member: nothing reloads
    other = w.run(qa[:4] + ("other",), held)
    assert other[1] != second[1] and (w.loads, w.switches) == (2, 1)
    w.run(qa[:4] + (None,), held)  # a pair: loaded, never switched
    assert (w.loads, w.switches) == (3, 1)
    w.wb.close()

    pytest.importorskip("ray", reason="Ray is not installed: pip install ray")
    from layerswap.sweeps.ray import run_sweep_ray

    f = tmp_path / "fam.yaml"
    f.write_text(yaml.safe_dump({
        "family": {"math": "assets:demo3/math", "base": "assets:demo3/base",
                   "langs": {"qa": "assets:demo3/lang_qa", "qb": "assets:demo3/lang_qb"}},
        "recipes": [{"name": "soup", "method": "soup"}], "test_sets": [{"path": "assets:demo3/mgsm"}],
        "eval": {"limit": 2, "max_new_tokens": 8}, "engine": {"engine": "transformers", "device": "cpu"}}))
    run_sweep(f, tmp_path / "seq.jsonl")
    par = run_sweep_ray(f, tmp_path / "ray.jsonl", actors=1, threads=1)
    assert par.ran == 2 * 3

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert strip(sweep_results(f, tmp_path / "ray.jsonl")) == strip(sweep_results(f, tmp_path / "seq.jsonl"))
