import pytest

from layerswap import Plan, Sources, UserError
from layerswap.recipe.plans import default_plan


def test_paper_default_on_32_layers():
    w = Plan().layer_weights(32)
    assert w[:5] == [1.0] * 5 and w[5] == 0.5 and w[6:29] == [0.0] * 23 and w[29] == 0.5 and w[30:] == [1.0, 1.0]


def test_ramp_semantics():
    # bottom k=1..3: 1 - k/4 ; top k=1..2: k/3
    w = Plan(b=2, u=1, tb=3, tu=2, transition="ramp").layer_weights(12)
    assert w == [1, 1, 0.75, 0.5, 0.25, 0, 0, 0, 0, 1 / 3, 2 / 3, 1]


def test_flat_semantics_and_zero_zones():
    w = Plan(b=1, u=2, tb=2, tu=1, transition="flat", transition_weight=0.3).layer_weights(8)
    assert w == [1, 0.3, 0.3, 0, 0, 0.3, 1, 1]
    assert Plan(b=0, u=0, tb=0, tu=0).layer_weights(4) == [0, 0, 0, 0]
    assert Plan(b=2, u=2, tb=0, tu=0).layer_weights(4) == [1, 1, 1, 1]


def test_non_layer_options():
    lw = Plan(b=1, u=0, tb=0, tu=1, transition="ramp").layer_weights(4)  # [1, 0, 0, 0.5]
    p = Plan(b=1, u=0, tb=0, tu=1, transition="ramp")
    assert p.non_layer_weight("embed", lw) == 1.0
    assert p.non_layer_weight("lm_head", lw) == 0.5 and p.non_layer_weight("final_norm", lw) == 0.5
    for opt, val in (("math", 0.0), ("lang", 1.0), ("avg", 0.5)):
        q = p.with_(non_layer=opt)
        assert {q.non_layer_weight(g, lw) for g in ("embed", "final_norm", "lm_head")} == {val}


@pytest.mark.parametrize(
    "plan, msg",
    [
        (Plan(b=5, u=2, tb=1, tu=1), "exceeds the model's 8 layers; reduce them so the sum is at most 8"),
        (Plan(b=-1), "b must be a whole number >= 0"),
        (Plan(tu=-2), "tu must be a whole number >= 0"),
        (Plan(b=1, u=1, transition_weight=1.5), "transition_weight must lie in [0, 1]"),
        (Plan(b=1, u=1, transition="cosine"), "transition must be one of flat, ramp"),
        (Plan(b=1, u=1, non_layer="both"), "non_layer must be one of"),
    ],
)
def test_invalid_plans_state_the_limit(plan, msg):
    with pytest.raises(UserError) as e:
        plan.layer_weights(8) if "exceeds" in msg else plan.validate(32)
    assert msg in str(e.value)


def test_default_plan_scales():
    assert default_plan(32) == Plan()
    p = default_plan(8)
    assert p.b + p.u + p.tb + p.tu <= 8 and p.b >= 1 and p.u >= 1
    for L in range(1, 40):
        default_plan(L).validate(L)


def test_describe():
    assert Sources(Plan(b=1, u=1, tb=1, tu=0), 4).describe().splitlines() == [
        "layer 0: language expert", "layer 1: blend 0.50 lang / 0.50 math", "layer 2: math expert",
        "layer 3: language expert"]
    assert Sources(Plan(b=1, u=1, tb=1, tu=0, revert=(1, 2)), 4).describe().splitlines() == [
        "layer 0: language expert", "layers 1-2: base model (fine-tuning reverted)", "layer 3: language expert"]


def test_other_map_kinds():
    assert Plan(kind="middle", k=2).layer_weights(6) == [0, 0, 1, 1, 0, 0]
    assert Plan(kind="middle", k=3).layer_weights(6) == [0, 1, 1, 1, 0, 0]
    assert Plan(kind="alternating").layer_weights(5) == [1, 0, 1, 0, 1]
    assert Plan(kind="alternating", offset=1).layer_weights(4) == [0, 1, 0, 1]
    r = Plan(kind="random", k=3, seed=5).layer_weights(10)
    assert sum(r) == 3 and r == Plan(kind="random", k=3, seed=5).layer_weights(10)
    import random

    assert {i for i, w in enumerate(r) if w} == set(random.Random(5).sample(range(10), 3))
    assert Plan(kind="weights", weights=(0.1, 0.2, 1.0)).layer_weights(3) == [0.1, 0.2, 1.0]


def test_per_module_weights():
    p = Plan(b=1, u=1, tb=0, tu=0, modules="attention")
    lw = p.layer_weights(4)
    assert p.tensor_weight(0, "q_proj", lw) == 1 and p.tensor_weight(0, "input_layernorm", lw) == 1
    assert p.tensor_weight(0, "gate_proj", lw) == 0 and p.tensor_weight(0, "post_attention_layernorm", lw) == 0
    assert p.tensor_weight(0, "q_proj.bias", lw) == 1
    q = p.with_(modules="mlp")
    assert q.tensor_weight(3, "down_proj", lw) == 1 and q.tensor_weight(3, "v_proj", lw) == 0
    assert "attention only" in Sources(p, 4).describe() and "attention only" in p.title()


@pytest.mark.parametrize("plan, msg", [
    (Plan(kind="weights", weights=(1.0, 0.0)), "needs one weight per layer: 4 for this model (got 2)"),
    (Plan(kind="weights", weights=(1.0, 0.0, 2.0, 0.0)), "layer weights must lie in [0, 1]"),
    (Plan(kind="middle", k=9), "k must be a whole number from 0 to the model's 4 layers"),
    (Plan(kind="alternating", offset=2), "offset must be 0 or 1"),
    (Plan(kind="zigzag"), "kind must be one of"),
    (Plan(modules="embeddings"), "modules must be one of"),
])
def test_invalid_maps(plan, msg):
    with pytest.raises(UserError) as e:
        plan.layer_weights(4)
    assert msg in str(e.value)


def test_plan_roundtrip():
    p = Plan(kind="weights", weights=(0.5, 1.0), modules="mlp", non_layer="avg")
    assert Plan.from_dict(p.to_dict()) == p
