"""scripts/gpu_check.py runs on the CPU (`--device cpu`, a tiny model) with the packages a bare CUDA machine
lacks made unimportable, so the GPU check cannot rot between the GPUs it is run on."""

from __future__ import annotations

import subprocess
import sys

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
