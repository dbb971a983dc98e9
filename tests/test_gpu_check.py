"""scripts/gpu_check.py runs on the CPU (`--device cpu`, a tiny model) with the packages a bare CUDA machine
lacks made unimportable, so the GPU check cannot rot between the GPUs it is run on; with ``--vllm`` every pass that
does not need CUDA runs on vLLM's CPU build (CI runs it, `.ci/run`), each isolated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.fixture
def scripts(monkeypatch):
    """gpu_check and gpu_check_vllm importable as the script imports them (scripts/ on sys.path)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_check
    import gpu_check_vllm

    return gpu_check, gpu_check_vllm

BLOCKED = ("gradio", "gradio_client", "plotly", "kaleido", "vllm", "numba", "mergekit", "ray", "peft", "lm_eval")


def test_gpu_check_runs_on_cpu_without_the_app_stack(tmp_path):
    code = ("import runpy, sys\n"
            f"sys.modules.update({{m: None for m in {BLOCKED!r}}})  # `import gradio` etc. raise ImportError\n"
            f"sys.argv = ['gpu_check.py', '--device', 'cpu', '--shape', 'tiny', '--new-tokens', '8', '--workdir', {str(tmp_path)!r}]\n"
            f"runpy.run_path({str(REPO / 'scripts' / 'gpu_check.py')!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout[r.stdout.index("| check | result | detail |"):]
    for row in ("merge on cpu = CPU, byte for byte (layer swap) | identical", "analysis on cpu = CPU within tolerance | within",
                "transformers generation, small merged model", "in-memory merge, tiny shape",
                "transformers generation, tiny-shaped merged model", "imports | none of gradio"):
        assert row in table, row
    assert "FAIL" not in r.stdout


@pytest.mark.slow
def test_gpu_check_vllm_runs_on_the_cpu_build(tmp_path):
    """`gpu_check.py --vllm` with vLLM's CPU build (starts three engines: run with -m slow): the plan read from this
    machine, the planned engines started, their token ids against transformers', refreshes from exported merges."""
    from tests.helpers import vllm_or_skip

    vllm_or_skip()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--shape", "tiny",
                        "--vllm", "--new-tokens", "16", "--workdir", str(tmp_path)], capture_output=True, text=True,
                       timeout=1200, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout[r.stdout.index("| check | result | detail |"):]
    assert "hardware read by layerswap.core.hardware" in table and "engine plan for an 8B trio on this machine" in table
    for serving, arrangement in (("three", "three_vllm"), ("two", "two_vllm"), ("one", "one_vllm_swapped")):
        after = table[table.index(f"vLLM engines started as planned (gpucheck-small, serving {serving}) | "
                                  f"{arrangement} |"):]
        for row in (f"gpucheck-small {serving}: math expert", f"gpucheck-small {serving}: merge 2 after a refresh",
                    f"one question's engine switches (gpucheck-small, {arrangement})"):
            assert row in after, row
    assert "FAIL" not in table


def test_every_pass_that_can_run_on_the_cpu_build_does(scripts):
    """The passes `--vllm --device cpu` runs (CI) are every pass but those that state they need CUDA, and together
    they start every dense arrangement the planner has: a pass skipped on the CPU, or an arrangement without a pass,
    breaks this."""
    from layerswap.engines.planning import VLLM_ENGINES

    _, v = scripts
    on_cpu = v.passes_for("cpu")
    assert on_cpu == [p for p in v.PASSES if not p.needs_cuda] and v.passes_for("cuda") == list(v.PASSES)
    assert {p.arrangement for p in on_cpu} == set(VLLM_ENGINES)  # LoRA adapters included (`_lora_trio`)
    assert not [p for p in v.PASSES if p.needs_cuda]  # sleep mode is checked inside the GPU passes, not apart


def test_a_failed_pass_is_a_row_and_the_next_still_runs(scripts, capsys):
    g, v = scripts
    rep = g.Report()
    ran = []

    def broken():
        raise AttributeError("'TurnEngine' object has no attribute 'llm'")

    v.isolated(rep, "pass two (gpucheck-small)", "cpu", broken)
    v.isolated(rep, "pass one (gpucheck-small)", "cpu", lambda: ran.append(1))
    assert ran == [1] and not rep.ok
    assert rep.rows == [("pass two (gpucheck-small)", "FAILED", "AttributeError: 'TurnEngine' object has no "
                                                                 "attribute 'llm'")]
    assert g.guarded(rep, "analysis", "cpu", lambda: 1 / 0) is None and rep.rows[-1][1] == "FAILED"
    assert "| pass two (gpucheck-small) | FAILED |" in rep.markdown()


def test_ci_runs_the_vllm_passes_on_the_cpu_build_after_the_test_command():
    run = (REPO / ".ci" / "run").read_text()
    assert "scripts/gpu_check.py --vllm --device cpu" in run
    assert run.index("python3 scripts/dev.py test") < run.index("scripts/gpu_check.py --vllm --device cpu")
