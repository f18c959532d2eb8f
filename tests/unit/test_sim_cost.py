"""The cost model: KV bytes from the shapes, and the H200 calibration points it must reproduce."""

from __future__ import annotations

import re

import pytest

from kvharbor.sim.cost import engine_cost
from kvharbor.sim.errors import PlanInputError


def test_kv_bytes_per_token_follow_the_model_shape() -> None:
    # 2 (K, V) x layers x KV heads x head size x 2 bytes (bf16).
    assert engine_cost("llama-3.1-8b", "h200").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert engine_cost("llama-3.1-70b", "h100").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    # docs/performance.md: a 32,768-token prompt of the 8B is 4 GiB of KV.
    assert 32_768 * engine_cost("Llama-3.1-8B", "H200").kv_bytes_per_token == 4 << 30


def test_the_h200_prefill_figures_bench_gpu_measured_are_reproduced() -> None:
    engine = engine_cost("llama-3.1-8b", "h200")
    assert 9.9 <= engine.prefill_s(0, 130_000) <= 10.3
    assert 1.16 <= engine.prefill_s(0, 32_768) <= 1.24
    # A cached prefix is not recomputed, and late positions cost more (attention).
    assert engine.prefill_s(100_000, 101_000) > 2 * engine.prefill_s(0, 1_000)


def test_the_70b_takes_four_gpus_and_one_gpu_is_refused() -> None:
    engine = engine_cost("llama-3.1-70b", "h200")
    assert engine.tensor_parallel == 4 and engine.gpu_cache_tokens > 1_000_000
    with pytest.raises(PlanInputError, match=re.escape("--model llama-3.1-70b does not fit 1 x --gpu h100")):
        engine_cost("llama-3.1-70b", "h100", tensor_parallel=1)


@pytest.mark.parametrize(("model", "gpu", "says"), [("gpt-9", "h200", "--model: unknown model 'gpt-9'"),
                                                    ("llama-3.1-8b", "a100", "--gpu: unknown GPU 'a100'")])  # fmt: skip
def test_an_unknown_model_or_gpu_is_refused_naming_the_flag(model: str, gpu: str, says: str) -> None:
    with pytest.raises(PlanInputError, match=says):
        engine_cost(model, gpu)
