"""Merge methods against hand-computed expectations on small tensors, then end to end."""

from __future__ import annotations

import pytest
import torch

from layerswap import Checkpoint, MethodConfig, Recipe, UserError, export_merge
from layerswap.recipe import methods as M
from tests.helpers import read_dir

T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


def test_linear_is_weighted_sum():
    assert torch.equal(M.linear([T(1, 2), T(3, -4)], [0.25, 0.75]), T(2.5, -2.5))
    assert M.linear([T(1.0).to(torch.bfloat16), T(3.0)], [0.5, 0.5]).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_matches_mergekit_kernel_bit_for_bit(dtype):
    """mergekit's linear: zeros, then result.addcmul_(tensor, weight) per input (inputs in their dtype)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50_000, generator=g).to(dtype)
    b = torch.randn(50_000, generator=g).to(dtype)
    a[:100], b[50:150] = -0.0, 0.0  # signed zeros, and both-zero entries
    a[200:300] = torch.finfo(dtype).tiny / 3  # subnormals
    for w in (0.5, 0.3, 1 / 3, 0.9, 0.0, 1.0):
        ref = torch.zeros(a.shape, dtype=torch.float32)
        ref.addcmul_(a, torch.tensor([1.0 - w]))
        ref.addcmul_(b, torch.tensor([w]))
        got = M.linear([a, b], [1.0 - w, w])
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), w
        assert torch.equal(got.to(dtype).view(torch.int16 if dtype != torch.float32 else torch.int32),
                           ref.to(dtype).view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_task_arithmetic():
    base, a, b = T(1, 1, 1), T(2, 0, 1), T(1, 3, -1)  # tau_a = (1,-1,0), tau_b = (0,2,-2)
    assert torch.allclose(M.task_arithmetic(base, [a, b], [1.0, 0.5], lam=2.0), T(3, 1, -1))


def test_magnitude_prune():
    assert torch.equal(M.magnitude_prune(T(1, -2, 3, -0.5), 0.5), T(0, -2, 3, 0))
    assert torch.equal(M.magnitude_prune(T(1, -2, 3, -0.5), 0.25), T(0, 0, 3, 0))
    assert torch.equal(M.magnitude_prune(T(1, -2), 1.0), T(1, -2))
    assert torch.equal(M.magnitude_prune(T(1, 1, -1, 0.5), 0.5), T(1, 1, -1, 0))  # ties at the threshold stay


def test_ties_by_hand():
    base = T(0, 0, 0, 0)
    t1, t2 = T(1, -2, 3, -0.5), T(-3, 1.5, 0.5, -1)
    # trim to 50%: (0,-2,3,0) and (-3,1.5,0,0); sum (-3,-0.5,3,0) -> signs (-,-,+,+)
    # disjoint mean of agreeing non-zero entries: (-3, -2, 3, 0)
    assert torch.equal(M.ties(base, [t1, t2], [1.0, 1.0], density=0.5, lam=1.0), T(-3, -2, 3, 0))
    assert torch.equal(M.ties(base + 1, [t1 + 1, t2 + 1], [1.0, 1.0], density=0.5, lam=0.5), T(-0.5, 0, 2.5, 1))
    # agreeing entries are averaged: both keep entry 0 with the same sign
    assert torch.equal(M.ties(T(0, 0), [T(2, 0), T(4, 0)], [1, 1], density=0.5), T(3, 0))


def test_elect_sign_and_disjoint_mean():
    s = M.elect_sign([T(1, -1, 0), T(-3, 0.5, 0)])
    assert torch.equal(s, T(-1, -1, 1))
    assert torch.equal(M.disjoint_mean([T(1, -1, 0), T(-3, 0.5, 0)], s), T(-3, -1, 0))


def test_dare_by_hand():
    base, a, b = T(0, 0, 0, 0), T(1, 2, 3, 4), T(-1, -2, -3, -4)
    g = M.tensor_generator(7, "w", 0)
    keep_a = torch.rand(4, generator=g) >= 0.5
    g = M.tensor_generator(7, "w", 1)
    keep_b = torch.rand(4, generator=g) >= 0.5
    gens = [M.tensor_generator(7, "w", 0), M.tensor_generator(7, "w", 1)]
    got = M.dare(base, [a, b], [1.0, 1.0], 0.5, gens, "linear")
    assert torch.equal(got, a * keep_a * 2 + b * keep_b * 2)
    # drop rate 0 is task arithmetic; seeds make it reproducible, and differ by tensor name
    assert torch.equal(M.dare(base, [a, b], [1, 1], 0.0, gens, "linear"), a + b)
    assert M.tensor_generator(7, "w", 0).initial_seed() != M.tensor_generator(7, "v", 0).initial_seed()


def test_dare_ties_by_hand():
    base = T(0, 0)
    a, b = T(2, -1), T(-4, 3)
    gens = [M.tensor_generator(0, "x", 0), M.tensor_generator(0, "x", 1)]
    # no drops: sum (-2, 2) -> signs (-, +); agreeing: (-4, 3)
    assert torch.equal(M.dare(base, [a, b], [1, 1], 0.0, gens, "ties"), T(-4, 3))


def test_registry_and_validation():
    assert {"layer_swap", "soup", "task_arithmetic", "ties", "dare_linear", "dare_ties"} <= set(M.METHODS)
    with pytest.raises(UserError, match="Unknown merge method 'slerp'"):
        MethodConfig("slerp").validate()
    with pytest.raises(UserError, match="density must lie in"):
        MethodConfig("ties", density=0).validate()
    with pytest.raises(UserError, match="drop_rate must lie in"):
        MethodConfig("dare_linear", drop_rate=1.0).validate()
    with pytest.raises(ValueError, match="already registered"):
        M.register(M.METHODS["soup"])
    assert MethodConfig("ties").to_dict() == {"name": "ties", "expert_weights": [1.0, 1.0], "lam": 1.0, "density": 0.2}


@pytest.mark.parametrize("cfg", [
    MethodConfig("soup", weight=0.3),
    MethodConfig("task_arithmetic", expert_weights=(0.7, 1.2), lam=0.8),
    MethodConfig("ties", density=0.3, lam=1.0),
    MethodConfig("dare_linear", drop_rate=0.5, seed=3),
    MethodConfig("dare_ties", drop_rate=0.3, seed=1, lam=0.9),
])
def test_methods_end_to_end(trio, tmp_path, cfg, monkeypatch):
    import layerswap.merge.merging as merging

    monkeypatch.setattr(merging, "CHUNK_ELEMS", 1000)  # merge large tensors in several slices
    math, lang, base = (Checkpoint.open(trio[r]) for r in ("math", "lang", "base"))
    s = export_merge(math, lang, Recipe(cfg), tmp_path / "o", base=base)
    assert s.n_copied == 0 and s.layer_weights is None
    got = read_dir(tmp_path / "o")
    m, l, b = read_dir(trio["math"]), read_dir(trio["lang"]), read_dir(trio["base"])
    for name in m:
        if cfg.name == "soup":
            exp = M.linear([m[name], l[name]], [0.7, 0.3])
        elif cfg.name == "task_arithmetic":
            exp = M.task_arithmetic(b[name], [m[name], l[name]], [0.7, 1.2], 0.8)
        elif cfg.name == "ties":
            exp = M.ties(b[name], [m[name], l[name]], [1, 1], 0.3, 1.0)
        else:
            gens = [M.tensor_generator(cfg.seed, name, i) for i in range(2)]
            exp = M.dare(b[name], [m[name], l[name]], [1, 1], cfg.drop_rate, gens, cfg.name.split("_")[1], cfg.lam)
        assert torch.equal(got[name], exp.to(m[name].dtype)), name
    card = (tmp_path / "o" / "README.md").read_text()
    assert cfg.spec.title in card


def test_task_vector_methods_need_a_base(trio, tmp_path):
    with pytest.raises(UserError, match="works on task vectors .*: pass --base"):
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), Recipe(MethodConfig("ties")),
                     tmp_path / "o")


def test_in_memory_methods_match_export(trio, tmp_path):
    from layerswap.serving.workbench import Workbench

    wb = Workbench()
    wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    cfg = MethodConfig("ties", density=0.4)
    assert wb.build(Recipe(cfg)) is None
    export_merge(*(Checkpoint.open(trio[r]) for r in ("math", "lang")), Recipe(cfg), tmp_path / "o",
                 base=Checkpoint.open(trio["base"]))
    disk = read_dir(tmp_path / "o")
    for k, v in wb.engines["merged"].model.state_dict().items():
        assert torch.equal(v, disk[k]), k
