"""Builders and checks shared by the test modules (fixtures live in conftest.py and use these)."""

from __future__ import annotations

import json
import os
import threading
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from layerswap.shipped.demo import make_tiny_llama, perturb
from layerswap.recipe.plans import Plan

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "scripts"))  # bench_common: checkpoints and adapters for tests, checks and benchmarks
import bench_common  # noqa: E402

make_adapter = bench_common.make_adapter  # the tests' adapters are gpu_check's LoRA pass's
DEMO = REPO / "assets" / "demo"
DEMO_MGSM = DEMO / "mgsm"  # an MGSM-format folder shipped with the project (English and Kovani)
CHROMIUM_FIX = "sudo apt-get install chromium (python3 scripts/dev.py test installs it itself when run as root)"


# ---- models ---------------------------------------------------------------------------------------

def make_trio(root: Path, tokenizer, *, layers: int = 6, dtype=torch.float32, **kw) -> dict[str, Path]:
    """base / math / lang: a random tiny Llama and two light perturbations of it."""
    base = make_tiny_llama(root / "base", layers=layers, seed=0, dtype=dtype, tokenizer=tokenizer, **kw)
    return {
        "base": base,
        "math": perturb(base, root / "math", scale=0.05, seed=1),
        "lang": perturb(base, root / "lang", scale=0.05, seed=2),
    }


def read_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder, read with the safetensors library (independently of layerswap)."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


# ---- the plan semantics, restated independently of layerswap.recipe.plans ---------------------------------

def expected_layer_weights(plan: Plan, L: int) -> list[float]:
    out = []
    for i in range(L):
        if i < plan.b or i >= L - plan.u:
            out.append(1.0)
        elif i < plan.b + plan.tb:
            k = i - plan.b + 1
            out.append(1 - k / (plan.tb + 1) if plan.transition == "ramp" else plan.transition_weight)
        elif i >= L - plan.u - plan.tu:
            k = i - (L - plan.u - plan.tu) + 1
            out.append(k / (plan.tu + 1) if plan.transition == "ramp" else plan.transition_weight)
        else:
            out.append(0.0)
    return out


def expected_weight(name: str, plan: Plan, L: int) -> float:
    lw = expected_layer_weights(plan, L)
    parts = name.split(".")
    if "layers" in parts:
        return lw[int(parts[parts.index("layers") + 1])]
    fixed = {"math": 0.0, "lang": 1.0, "avg": 0.5}
    if plan.non_layer in fixed:
        return fixed[plan.non_layer]
    return lw[0] if "embed_tokens" in name else lw[-1]


def expected_tensor(m: torch.Tensor, l: torch.Tensor, w: float) -> torch.Tensor:
    """(1-w)*math + w*lang in float32, evaluated as mergekit's linear kernel does:
    zeros, then a fused multiply-add of math*(1-w), then of lang*w; cast to the checkpoint dtype."""
    if w == 0.0:
        return m
    if w == 1.0:
        return l
    acc = torch.zeros(m.shape, dtype=torch.float32)
    acc.addcmul_(m, torch.tensor([1.0 - w], dtype=torch.float32))
    acc.addcmul_(l, torch.tensor([w], dtype=torch.float32))
    return acc.to(m.dtype)


def assert_matches_plan(out_dir: Path, trio: dict[str, Path], plan: Plan) -> None:
    """Every merged tensor equals what the plan says, exactly; copies are byte-for-byte copies."""
    m, l = read_dir(trio["math"]), read_dir(trio["lang"])
    got = read_dir(out_dir)
    L = json.loads((trio["math"] / "config.json").read_text())["num_hidden_layers"]
    assert set(got) == set(m)
    seen = set()
    for name in m:
        w = expected_weight(name, plan, L)
        seen.add(w)
        exp = expected_tensor(m[name], l[name], w)
        assert got[name].dtype == m[name].dtype, name
        assert torch.equal(got[name], exp), f"{name}: w={w}"
        if w in (0.0, 1.0):
            src = m[name] if w == 0.0 else l[name]
            assert got[name].view(torch.uint8).flatten().tolist() == src.view(torch.uint8).flatten().tolist()
    assert seen


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`layerswap ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "layerswap.cli", *args], capture_output=True, text=True, timeout=120)


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`layerswap ARGS` through the CLI's `main` in this process (no interpreter start-up): its exit code and
    what it printed, as `run_cli` returns them. An unexpected exception propagates (fails the test)."""
    import contextlib
    import io

    from layerswap.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(["layerswap", *args], rc, out.getvalue(), err.getvalue())


def assert_nothing_written(parent: Path, out: Path) -> None:
    """No output folder, and no temporary folder left beside it."""
    assert not out.exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(".")], "temporary folder left behind"


# ---- data -------------------------------------------------------------------------------------------

def find_mgsm_dir() -> Path | None:
    """The real MGSM TSVs: $LAYERSWAP_MGSM_DIR, else ../shared/data/mgsm (never committed here)."""
    env = os.environ.get("LAYERSWAP_MGSM_DIR")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "data" / "mgsm", REPO.parent.parent / "shared" / "data" / "mgsm"]
    for c in candidates:
        if (c / "mgsm_en.tsv").exists():
            return c
    return None


# ---- things the machine may lack -------------------------------------------------------------------

def chromium_path() -> str | None:
    return os.environ.get("LAYERSWAP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_or_skip() -> str:
    """Chromium's path; skip (with the fix) when there is none, or fail under LAYERSWAP_REQUIRE_BROWSER=1 (CI)."""
    exe = chromium_path()
    if exe is None:
        if os.environ.get("LAYERSWAP_REQUIRE_BROWSER") == "1":
            pytest.fail(f"LAYERSWAP_REQUIRE_BROWSER=1 but no Chromium found; install it: {CHROMIUM_FIX}")
        pytest.skip(f"needs Chromium, which this machine lacks; install it: {CHROMIUM_FIX}")
    return exe


def vllm_or_skip() -> None:
    """Skip when vLLM cannot be installed here; with LAYERSWAP_REQUIRE_VLLM=1 (CI) fail instead."""
    from layerswap.engines import vllm_status

    ok, why = vllm_status()
    if not ok:
        if os.environ.get("LAYERSWAP_REQUIRE_VLLM") == "1":
            pytest.fail(f"LAYERSWAP_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)


# ---- the app as a user starts it ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def family_sets(d: Path) -> Path:
    """An MGSM folder for a family on the demo: Kovani (xx) and English from the demo's set, and the demo's English
    questions as a Swahili set (sw), in `d`."""
    d.mkdir(parents=True, exist_ok=True)
    for name in ("mgsm_xx.tsv", "mgsm_en.tsv", "languages.json"):
        shutil.copy(DEMO_MGSM / name, d / name)
    shutil.copy(DEMO_MGSM / "mgsm_en.tsv", d / "mgsm_sw.tsv")
    return d


APPS: dict[str, subprocess.Popen] = {}  # URL -> the running app's process (its memory, its files)


def launch_app(workdir: Path, *, mgsm_dir: Path | None, extra: list[str] = (), timeout: float = 240,
               env_extra: dict[str, str] | None = None):
    """`python app.py` exactly as a user starts it (no model flags: the default demo), on a free port.

    A generator for fixtures: yields the URL (its process in `APPS`), stops the app afterwards. Its home is
    `workdir/home`: what the page writes by default (Export's `~/layerswap-exports/…`) stays in the test's folder.
    """
    port = free_port()
    (workdir / "home").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LAYERSWAP_CACHE=str(workdir / "cache"), OMP_NUM_THREADS="1", HOME=str(workdir / "home"),
               GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    env.pop("LAYERSWAP_MGSM_DIR", None)
    if mgsm_dir is not None:
        env["LAYERSWAP_MGSM_DIR"] = str(mgsm_dir)
    env.update(env_extra or {})
    log = workdir / "app.log"
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), "--device", "cpu", *extra],
                            cwd=workdir, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
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
        pytest.fail(f"app.py did not start within {timeout:.0f} s:\n{log.read_text()[-3000:]}")
    APPS[url] = proc
    try:
        yield url
    finally:  # also when the generator is closed early (a test's own `app.close()`)
        APPS.pop(url, None)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def shown(x):
    """The value of an output the app sent as an update (``gr.update(value=..., visible=True)``)."""
    if isinstance(x, dict) and x.get("__type__") == "update":
        assert x.get("visible", True), "the output was hidden"
        return x.get("value")
    return x


class JsonHandler(BaseHTTPRequestHandler):
    """A fake HTTP API for tests (e.g. the Hub's metadata): subclasses answer in ``do_GET`` with `reply`."""

    def reply(self, obj: dict, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve `handler` on a loopback port for as long as the generator lives (a fixture's body): yields its URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


LLAMA_8B = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, positions=131072)


def sparse_llama(folder: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
                 positions: int = 4096) -> Path:
    """A bf16 Llama checkpoint of any size whose weights are a hole in a sparse file: real headers and config (what
    planning reads), no disk used; its tensors read as zeros."""
    folder.mkdir(parents=True, exist_ok=True)
    kv = hidden // heads * kv_heads
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden], "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [kv, hidden],
                       p + "self_attn.v_proj.weight": [kv, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                       p + "mlp.gate_proj.weight": [intermediate, hidden], p + "mlp.up_proj.weight": [intermediate, hidden],
                       p + "mlp.down_proj.weight": [hidden, intermediate], p + "input_layernorm.weight": [hidden],
                       p + "post_attention_layernorm.weight": [hidden]})
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": positions,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return folder
