"""Every bad input gives a clear one-line error, exits non-zero, and writes nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerswap import Checkpoint, Plan, UserError, check_compatible, export_merge
from layerswap.demo import make_tiny_llama


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tokenizer, trio) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    d = {
        "layers4": make_tiny_llama(root / "layers4", layers=4, seed=3, tokenizer=tokenizer),
        "wide": make_tiny_llama(root / "wide", layers=6, hidden=128, seed=4, tokenizer=tokenizer),
        "mistral": make_tiny_llama(root / "mistral", layers=6, seed=5, tokenizer=tokenizer, architecture="mistral"),
        "bf16": make_tiny_llama(root / "bf16", layers=6, seed=6, tokenizer=tokenizer, dtype=torch.bfloat16),
    }
    corrupt = root / "corrupt"
    shutil.copytree(trio["lang"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    d["corrupt"] = corrupt
    truncated = root / "truncated"
    shutil.copytree(trio["lang"], truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    d["truncated"] = truncated
    pickle_only = root / "pickle"
    pickle_only.mkdir()
    shutil.copy(trio["lang"] / "config.json", pickle_only / "config.json")
    (pickle_only / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a pickle")
    d["pickle"] = pickle_only
    return d


CASES = {
    "layer count": ("layers4", "layer count: math expert has 6 layers, lang has 4"),
    "shape": ("wide", "shape: "),
    "architecture": ("mistral", "architecture: math expert is LlamaForCausalLM, lang is MistralForCausalLM"),
    "dtype": ("bf16", "dtype: "),
    "corrupt header": ("corrupt", "is not a valid safetensors file (header is not JSON"),
    "truncated": ("truncated", "is not a valid safetensors file"),
    "pickle only": ("pickle", "only has pickle weights (pytorch_model.bin). layerswap refuses pickle checkpoints"),
}


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerswap.cli", *args], capture_output=True, text=True, timeout=120)


def _assert_nothing_written(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(".")], "temporary folder left behind"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_expert_api(case, bad, trio, tmp_path):
    key, msg = CASES[case]
    with pytest.raises(UserError) as e:
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(bad[key]), Plan(b=1, u=1, tb=1, tu=1),
                     tmp_path / "out")
    assert msg in str(e.value)
    _assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("case", ["layer count", "shape", "architecture", "corrupt header", "pickle only"])
def test_bad_expert_cli(case, bad, trio, tmp_path):
    key, msg = CASES[case]
    r = _run_cli("merge", "--math", str(trio["math"]), "--lang", str(bad[key]), "--b", "1", "--u", "1",
                 "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_inspect_lists_every_mismatch(bad, trio):
    rep = check_compatible(Checkpoint.open(trio["math"]), Checkpoint.open(bad["layers4"]), Checkpoint.open(bad["wide"]))
    assert not rep.ok
    whats = {m.what for m in rep.errors}
    assert {"layer count", "tensor names", "shape"} <= whats
    r = _run_cli("inspect", "--math", str(trio["math"]), "--lang", str(bad["layers4"]), "--base", str(bad["wide"]))
    assert r.returncode == 1 and "NOT compatible" in r.stdout and "layer count" in r.stdout


def test_missing_path(trio, tmp_path):
    r = _run_cli("merge", "--math", str(trio["math"]), "--lang", str(tmp_path / "nope"), "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr
    _assert_nothing_written(tmp_path, tmp_path / "o")


def test_not_a_model_dir(trio, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        Checkpoint.open(tmp_path / "empty")


@pytest.mark.parametrize("flags, msg", [
    (["--b", "5", "--u", "2", "--tb", "1", "--tu", "1"], "exceeds the model's 6 layers; reduce them so the sum is at most 6"),
    (["--b", "-1"], "b must be a whole number >= 0"),
    (["--b", "1", "--tb", "1", "--transition-weight", "1.2"], "transition_weight must lie in [0, 1]"),
])
def test_invalid_plan_cli(flags, msg, trio, tmp_path):
    r = _run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), *flags, "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    _assert_nothing_written(tmp_path, tmp_path / "o")


def test_existing_output_is_not_touched(trio, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "-o", str(out))
    assert r.returncode == 2 and "already exists" in r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    r = _run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "-o", str(out), "--overwrite")
    assert r.returncode == 0 and (out / "model.safetensors").exists() and not (out / "keep.txt").exists()


def test_failure_midway_leaves_nothing(trio, tmp_path, monkeypatch):
    import layerswap.merging as merging

    calls = {"n": 0}
    real = merging.linear

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(merging, "linear", flaky)
    with pytest.raises(RuntimeError):
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), Plan(b=1, u=1, tb=2, tu=2),
                     tmp_path / "o")
    _assert_nothing_written(tmp_path, tmp_path / "o")


def test_cuda_requested_without_gpu(trio, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = _run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--device", "cuda",
                 "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr
