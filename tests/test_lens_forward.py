"""The lens's forward passes: streamed block by block from the files equals the in-memory forward, and both equal a
plain transformers forward (``output_hidden_states=True``, the model's own norm and head), for every architecture.

Tolerances (float32 tiny models): streamed vs in memory, 1e-6 absolute on every hidden state and 1e-5 on logits
(the same kernels run; in practice they agree exactly); lens vs plain transformers, 1e-5 on states and logits
(the batch is right-padded and logits come from a different matmul shape).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerswap import Checkpoint, Plan, Recipe
from layerswap.models.architectures import ARCHITECTURES
from layerswap.shipped.demo import make_tiny_llama, perturb
from layerswap.engines import load_model
from layerswap.analysis.lens import MergedSource, Stack, WeightSource
from layerswap.analysis.lens.run import merged_model
from layerswap.recipe.methods import MethodConfig

STREAM_ATOL, LOGIT_ATOL, REF_ATOL = 1e-6, 1e-5, 1e-5
ROWS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63]]  # different lengths: right padding matters


def batch():
    width = max(len(r) for r in ROWS)
    ids = torch.zeros((len(ROWS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(ROWS):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


def states_of(stack: Stack, ids, mask) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    stack.forward(ids, mask, lambda i, h: out.__setitem__(i, h.detach().clone()))
    return out


def reference(model, row: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """States 0..L and their logits from one plain forward of `row` alone: hidden_states[:L] as transformers gives
    them, the last block's output read at the final norm's input (transformers' last entry is after the norm)."""
    seen = {}
    h = model.model.norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0].detach().clone()))
    try:
        with torch.no_grad():
            out = model(torch.tensor([row]), output_hidden_states=True)
            states = [s[0] for s in out.hidden_states[:-1]] + [seen["x"][0]]
            logits = []
            for s in states[:-1]:
                lg = model.lm_head(model.model.norm(s))
                cap = getattr(model.config, "final_logit_softcapping", None)
                logits.append(torch.tanh(lg / cap) * cap if cap else lg)
            logits.append(out.logits[0])
    finally:
        h.remove()
    return states, logits


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model_dir(request, tmp_path_factory, tokenizer):
    return make_tiny_llama(tmp_path_factory.mktemp(request.param) / "m", layers=3, tokenizer=tokenizer,
                           architecture=request.param)


def test_streamed_equals_in_memory_and_plain_transformers(model_dir):
    ids, mask = batch()
    model = load_model(model_dir)
    mem = Stack.loaded(model)
    streamed = Stack.streamed(WeightSource(Checkpoint.open(model_dir)))
    a, b = states_of(mem, ids, mask), states_of(streamed, ids, mask)
    L = model.config.num_hidden_layers
    assert sorted(a) == sorted(b) == list(range(L + 1))
    for i in a:
        assert torch.allclose(a[i], b[i], atol=STREAM_ATOL, rtol=0), f"state {i}"
    for r, row in enumerate(ROWS):
        n = len(row)
        ref_states, ref_logits = reference(model, row)
        for i in range(L + 1):
            assert torch.allclose(a[i][r, :n], ref_states[i], atol=REF_ATOL, rtol=1e-5), f"row {r} state {i}"
            got_mem, got_str = mem.decode(a[i][r, :n]), streamed.decode(b[i][r, :n])
            assert torch.allclose(got_mem, got_str, atol=LOGIT_ATOL, rtol=0), f"row {r} logits {i}"
            assert torch.allclose(got_mem, ref_logits[i].float(), atol=REF_ATOL, rtol=1e-5), f"row {r} logits {i}"


def test_streaming_holds_one_block_at_a_time(model_dir):
    stack = Stack.streamed(WeightSource(Checkpoint.open(model_dir)))
    resident = []

    def before(i: int) -> None:  # called before block i loads: nothing else may be resident
        resident.append([j for j, layer in enumerate(stack.layers)
                         if any(p.device.type != "meta" for p in layer.parameters())])

    ids, mask = batch()
    stack.forward(ids, mask, lambda i, h: None, on_block=before)
    assert resident == [[]] * stack.num_layers
    assert all(p.device.type == "meta" for layer in stack.layers for p in layer.parameters())
    assert stack.base.embed_tokens.weight.device.type == "meta"  # only the rows used were read


def test_tied_embeddings_and_bf16(tmp_path, tokenizer):
    d = make_tiny_llama(tmp_path / "tied", layers=2, tokenizer=tokenizer, tie_embeddings=True, dtype=torch.bfloat16)
    ck = Checkpoint.open(d)
    assert "lm_head.weight" not in ck.tensors
    ids, mask = batch()
    mem, streamed = Stack.loaded(load_model(d)), Stack.streamed(WeightSource(ck))
    a, b = states_of(mem, ids, mask), states_of(streamed, ids, mask)
    for i in a:
        assert a[i].dtype == torch.bfloat16 and torch.equal(a[i], b[i])
    assert torch.equal(mem.decode(a[2][0]), streamed.decode(b[2][0]))


@pytest.fixture(scope="module")
def experts(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lens_experts")
    base = make_tiny_llama(root / "base", layers=4, tokenizer=tokenizer, seed=3)
    return {"base": base, "math": perturb(base, root / "math", scale=0.2, seed=1),
            "lang": perturb(base, root / "lang", scale=0.2, seed=2)}


@pytest.mark.parametrize("recipe", [Recipe(plan=Plan(b=1, u=1, tb=1, tu=0, transition_weight=0.3)),
                                    Recipe(plan=Plan(b=1, u=0, tb=0, tu=0, non_layer="avg", revert=(2,))),
                                    Recipe(MethodConfig("ties", density=0.3))], ids=["blend", "revert", "ties"])
def test_streamed_merge_equals_the_in_memory_merge(experts, recipe):
    """Block by block (`MergedSource`, rows of the head for TIES from the whole merged tensor) as the whole merge."""
    cks = {r: Checkpoint.open(p) for r, p in experts.items()}
    whole = merged_model(load_model(experts["math"]), load_model(experts["lang"]), recipe, cks["math"], cks["base"],
                         "cpu")
    mem = Stack.loaded(whole)
    streamed = Stack.streamed(MergedSource(cks["math"], cks["lang"], recipe, cks["base"]))
    ids, mask = batch()
    a, b = states_of(mem, ids, mask), states_of(streamed, ids, mask)
    for i in a:
        assert torch.allclose(a[i], b[i], atol=STREAM_ATOL, rtol=0), f"state {i}"
    assert torch.allclose(mem.decode(a[4][:, -1]), streamed.decode(b[4][:, -1]), atol=LOGIT_ATOL, rtol=0)
    # and the merge really differs from both experts
    m = states_of(Stack.loaded(AutoModelForCausalLM.from_pretrained(experts["math"])), ids, mask)
    assert not torch.allclose(m[4], a[4], atol=1e-3)
