"""What one vLLM engine needs (`layerswap.engines.sizing`): weights, a KV cache sized from the model, overhead;
and the plan's choice among three, two and one engines on the memory there is."""

from __future__ import annotations

import dataclasses

import pytest

from layerswap import Checkpoint
from layerswap.engines import VLLMSettings
from layerswap.engines.planning import plan_engines
from layerswap.engines.sizing import (CPU_ENGINE_OVERHEAD, CPU_PROCESS_OVERHEAD, GiB, estimate, kv_bytes_per_token,
                                      kv_cache_bytes)
from layerswap.core.hardware import flavour


def _cpu(ram: int):
    return dataclasses.replace(flavour("cpu-upgrade"), vllm=True, ram_available=ram)


def test_kv_cache_is_sized_from_the_model(vllm_trio, monkeypatch):
    ck = Checkpoint.open(vllm_trio["math"])
    seq = kv_bytes_per_token(ck, "float32") * 2048  # the test model: 4 layers, 4 heads of 64, float32, 2048 positions
    assert seq == 2 * 4 * 4 * 64 * 4 * 2048 and VLLMSettings().context_length(ck.config) == 2048
    assert kv_cache_bytes(ck, VLLMSettings(), "cpu") == 16 * seq  # 16 full sequences: 256 MiB, not a fixed GiB
    assert kv_cache_bytes(ck, VLLMSettings(kv_cache_gib=0.5), "cpu") == GiB // 2  # asked for
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    assert kv_cache_bytes(ck, VLLMSettings(), "cpu") == int(0.05 * GiB)  # capped by vLLM's own setting
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    assert kv_cache_bytes(ck, VLLMSettings(), "cpu") == seq  # never below one full sequence (vLLM would not start)
    est = estimate(ck, 3, VLLMSettings(), "cpu", available=100 * GiB)
    params = sum(t.numel for t in ck.tensors.values())
    assert est.weights_bytes == params * 4 and est.overhead_bytes == CPU_ENGINE_OVERHEAD
    assert est.need_bytes == 3 * est.per_engine + CPU_PROCESS_OVERHEAD


def test_three_two_or_one_by_memory(vllm_trio):
    cks = {r: Checkpoint.open(vllm_trio[r]) for r in ("math", "lang")}
    s = VLLMSettings(kv_cache_gib=0.5)
    per = estimate(cks["math"], 1, s, "cpu", available=0).per_engine
    fixed = estimate(cks["math"], 1, s, "cpu", available=0, fixed=GiB).fixed_bytes
    for engines, arrangement in ((3, "three_vllm"), (2, "two_vllm"), (1, "one_vllm_swapped")):
        room = int((engines * per + fixed) / 0.9) + 1
        plan = plan_engines(cks, engine="vllm", settings=s, hardware=_cpu(room))
        assert plan.arrangement == arrangement and plan.fits and plan.settings.kv_cache_gib == pytest.approx(0.5)
    small = int((2 * per + fixed) / 0.9) + 1
    forced = plan_engines(cks, engine="vllm", serving="three", settings=s, hardware=_cpu(small))
    assert not forced.fits and "three vLLM engines side by side need" in forced.problem
    off = plan_engines(cks, engine="vllm", settings=s, hardware=_cpu(per // 2))
    assert not off.fits and off.arrangement == "one_vllm_swapped"
    auto = plan_engines(cks, engine="auto", settings=s, hardware=_cpu(int(1.2 * GiB)))
    assert auto.arrangement == "transformers" and "one vLLM engine" in auto.why  # auto falls back to what fits


def test_tensor_parallel_splits_each_engine_over_its_gpus(vllm_trio):
    """tensor_parallel_size N: each of an engine's N GPUs holds 1/N of its weights and minimum cache."""
    ck = Checkpoint.open(vllm_trio["math"])
    one = estimate(ck, 3, VLLMSettings(), "cuda", available=80 * GiB)
    two = estimate(ck, 3, VLLMSettings(tensor_parallel_size=2), "cuda", available=80 * GiB)
    assert two.weights_bytes == one.weights_bytes // 2 and two.kv_bytes == one.kv_bytes // 2
    cpu = estimate(ck, 3, VLLMSettings(tensor_parallel_size=2, kv_cache_gib=0.5), "cpu", available=80 * GiB)
    assert cpu.weights_bytes == one.weights_bytes  # no GPUs to split over: refused when the engine starts


def test_tensor_parallel_is_refused_before_an_engine_starts():
    from layerswap.engines.vllm_engine import EngineStartError, check_tensor_parallel

    check_tensor_parallel(1, "cpu")
    with pytest.raises(EngineStartError, match="splits a model over 2 GPUs.*Use 1"):
        check_tensor_parallel(2, "cpu")
    with pytest.raises(EngineStartError, match="must be 1 or more"):
        check_tensor_parallel(0, "cuda")
    import torch

    if torch.cuda.device_count() < 64:
        with pytest.raises(EngineStartError, match="needs 64 GPUs"):
            check_tensor_parallel(64, "cuda")


def test_lora_experts_are_planned_as_adapters_on_one_base_engine(vllm_trio, tmp_path, monkeypatch):
    """LoRA experts of the layers' linear modules: one engine on the base with LoRA (arrangement ``lora_vllm``,
    max_lora_rank the two ranks side by side) when serving is auto; adapters vLLM's LoRA cannot serve, and explicit
    arrangements, are planned as before, with the reason."""
    from layerswap.models.adapters import open_expert
    from layerswap.engines.sizing import vllm_lora_rank
    from tests.helpers import DEMO, make_adapter

    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    m, l = (open_expert(make_adapter(vllm_trio["base"], tmp_path / r, "lora", i)) for i, r in enumerate("ml"))
    assert vllm_lora_rank({"math": m, "lang": l}) == (8, "")  # rank 4 + 4
    ck, s = Checkpoint.open(vllm_trio["math"]), VLLMSettings(kv_cache_gib=0.5)
    pair = {"math": m, "lang": l}
    p = plan_engines(pair, engine="vllm", settings=s, hardware=_cpu(100 * GiB))
    assert p.arrangement == "lora_vllm" and p.settings.max_lora_rank == 8 and p.vllm_engines == 1
    assert p.estimate.engines == 2 and "LoRA adapter" in p.title  # room kept for a merge method's dense engine
    forced = plan_engines(pair, engine="vllm", serving="three", settings=s, hardware=_cpu(100 * GiB))
    assert forced.arrangement == "three_vllm" and forced.settings.max_lora_rank is None
    full = {r: open_expert(DEMO / "ablation" / f"{r}_lora") for r in ("math", "lang")}  # norm, lm_head copies
    rank, why = vllm_lora_rank(full)
    assert rank is None and "the math expert brings full copies of modules (modules_to_save)" in why
    dense = plan_engines(full, engine="vllm", settings=s, hardware=_cpu(100 * GiB))  # the page says why, once
    assert dense.arrangement == "three_vllm" and dense.dense_why == why
    assert f"served as full models, not as adapters ({why})" in dense.describe()
    assert not p.dense_why and not forced.dense_why and "not as adapters" not in p.describe()
    assert vllm_lora_rank({"math": m, "lang": ck})[0] is None
