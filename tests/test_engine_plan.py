"""Engines are optional: loading reads headers only, the engine plan says with numbers what answering needs
(memory, and scratch disk for vLLM), and everything but answers works when it does not fit. Scratch folders
are removed on exit or, after a crash, at the next start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from layerswap.core import scratch
from layerswap.engines import planning
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.ui.session import Shared
from layerswap.serving.workbench import Workbench


@pytest.fixture(autouse=True)
def no_idle_engines(monkeypatch):
    """Idle vLLM engines an earlier test module left in this process's pool would count as released memory."""
    from layerswap.engines import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "_pool", [])


def _refs(trio) -> tuple[str, str, str]:
    return str(trio["base"]), str(trio["math"]), str(trio["lang"])


def test_small_experts_plan_fits_and_is_quick(trio):
    wb = Workbench(engine="transformers")
    wb.check(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    plan = wb.engine_plan
    assert plan.fits and plan.quick and plan.arrangement == "transformers" and not wb.answering  # checked, nothing loaded
    assert plan.need_memory == wb.checkpoints["math"].nbytes + wb.checkpoints["lang"].nbytes + planning.APP_HEADROOM["cpu"]
    assert "transformers, both experts in memory" in plan.describe()


def test_no_memory_answers_off_with_numbers_everything_else_works(trio, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSWAP_AVAILABLE_MEMORY", "1000")
    shared = Shared(lambda: Workbench(engine="transformers"))
    try:
        wb = shared.workbench(_refs(trio))
        plan = wb.engine_plan
        assert not plan.fits and not wb.answering
        text = plan.describe()
        assert "Answers are off" in text and "0.0 GiB available" in text and "What would serve them" in text
        assert "heatmaps, Export, mergekit YAML" in text
        wb.analysis()  # the analysis, the merged statistics and the export stream from the files
        wb.merged_stats(Plan(b=1, u=1, tb=0, tu=0))
        s = wb.export(tmp_path / "out", recipe=Recipe(plan=Plan(b=1, u=1, tb=0, tu=0)))
        assert s.n_tensors > 0
        with pytest.raises(UserError, match="Answers are off"):
            shared.engines(_refs(trio))
        with pytest.raises(UserError, match="Answers are off"):
            shared.engines(_refs(trio), slow_ok=True)  # Start engines cannot make them fit either
    finally:
        shared.close()


def test_slow_engines_wait_for_start_engines(trio, monkeypatch):
    """On the CPU, engines whose question takes minutes start only when asked (Start engines), never by Ask."""
    monkeypatch.setattr(planning, "CPU_DECODE_BYTES_PER_S", 1.0)  # plays a huge model: hours per question
    shared = Shared(lambda: Workbench(engine="transformers"))
    try:
        wb = shared.workbench(_refs(trio))
        assert wb.engine_plan.fits and not wb.engine_plan.quick and not wb.answering
        assert "They start when you press Start engines" in wb.engine_plan.describe()
        with pytest.raises(UserError, match="Start engines"):
            shared.engines(_refs(trio))
        assert shared.engines(_refs(trio), slow_ok=True) is wb and wb.answering
        shared.ensure_built(wb, Recipe(plan=Plan(b=1, u=0, tb=0, tu=0)))
        assert "merged" in wb.engines
    finally:
        shared.close()


def test_quick_engines_start_behind_the_page(trio):
    shared = Shared(lambda: Workbench(engine="transformers"))
    try:
        built = []
        wb = shared.workbench(_refs(trio), after=lambda w: built.append(w.answering))
        assert shared.engines(_refs(trio)) is wb and wb.answering and built == [True]
        assert "transformers" in shared.engine_status(wb)
    finally:
        shared.close()


def test_vllm_plan_checks_the_scratch_disk(trio, monkeypatch):
    from layerswap.models.checkpoints import Checkpoint

    monkeypatch.setattr(planning, "vllm_status", lambda: (True, "installed"))
    monkeypatch.setattr(planning, "vllm_device", lambda: "cpu")
    monkeypatch.setenv("LAYERSWAP_AVAILABLE_DISK", "10")
    cks = {r: Checkpoint.open(trio[r]) for r in ("math", "lang")}
    plan = planning.plan_engines(cks, engine="vllm", serving="auto", settings=planning.VLLMSettings(), device="cpu")
    assert plan.fits and plan.refresh == "memory" and plan.scratch_bytes == 0  # CPU engines: no scratch merge
    monkeypatch.setattr(planning, "refresh_mode", lambda arrangement, device: ("disk", "played"))
    plan = planning.plan_engines(cks, engine="vllm", serving="auto", settings=planning.VLLMSettings(), device="cpu")
    assert not plan.fits and "loads the merged model from disk" in plan.problem and "0.0 GB free" in plan.problem
    auto = planning.plan_engines(cks, engine="auto", serving="auto", settings=planning.VLLMSettings(), device="cpu")
    assert auto.fits and auto.engine == "transformers"  # auto falls back to what fits


def test_export_refuses_a_full_disk_before_writing(trio, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSWAP_AVAILABLE_DISK", "1000")
    wb = Workbench(engine="transformers")
    wb.check(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    with pytest.raises(UserError, match=r"needs \d+\.\d GB of disk, more than the 0\.0 GB free"):
        wb.export(tmp_path / "out", recipe=Recipe(plan=Plan(b=1, u=0, tb=0, tu=0)))
    assert not list(tmp_path.iterdir())


def test_scratch_of_a_dead_process_is_removed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSWAP_SCRATCH", str(tmp_path))
    mine = scratch.make("serving")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "layerswap-serving-old"
    stale.mkdir()
    (stale / "OWNER").write_text(dead.stdout.strip())
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    other = tmp_path / "layerswap-notours"
    other.mkdir()
    assert scratch.clean_stale() == [stale]
    assert mine.exists() and other.exists() and (mine / "OWNER").read_text() == str(os.getpid())


def test_sigterm_removes_the_scratch_even_while_a_job_holds_the_lane(tmp_path):
    """The app's exit path (`launch.run`: SIGTERM -> SystemExit -> `Shared.close`): visitor folders and scratch
    merges go, and the process ends, even while another thread's job holds the models."""
    code = (
        "import os, signal, sys, threading, time\n"
        "os.environ['LAYERSWAP_SCRATCH'] = sys.argv[1]\n"
        "from layerswap.ui.session import Shared\n"
        "from layerswap.serving.workbench import Workbench\n"
        "s = Shared(lambda: Workbench(engine='transformers'))\n"
        "(s.root / 'export').write_text('x')\n"
        "threading.Thread(target=lambda: (s.lock.acquire(), time.sleep(600)), daemon=True).start()\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "try:\n    print(s.root, flush=True)\n    time.sleep(600)\nfinally:\n    s.close()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    root = p.stdout.readline().strip()
    p.terminate()
    assert p.wait(timeout=60) == 0
    assert root and not os.path.exists(root) and not list(tmp_path.iterdir())


def test_every_planned_arrangement_is_registered():
    from layerswap.serving.answering import ARRANGEMENTS

    assert set(ARRANGEMENTS) | {"none"} == set(planning.ARRANGEMENTS)
    for name, n in planning.VLLM_ENGINES.items():
        assert len(ARRANGEMENTS[name].roles) == n and {r for roles in ARRANGEMENTS[name].roles for r in roles} == \
            {"math", "lang", "merged"}


def test_switching_trios_plans_with_the_old_engines_released(trio, tmp_path, tokenizer, monkeypatch):
    """The second trio's plan counts the first trio's running engines as freed (memory set so that it fits only
    then), and they are released before the second trio's engines start."""
    from layerswap.core.hardware import HELD
    from tests.helpers import make_trio

    shared = Shared(lambda: Workbench(engine="transformers"))
    try:
        first = shared.workbench(_refs(trio))
        shared.engines(_refs(trio))
        held = first.answering_engines.held_bytes()
        old = first.answering_engines.current
        assert held == first.checkpoints["math"].nbytes + first.checkpoints["lang"].nbytes
        other = make_trio(tmp_path / "other", tokenizer)
        need = Workbench(engine="transformers")
        need.check(str(other["math"]), str(other["lang"]), str(other["base"]))
        monkeypatch.setenv("LAYERSWAP_AVAILABLE_MEMORY", str(need.engine_plan.need_memory - held // 2))
        need.check(str(other["math"]), str(other["lang"]), str(other["base"]))
        assert not need.engine_plan.fits  # planned blind to the first trio's engines: answers would be off
        second = shared.workbench(_refs(other))
        plan = second.engine_plan
        assert plan.fits and plan.releases == 1 and plan.released_bytes == held
        assert HELD.of(old) == 0 and shared.loaded(_refs(trio)) is None  # released before the new ones start
        assert shared.engines(_refs(other)) is second and second.answering
    finally:
        shared.close()


def test_an_arrangement_that_fails_half_way_closes_the_engines_it_started(vllm_trio, tmp_path, monkeypatch):
    """A real three-engine arrangement on vLLM's CPU build whose second engine cannot start (the language expert's
    weights file is broken after its headers were read): the math expert's engine, already running, is closed with
    it, so nothing idles in the pool holding memory when the fallback is planned."""
    import dataclasses
    import shutil

    from layerswap.models.checkpoints import Checkpoint
    from layerswap.engines import VLLMEngine
    from layerswap.serving.answering import Answering, Trio, releasing
    from layerswap.engines.vllm_engine import EngineStartError
    from layerswap.core.hardware import HELD
    from layerswap.serving.workbench import MERGES
    from tests.helpers import vllm_or_skip

    vllm_or_skip()
    bad = shutil.copytree(vllm_trio["lang"], tmp_path / "lang")
    cks = {"math": Checkpoint.open(vllm_trio["math"]), "lang": Checkpoint.open(bad)}
    plan = planning.plan_engines(cks, engine="vllm", serving="three")
    assert plan.arrangement == "three_vllm" and plan.fits
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    held = HELD.total()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # vLLM's default: an engine's start fixes it
    answering = Answering(dataclasses.replace(plan, transformers_first=False), Trio(cks, merges=MERGES), fallback=False)
    with pytest.raises(EngineStartError, match="vLLM could not start on lang"):
        answering.start()
    assert VLLMEngine.pooled() == [] and HELD.total() == held  # the math expert's engine went with it
    assert releasing([]).engines == 0 and answering.current is None
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
