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
