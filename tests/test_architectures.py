"""The architecture table: each supported family opens, maps every tensor to a typed, grouped cell, and merges
attention-only / MLP-only plans by the table's groups (one entry plus this test per architecture)."""

from __future__ import annotations

import pytest
import torch

from layerswap import Checkpoint, Plan, check_compatible, export_merge
from layerswap.models.architectures import ARCHITECTURES, FALLBACK, architecture
from layerswap.shipped.demo import make_tiny_llama, perturb
from tests.helpers import read_dir

# where each family keeps its norms (read off the transformers modeling code)
NORM_GROUPS = {
    "gemma2": {"post_attention_layernorm": "attention"},
    "gemma3_text": {"post_attention_layernorm": "attention"},
    "olmo2": {"post_attention_layernorm": "attention"},
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def pair(request, tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_llama(root / "base", layers=3, tokenizer=tokenizer, architecture=request.param)
    return request.param, perturb(base, root / "math", seed=1), perturb(base, root / "lang", seed=2)


def test_every_tensor_is_typed_and_grouped(pair):
    model_type, math, lang = pair
    ck = Checkpoint.open(math)
    assert ck.model_type == model_type and ck.arch is ARCHITECTURES[model_type]
    assert not [m for m in check_compatible(ck, Checkpoint.open(lang)).mismatches if "architecture" in m.what]
    for t in ck.tensors.values():
        if t.layer is None:
            assert t.ptype in ("embed", "final_norm", "lm_head"), t.name
            continue
        base = t.ptype.split(".")[0]
        assert base in ck.arch.order, f"{t.name}: {t.ptype} is not in the {model_type} entry"
        group = ck.arch.group(t.ptype)
        if ".self_attn." in t.name:
            assert group == "attention", t.name
        elif ".mlp." in t.name:
            assert group == "mlp", t.name
        else:  # a per-layer norm
            assert group == NORM_GROUPS.get(model_type, {}).get(base, "attention" if base == "input_layernorm" else "mlp")
        assert ck.arch.label(t.ptype)


@pytest.mark.parametrize("modules", ["attention", "mlp"])
def test_module_plans_follow_the_table(pair, tmp_path, modules):
    _, math, lang = pair
    m, lg = Checkpoint.open(math), Checkpoint.open(lang)
    plan = Plan(b=1, u=1, tb=0, tu=0, modules=modules, non_layer="math")
    export_merge(m, lg, plan, tmp_path / "o", device="cpu")
    got, want_m, want_l = read_dir(tmp_path / "o"), read_dir(math), read_dir(lang)
    for name, t in m.tensors.items():
        from_lang = t.layer in (0, 2) and m.arch.group(t.ptype) == modules
        assert torch.equal(got[name], (want_l if from_lang else want_m)[name]), name


def test_unknown_families_use_the_llama_layout_and_say_so():
    assert architecture("some_new_model") is FALLBACK and not FALLBACK.tested
    assert FALLBACK.group("q_proj") == "attention" and FALLBACK.group("down_proj.bias") == "mlp"
    assert [architecture("llama").label(p) for p in architecture("llama").order] == [
        "q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm"]
