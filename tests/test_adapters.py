"""PEFT (LoRA) adapters as experts: merged into their base (given or their own), cached, refused clearly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from layerswap import Checkpoint, Plan, UserError
from layerswap.adapters import open_expert
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
