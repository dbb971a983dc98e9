"""scripts/gpu_check.py runs on the CPU (`--device cpu`, a tiny model) with the packages a bare CUDA machine
lacks made unimportable, so the GPU check cannot rot between the GPUs it is run on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

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
    for row in ("hardware read by layerswap.hardware", "engine plan for an 8B trio on this machine",
                "vLLM engines started as planned (gpucheck-small) | three_vllm",
                "vLLM = transformers, gpucheck-small merge 2 after a refresh"):
        assert row in r.stdout, row
