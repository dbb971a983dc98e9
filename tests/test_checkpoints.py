"""Checkpoints: opening models, headers and compatibility, the shared-base check. Every bad input gives a
clear one-line error, exits non-zero and writes nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerswap import Checkpoint, Plan, UserError, check_compatible, export_merge
from layerswap.models.pairing import check_pairing
from layerswap.shipped.demo import make_tiny_llama
from tests.helpers import assert_nothing_written, run_cli


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


@pytest.mark.parametrize("case", list(CASES))
def test_bad_expert_api(case, bad, trio, tmp_path):
    key, msg = CASES[case]
    with pytest.raises(UserError) as e:
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(bad[key]), Plan(b=1, u=1, tb=1, tu=1),
                     tmp_path / "out")
    assert msg in str(e.value)
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("case", ["layer count", "shape", "architecture", "corrupt header", "pickle only"])
def test_bad_expert_cli(case, bad, trio, tmp_path):
    key, msg = CASES[case]
    r = run_cli("merge", "--math", str(trio["math"]), "--lang", str(bad[key]), "--b", "1", "--u", "1",
                 "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_inspect_lists_every_mismatch(bad, trio):
    rep = check_compatible(Checkpoint.open(trio["math"]), Checkpoint.open(bad["layers4"]), Checkpoint.open(bad["wide"]))
    assert not rep.ok
    whats = {m.what for m in rep.errors}
    assert {"layer count", "tensor names", "shape"} <= whats
    r = run_cli("inspect", "--math", str(trio["math"]), "--lang", str(bad["layers4"]), "--base", str(bad["wide"]))
    assert r.returncode == 1 and "NOT compatible" in r.stdout and "layer count" in r.stdout


def test_missing_path(trio, tmp_path):
    r = run_cli("merge", "--math", str(trio["math"]), "--lang", str(tmp_path / "nope"), "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr
    assert_nothing_written(tmp_path, tmp_path / "o")


def test_not_a_model_dir(trio, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        Checkpoint.open(tmp_path / "empty")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory, tokenizer):
    """Same architecture and shapes as the trio, but a different random 'pretraining'."""
    return make_tiny_llama(tmp_path_factory.mktemp("stranger") / "m", layers=6, seed=99, tokenizer=tokenizer)


def test_expert_from_another_base_is_refused_with_numbers(trio, stranger, tmp_path):
    math, lang, base = Checkpoint.open(trio["math"]), Checkpoint.open(stranger), Checkpoint.open(trio["base"])
    assert check_compatible(math, lang, base).ok  # headers agree
    p = check_pairing(math, lang, base)
    assert p.distances["math-base"] < 0.1 and p.distances["lang-base"] > 1.0
    assert list(p.suspicious) == ["lang-base"]
    with pytest.raises(UserError, match=r"may not share a base: sampled relative distances math-base 0\.0\d+, "
                                        r"lang-base 1\.\d+ exceed the threshold 0\.5"):
        export_merge(math, lang, Plan(b=1, u=1), tmp_path / "o", base=base)
    assert not (tmp_path / "o").exists()
    # without a base, the experts are compared with each other
    assert check_pairing(math, lang).suspicious
    assert not check_pairing(math, Checkpoint.open(trio["lang"])).suspicious


def test_force_runs_it_anyway(trio, stranger, tmp_path):
    args = [sys.executable, "-m", "layerswap.cli", "merge", "--math", str(trio["math"]), "--lang", str(stranger),
            "--base", str(trio["base"]), "--b", "1", "--u", "1", "-o", str(tmp_path / "o")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "pass --force" in r.stderr
    r = subprocess.run(args + ["--force"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "warning (--force)" in r.stdout and (tmp_path / "o" / "model.safetensors").exists()
    r = subprocess.run([sys.executable, "-m", "layerswap.cli", "inspect", "--math", str(trio["math"]),
                        "--lang", str(stranger), "--base", str(trio["base"])], capture_output=True, text=True)
    assert r.returncode == 0 and "lang-base 1." in r.stdout  # compatible, with a warning: not a failure


def test_mismatch_refused_from_headers_alone(trio, tokenizer, tmp_path, monkeypatch):
    other = make_tiny_llama(tmp_path / "l4", layers=4, seed=1, tokenizer=tokenizer)

    def no_reads(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(Checkpoint, "read", no_reads)
    monkeypatch.setattr(Checkpoint, "get", no_reads)
    with pytest.raises(UserError, match="layer count"):
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(other), Plan(b=1, u=1), tmp_path / "o")


def test_revision_of_a_hub_download_is_its_snapshot(trio, tmp_path):
    snap = tmp_path / "models--me--m" / "snapshots" / "0123abcd"
    shutil.copytree(trio["math"], snap)
    ck = Checkpoint.from_folder(snap, "me/m")
    assert ck.revision == "0123abcd"
    assert Checkpoint.open(trio["math"]).revision is None


def test_one_check_says_the_same_everywhere(trio, stranger, bad, tmp_path):
    """Export, the workbench, sweeps and `inspect` make the one check (`pairing.check_mergeable`) and say the same."""
    from layerswap.models.pairing import check_mergeable
    from layerswap.sweeps.records import refusal_reason
    from layerswap.sweeps.spec import ExpertSet
    from layerswap.serving.workbench import Workbench

    base = Checkpoint.open(trio["base"])
    for other in (stranger, bad["layers4"]):
        math, lang = Checkpoint.open(trio["math"]), Checkpoint.open(other)
        problem = check_mergeable(math, lang, base).problem()
        assert problem and not check_mergeable(math, Checkpoint.open(trio["lang"]), base).problem()
        with pytest.raises(UserError) as e:
            export_merge(math, lang, Plan(b=1, u=1), tmp_path / "o", base=base)
        assert str(e.value) == problem
        with pytest.raises(UserError) as e:
            Workbench(engine="transformers").check(str(trio["math"]), str(other), str(trio["base"]))
        assert str(e.value) == problem
        cks = {"math": math, "lang": lang, "base": base}
        assert refusal_reason(ExpertSet("s", "m", "l", "b"), cks) == problem
        r = run_cli("inspect", "--math", str(trio["math"]), "--lang", str(other), "--base", str(trio["base"]))
        assert r.returncode == (0 if other == stranger else 1)  # a shared-base warning is not a failure
        assert ("warning: the experts may not share a base" in r.stdout) == (other == stranger)
    forced = check_mergeable(Checkpoint.open(trio["math"]), Checkpoint.open(stranger), base, force=True)
    assert forced.pairing.suspicious and forced.problem() is None
