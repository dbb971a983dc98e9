"""vLLM memory sizing (`layerswap.engines.serving`): three engines or one, decided before any engine starts."""

from __future__ import annotations

import pytest

from layerswap import Checkpoint, UserError
from layerswap.engines import VLLMSettings
from layerswap.engines.serving import GiB, estimate, plan_serving


def test_serving_plan_sizes_and_refuses_before_starting(vllm_trio):
    ck = Checkpoint.open(vllm_trio["math"])
    s = VLLMSettings(kv_cache_gib=0.5)
    est = estimate(ck, 3, s, "cpu", available=100 * GiB)
    params = sum(t.numel for t in ck.tensors.values())
    assert est.weights_bytes == params * 4  # float32 checkpoint served in float32
    assert est.kv_bytes == int(0.5 * GiB) and est.need_bytes == 3 * est.per_engine
    per = est.per_engine

    assert plan_serving(ck, "auto", s, "cpu", available=100 * GiB).mode == "three"
    small = int(2.5 * per / 0.9)  # room for two engines, not three
    one = plan_serving(ck, "auto", s, "cpu", available=small)
    assert one.mode == "one" and "three engines would not fit" in one.note
    assert one.settings.kv_cache_gib == pytest.approx(0.5)
    with pytest.raises(UserError, match="do not fit as three vLLM engines.*one at a time"):
        plan_serving(ck, "three", s, "cpu", available=small)
    with pytest.raises(UserError, match="Even one vLLM engine does not fit"):
        plan_serving(ck, "one", s, "cpu", available=int(0.5 * per))


def test_kv_cache_space_env_is_honoured(vllm_trio, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    est = estimate(Checkpoint.open(vllm_trio["math"]), 1, VLLMSettings(), "cpu", available=64 * GiB)
    assert est.kv_bytes == 3 * GiB


def test_running_engines_count_as_available(vllm_trio):
    ck = Checkpoint.open(vllm_trio["math"])
    s = VLLMSettings(kv_cache_gib=0.5)
    per = estimate(ck, 1, s, "cpu", available=0).per_engine
    tight = int(1.5 * per / 0.9)  # one more engine fits, not three
    assert plan_serving(ck, "auto", s, "cpu", available=tight).mode == "one"
    assert plan_serving(ck, "auto", s, "cpu", available=tight, running=2).mode == "three"


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
