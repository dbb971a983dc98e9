"""Expert formats and pairing: LoRA adapters, experts from another base, header-only refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from layerswap import Checkpoint, Plan, UserError, check_compatible, export_merge
from layerswap.adapters import open_expert
from layerswap.checkpoints import check_pairing
from layerswap.demo import make_tiny_llama
from tests.helpers import assert_matches_plan, read_dir


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, trio):
    """A tiny LoRA adapter on the base, built locally with peft, with non-zero B matrices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    model = AutoModelForCausalLM.from_pretrained(trio["base"])
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    return root / "adapter", merged.state_dict()


def test_lora_adapter_as_language_expert(adapter, trio, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    adir, expected = adapter
    lang = open_expert(adir, trio["base"])
    assert lang.adapter == str(adir)
    on_disk = read_dir(lang.path)
    for k, v in expected.items():
        if k in on_disk:
            assert torch.equal(on_disk[k], v), k  # peft's merge_and_unload, saved as safetensors
    assert not torch.equal(on_disk["model.layers.0.self_attn.q_proj.weight"],
                           read_dir(trio["base"])["model.layers.0.self_attn.q_proj.weight"])
    # through the CLI, the adapter merges into --base and is then an ordinary expert
    plan = Plan(b=1, u=1, tb=1, tu=1)
    r = subprocess.run([sys.executable, "-m", "layerswap.cli", "merge", "--math", str(trio["math"]),
                        "--lang", str(adir), "--base", str(trio["base"]), "--b", "1", "--u", "1", "--tb", "1",
                        "--tu", "1", "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "LAYERSWAP_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert_matches_plan(tmp_path / "out", {"math": trio["math"], "lang": lang.path}, plan)
    # the merged adapter is cached: opening again reuses it
    assert open_expert(adir, trio["base"]).path == lang.path


def test_adapter_without_a_known_base(tmp_path, adapter):
    import json
    import shutil

    adir = tmp_path / "a"
    shutil.copytree(adapter[0], adir)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = None
    (adir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="does not name its base model; pass --base"):
        open_expert(adir)
    with pytest.raises(UserError, match="is a PEFT adapter, not a full model"):
        Checkpoint.open(adir)


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
    assert r.returncode == 1 and "lang-base 1." in r.stdout


def test_mismatch_refused_from_headers_alone(trio, tokenizer, tmp_path, monkeypatch):
    other = make_tiny_llama(tmp_path / "l4", layers=4, seed=1, tokenizer=tokenizer)

    def no_reads(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(Checkpoint, "read", no_reads)
    monkeypatch.setattr(Checkpoint, "get", no_reads)
    with pytest.raises(UserError, match="layer count"):
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(other), Plan(b=1, u=1), tmp_path / "o")


def test_streaming_reads_are_bounded(trio, tmp_path, monkeypatch):
    """Computed tensors are read in slices of at most CHUNK_ELEMS, never memory-mapped whole."""
    import layerswap.merging as merging

    monkeypatch.setattr(merging, "CHUNK_ELEMS", 512)
    sizes = []
    real = Checkpoint.read

    def spy(self, name, start=0, count=None):
        t = real(self, name, start, count)
        sizes.append(t.numel())
        return t

    def no_mmap(*a, **k):
        raise AssertionError("a tensor was memory-mapped whole")

    from layerswap.checkpoints import Pairing

    monkeypatch.setattr(Checkpoint, "read", spy)
    monkeypatch.setattr(Checkpoint, "get", no_mmap)
    monkeypatch.setattr(merging, "check_pairing", lambda *a, **k: Pairing({}, 0.5))  # only the merge's reads
    plan = Plan(b=1, u=1, tb=2, tu=2, transition="ramp")
    export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), plan, tmp_path / "o")
    assert sizes and max(sizes) == 512  # the 64x128 MLP matrices (8192 elements) went in 16 slices
    assert_matches_plan(tmp_path / "o", trio, plan)
