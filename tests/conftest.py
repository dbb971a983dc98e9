"""Shared fixtures: tiny Llama checkpoints built offline, and the real MGSM data folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from layerswap.demo import build_tokenizer, make_tiny_llama, perturb

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
torch.set_num_threads(1)  # tiny models: threads only add overhead
# Default paths (app, `ask`) answer with transformers in tests; the vLLM tests ask for vLLM explicitly
# and share one engine for the whole session (tests/test_vllm.py).
os.environ.setdefault("LAYERSWAP_ENGINE", "transformers")


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def make_trio(root: Path, tokenizer, *, layers: int = 6, dtype=torch.float32, **kw) -> dict[str, Path]:
    base = make_tiny_llama(root / "base", layers=layers, seed=0, dtype=dtype, tokenizer=tokenizer, **kw)
    return {
        "base": base,
        "math": perturb(base, root / "math", scale=0.05, seed=1),
        "lang": perturb(base, root / "lang", scale=0.05, seed=2),
    }


@pytest.fixture(scope="session")
def trio(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """base / math / lang, 6 layers, float32."""
    return make_trio(tmp_path_factory.mktemp("trio"), tokenizer)


@pytest.fixture(scope="session")
def trio_bf16(tmp_path_factory, tokenizer) -> dict[str, Path]:
    return make_trio(tmp_path_factory.mktemp("trio_bf16"), tokenizer, dtype=torch.bfloat16)


def find_mgsm_dir() -> Path | None:
    env = os.environ.get("LAYERSWAP_MGSM_DIR")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "data" / "mgsm", REPO.parent.parent / "shared" / "data" / "mgsm"]
    for c in candidates:
        if (c / "mgsm_en.tsv").exists():
            return c
    return None


@pytest.fixture(scope="session")
def mgsm_dir() -> Path:
    """The real MGSM TSVs (not committed: see ../shared/data/mgsm/SOURCE.md). Set LAYERSWAP_MGSM_DIR."""
    d = find_mgsm_dir()
    if d is None:
        if os.environ.get("LAYERSWAP_REQUIRE_DATA") == "1":
            pytest.fail("LAYERSWAP_REQUIRE_DATA=1 but no MGSM folder: set LAYERSWAP_MGSM_DIR")
        pytest.skip("no MGSM data folder: set LAYERSWAP_MGSM_DIR to the folder of mgsm_XX.tsv files")
    return d


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_app(tmp_path_factory, *, mgsm: bool):
    """`python app.py` exactly as a user starts it (no model flags: the default demo), on a free port."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port()
    env = dict(os.environ, LAYERSWAP_CACHE=str(tmp_path_factory.mktemp("cache")), OMP_NUM_THREADS="1",
               GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    env.pop("LAYERSWAP_MGSM_DIR", None)
    data = find_mgsm_dir() if mgsm else None
    if data is not None:
        env["LAYERSWAP_MGSM_DIR"] = str(data)
    log = tmp_path_factory.mktemp("applog") / "app.log"
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), "--device", "cpu"],
                            cwd=tmp_path_factory.mktemp("appcwd"), env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail(f"app.py did not start within 240 s:\n{log.read_text()[-3000:]}")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def app_url(tmp_path_factory):
    """The app on its default models, pointed at the real MGSM folder when there is one."""
    yield from _launch_app(tmp_path_factory, mgsm=True)


@pytest.fixture(scope="session")
def app_url_plain(tmp_path_factory):
    """The app with no MGSM folder configured: the demo organism's own test sets are its default."""
    yield from _launch_app(tmp_path_factory, mgsm=False)


# ---- vLLM ---------------------------------------------------------------------------------------

def vllm_or_skip() -> None:
    """Skip when vLLM cannot be installed here; with LAYERSWAP_REQUIRE_VLLM=1 (CI) fail instead."""
    from layerswap.engines import vllm_status

    ok, why = vllm_status()
    if not ok:
        if os.environ.get("LAYERSWAP_REQUIRE_VLLM") == "1":
            pytest.fail(f"LAYERSWAP_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)


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
