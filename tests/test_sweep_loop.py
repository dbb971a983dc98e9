"""Each evaluation decision once (issue 39): sweeps (files and in memory) and the plan search evaluate through one
step (`sweeps.loop.measure`), and run on one Ray runner (`sweeps.ray.Pool`) whose workers get the GPUs their
tensor-parallel engines span."""

from __future__ import annotations

import pytest
import yaml

from layerswap import Plan, Recipe, UserError
from layerswap.engines import EngineSettings
from layerswap.evaluation.run import EvalConfig
from layerswap.search import SearchConfig, search
from layerswap.serving.workbench import Workbench
from layerswap.sweeps import SweepPoint, evaluate_points, load_results, loop, run_sweep
from layerswap.sweeps import ray as sweeps_ray
from tests.helpers import DEMO_MGSM

CPU = EngineSettings(engine="transformers", device="cpu")


def _sweep_file(tmp_path, trio, engine: dict) -> str:
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({
        "experts": {"math": str(trio["math"]), "lang": str(trio["lang"]), "base": str(trio["base"])},
        "recipes": [{"name": "swap", "plan": {"b": 1, "u": 1, "tb": 0, "tu": 0}}],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx"]}], "eval": {"limit": 1, "max_new_tokens": 4},
        "engine": engine}))
    return str(f)


def test_sweeps_and_search_evaluate_through_the_one_loop(tmp_path, trio, monkeypatch):
    seen: list[tuple[str, object, bool]] = []
    real = loop.measure

    def spy(wb, who, config, **kw):
        m = real(wb, who, config, **kw)
        seen.append(("merged" if isinstance(who, Recipe) else who, who, m.record is not None))
        return m

    monkeypatch.setattr(loop, "measure", spy)
    f = _sweep_file(tmp_path, trio, {"engine": "transformers", "device": "cpu"})
    run = run_sweep(f, tmp_path / "r.jsonl")
    assert run.ran == 3 and sorted(s[0] for s in seen) == ["lang", "math", "merged"]
    assert all(written for *_, written in seen)  # each record the results file holds was made by the loop
    assert len(load_results(tmp_path / "r.jsonl")) == 3

    seen.clear()
    wb = Workbench.from_settings(CPU)
    try:
        wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
        res = evaluate_points(wb, [SweepPoint("swap", Recipe(plan=Plan(b=1, u=1, tb=0, tu=0)))],
                              EvalConfig(langs=["xx"], limit=1, max_new_tokens=4, source=str(DEMO_MGSM)))
    finally:
        wb.close()
    assert [s[0] for s in seen] == ["math", "lang", "merged"] and not any(w for *_, w in seen)  # nothing on disk
    assert [r.name for r in res.rows] == ["math expert", "language expert", "swap"]

    seen.clear()
    cfg = SearchConfig(langs=["xx"], source=str(DEMO_MGSM), budget=1, dev=2, test=2, max_new_tokens=4, halving=False)
    found = search(str(trio["math"]), str(trio["lang"]), str(trio["base"]), cfg, results=tmp_path / "s.jsonl",
                   engine=CPU)
    assert found.plan is not None
    assert {s[0] for s in seen} >= {"merged", "math", "lang"}  # the candidate, then the baselines on held-out
    assert all(written for *_, written in seen)
    assert len([r for r in load_results(tmp_path / "s.jsonl") if r["kind"] == "search"]) == len(seen)


def test_the_ray_workers_get_the_gpus_their_engines_span():
    opts = sweeps_ray.actor_options
    assert opts(EngineSettings(tensor_parallel_size=2)) == {"num_cpus": 1.0, "num_gpus": 2}
    assert opts(EngineSettings(tensor_parallel_size=4), cpus=2.0) == {"num_cpus": 2.0, "num_gpus": 4}
    assert opts(EngineSettings()) == {"num_cpus": 1.0, "num_gpus": 0.0}  # one-GPU engines: as asked (--ray-gpus)
    assert opts(EngineSettings(), gpus=1)["num_gpus"] == 1
    with pytest.raises(UserError, match="spans tensor_parallel_size=2 GPUs.*--ray-gpus 2"):
        opts(EngineSettings(tensor_parallel_size=2), gpus=1)
    pytest.importorskip("ray", reason="Ray is not installed: pip install ray")
    import ray

    actor = sweeps_ray.worker_class(EngineSettings(tensor_parallel_size=2))  # the actor class Ray schedules
    assert actor._default_options == {"num_cpus": 1.0, "num_gpus": 2} and not ray.is_initialized()


class _Started(Exception):
    pass


def test_sweeps_and_search_run_on_the_one_ray_runner(tmp_path, trio, monkeypatch):
    """Both hand the one `Pool` their engine settings (whose tensor-parallel size gives each worker its GPUs)."""
    got = []

    def pool(size, settings, **kw):
        got.append((size, settings, kw))
        raise _Started  # stop before a cluster starts

    monkeypatch.setattr(sweeps_ray, "Pool", pool)
    monkeypatch.setattr(sweeps_ray, "need_ray", lambda: None)  # what is tested runs before Ray is needed
    f = _sweep_file(tmp_path, trio, {"engine": "vllm", "tensor_parallel_size": 2})
    with pytest.raises(_Started):
        sweeps_ray.run_sweep_ray(f, tmp_path / "r.jsonl", actors=2)
    cfg = SearchConfig(langs=["xx"], source=str(DEMO_MGSM), budget=2, dev=2, test=2, max_new_tokens=4)
    with pytest.raises(_Started):
        search(str(trio["math"]), str(trio["lang"]), str(trio["base"]), cfg, results=tmp_path / "s.jsonl",
               engine=EngineSettings(engine="transformers", device="cpu", tensor_parallel_size=2), workers=3,
               gpus_per_worker=2.5)
    assert [(n, s.tensor_parallel_size, kw["gpus_per_actor"]) for n, s, kw in got] == [(2, 2, None), (3, 2, 2.5)]
