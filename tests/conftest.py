"""Shared fixtures: tiny Llama checkpoints built offline, data folders, the launched app (see helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from layerswap.shipped.demo import build_tokenizer, make_tiny_llama, perturb
from tests.helpers import find_mgsm_dir, launch_app, make_trio

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
torch.set_num_threads(1)  # tiny models: threads only add overhead
# Default paths (app, `ask`) answer with transformers in tests; the vLLM tests ask for vLLM explicitly
# and share one engine for the whole session (tests/test_vllm.py).
os.environ.setdefault("LAYERSWAP_ENGINE", "transformers")


@pytest.fixture(params=["compiled", "torch"])
def analysis_kernel(request, monkeypatch) -> str:
    """Runs a test with each CPU analysis kernel (layerswap.analysis.compiled.use_compiled)."""
    if request.param == "compiled":
        pytest.importorskip("numba")
    monkeypatch.setenv("LAYERSWAP_ANALYSIS_KERNEL", request.param)
    return request.param


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def trio(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """base / math / lang, 6 layers, float32."""
    return make_trio(tmp_path_factory.mktemp("trio"), tokenizer)


@pytest.fixture(scope="session")
def trio_bf16(tmp_path_factory, tokenizer) -> dict[str, Path]:
    return make_trio(tmp_path_factory.mktemp("trio_bf16"), tokenizer, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def mgsm_dir() -> Path:
    """The real MGSM TSVs (not committed: see ../shared/data/mgsm/SOURCE.md), for lm-eval fidelity tests.

    Tests that only need *some* MGSM-format folder use `tests.helpers.DEMO_MGSM` instead.
    """
    d = find_mgsm_dir()
    if d is None:
        if os.environ.get("LAYERSWAP_REQUIRE_DATA") == "1":
            pytest.fail("LAYERSWAP_REQUIRE_DATA=1 but no MGSM folder: set LAYERSWAP_MGSM_DIR")
        pytest.skip("no MGSM data folder: set LAYERSWAP_MGSM_DIR to the folder of mgsm_XX.tsv files")
    return d


@pytest.fixture(scope="session")
def app_url(tmp_path_factory):
    """`python app.py` as a newcomer starts it: the demo organism and its own test sets (English, Kovani)."""
    yield from launch_app(tmp_path_factory.mktemp("app"), mgsm_dir=None)


@pytest.fixture(scope="session")
def vllm_trio(tmp_path_factory) -> dict[str, Path]:
    """base / math / lang that vLLM's CPU backend can serve: head_dim 64 (hidden 256, 4 heads), 4 layers,
    float32 (so vLLM and transformers agree token for token), experts far enough apart to answer differently."""
    root = tmp_path_factory.mktemp("vllm_trio")
    tok = build_tokenizer(vocab_size=768)
    base = make_tiny_llama(root / "base", layers=4, hidden=256, heads=4, intermediate=512, seed=0, tokenizer=tok)
    return {
        "base": base,
        "math": perturb(base, root / "math", scale=0.3, seed=1),
        "lang": perturb(base, root / "lang", scale=0.3, seed=2),
    }


@pytest.fixture()
def no_engines(monkeypatch):
    """Any engine start fails the test: the refusals come before."""
    from layerswap.serving import workbench

    def boom(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(workbench.Workbench, "load", boom)
    monkeypatch.setattr(workbench.Workbench, "start", boom)
