"""Load or recompute (`kvharbor.cache.bandwidth`) and its use by the vLLM scheduler half."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvharbor.cache.bandwidth import (
    LOAD_LATENCY_S,
    LoadPlanner,
    PrefillCost,
    RateEstimate,
    choose,
    keep_loading,
)
from tests.support.clock import Clock

LLAMA_8B = PrefillCost.transformer(hidden=4096, layers=32, heads=32, kv_heads=8, head_size=128, intermediate=14336)
CHUNK_TOKENS = 256
CHUNK_BYTES = 32 << 20  # Llama-3.1-8B, bf16: 256 tokens x 32 layers x 2 x 8 heads x 128 x 2 B


def test_prefill_cost_matches_the_measured_h200_prefills() -> None:
    """Recompute on the H200 took 1.22 s for 32,768 tokens and 10.3 s for 130,000
    (../shared/notes/vllm-on-gpu.md): 3.7x the tokens for 8.4x the time. The FLOP
    model explains both with one rate, which is why the planner learns FLOP/s."""
    rate_32k = LLAMA_8B.flops(0, 32768) / 1.22
    rate_130k = LLAMA_8B.flops(0, 130000) / 10.3
    assert rate_32k == pytest.approx(rate_130k, rel=0.05)
    assert 5e14 < rate_32k < 7e14  # FLOP/s: most of an H200's dense bf16 rate


def test_prefill_cost_adds_up_over_chunks() -> None:
    whole = LLAMA_8B.flops(0, 10_000)
    parts = LLAMA_8B.flops(0, 3000) + LLAMA_8B.flops(3000, 7777) + LLAMA_8B.flops(7777, 10_000)
    assert parts == pytest.approx(whole)
    assert LLAMA_8B.flops(5, 5) == 0
    # A later token costs more than an earlier one (attention).
    assert LLAMA_8B.flops(100_000, 100_256) > 2 * LLAMA_8B.flops(0, 256)


def test_rate_estimate_weights_big_samples_and_forgets_old_ones() -> None:
    rate = RateEstimate(half_life_samples=1.0)
    assert rate.rate is None
    rate.add(0, 1.0)
    rate.add(100, 0)
    assert rate.rate is None and rate.samples == 0
    rate.add(1000, 1.0)  # 1000/s
    rate.add(10, 1.0)  # 10/s, newer, same seconds: halves the old one's weight
    assert rate.rate == pytest.approx((1000 * 0.5 + 10) / (1.0 * 0.5 + 1.0))
    assert RateEstimate(prior=5.0).rate == 5.0


def test_choose_loads_until_both_rates_are_known() -> None:
    assert choose(None, 1.0).load
    assert choose(1.0, None).load
    assert choose(0.5, 1.0).load
    assert not choose(2.0, 1.0).load
    assert choose(2.0, 1.0, margin=2.5).load
    assert "recompute" in choose(2.0, 1.0).reason and "load" in choose(None, None).reason


def test_keep_loading_compares_the_rest() -> None:
    # 1 GB in 1 s so far; 3 GB left -> 3 s of loading vs 2 s of recompute: stop.
    assert not keep_loading(1.0, 10**9, 3 * 10**9, 2.0)
    assert keep_loading(1.0, 10**9, 3 * 10**9, 4.0)
    assert keep_loading(1.0, 10**9, 3 * 10**9, None)
    assert keep_loading(0.0, 0, 3 * 10**9, 0.1)  # Nothing seen yet: no evidence


def planner() -> LoadPlanner:
    return LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS)


def test_planner_prefers_a_fast_tier_and_avoids_a_slow_one() -> None:
    p = planner()
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)  # the H200's prefill
    chunks_130k = 130_000 // CHUNK_TOKENS
    start, end = 0, chunks_130k * CHUNK_TOKENS
    assert p.choose(start, end, chunks_130k).load  # no load sample yet
    p.observe_load(16 << 30, 16 * 2**30 / 40e9)  # RAM tier through PCIe: 40 GB/s
    fast = p.choose(start, end, chunks_130k)
    assert fast.load and fast.load_s is not None and fast.recompute_s is not None
    assert fast.load_s == pytest.approx(LOAD_LATENCY_S + chunks_130k * CHUNK_BYTES / 40e9)
    assert fast.recompute_s == pytest.approx(10.2, rel=0.05)

    slow = planner()
    slow.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    for _ in range(20):
        slow.observe_load(1 << 30, 2**30 / 1.2e9)  # a disk: 1.2 GB/s
    # 32k tokens: 4 GiB at 1.2 GB/s = 3.6 s > 1.22 s recompute
    assert not slow.choose(0, 32768, 128).load
    # 130k tokens: 16 GiB at 1.2 GB/s = 14 s > 10.3 s: still recompute
    assert not slow.choose(start, end, chunks_130k).load
    # a 3 GB/s tier: 32k -> 1.4 s (recompute), 130k -> 5.7 s (load: the quadratic term)
    mid = planner()
    mid.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    mid.observe_load(1 << 30, 2**30 / 3e9)
    assert not mid.choose(0, 32768, 128).load
    assert mid.choose(start, end, chunks_130k).load


def test_a_read_back_from_a_slow_disk_counts_in_the_load_time() -> None:
    """After a reboot the prefix is on files only: it is read back into RAM (at the disk's
    speed) before the load from RAM (at PCIe speed); the choice weighs both."""
    p = planner()
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    p.observe_load(16 << 30, 16 * 2**30 / 40e9)  # From RAM: 40 GB/s.
    read_back = 128 * CHUNK_BYTES  # 32k tokens' 4 GiB, on files.
    unknown = p.choose(0, 32768, 128, read_back)
    assert unknown.load and not unknown.reads_back, "no read-back timed yet: nothing says it is slow"
    assert unknown.load_s == pytest.approx(LOAD_LATENCY_S + read_back / 40e9)
    p.observe_read_back(1 << 20, 1.0)  # Too small to be a sample: latency, mostly.
    assert p.read_back_rate.rate is None
    p.observe_read_back(1 << 30, 2**30 / 1.5e9)  # The disk: 1.5 GB/s.
    slow = p.choose(0, 32768, 128, read_back)
    assert not slow.load and slow.reads_back and "read-back" in slow.reason
    assert slow.load_s == pytest.approx(LOAD_LATENCY_S + read_back / 40e9 + read_back / 1.5e9)
    assert p.choose(0, 32768, 128).load, "the same prefix in RAM is still loaded"
    # 130k tokens: 16 GiB read back in 11.5 s against 10.3 s of recompute: recompute.
    chunks = 130_000 // CHUNK_TOKENS
    assert not p.choose(0, chunks * CHUNK_TOKENS, chunks, chunks * CHUNK_BYTES).load


def test_a_re_measurement_replaces_a_stale_read_back_rate() -> None:
    clock = Clock()
    p = LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS, resample_s=60.0, clock=clock)
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    p.observe_load(16 << 30, 16 * 2**30 / 40e9)
    for _ in range(20):
        p.observe_read_back(1 << 30, 2**30 / 0.5e9)  # A disk busy with another job.
    read_back = 128 * CHUNK_BYTES
    assert not p.choose(0, 32768, 128, read_back).load
    clock.now_s += 61.0
    again = p.choose(0, 32768, 128, read_back)
    assert again.load and again.remeasure
    p.observe_read_back(4 << 30, 4 * 2**30 / 20e9)  # That read-back found the disk fast again.
    assert p.read_back_rate.rate == pytest.approx(20e9)
    assert p.choose(0, 32768, 128, read_back).load


def test_a_stale_slow_rate_is_measured_again_and_a_fast_tier_is_used_again() -> None:
    clock = Clock()
    p = LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS, resample_s=60.0, clock=clock)
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    for _ in range(20):
        p.observe_load(1 << 30, 2**30 / 1.2e9)  # A disk busy with another job: 1.2 GB/s.
    assert not p.choose(0, 32768, 128).load
    clock.now_s += 59.0
    assert not p.choose(0, 32768, 128).load, "a rate younger than resample_s is trusted"
    clock.now_s += 2.0
    again = p.choose(0, 32768, 128)
    assert again.load and again.remeasure and "engine.load_resample_s" in again.reason
    assert not p.choose(0, 32768, 128).load, "one load measures it; the others keep to the old rate"
    assert p.remeasured == 1
    p.observe_load(4 << 30, 4 * 2**30 / 40e9)  # That load found the tier fast again: it is the rate now.
    fast = p.choose(0, 32768, 128)
    assert fast.load and not fast.remeasure and fast.load_s is not None and fast.load_s < 0.2
    # Loads keep the rate fresh: no re-measurement while they come.
    clock.now_s += 3600.0
    p.observe_load(4 << 30, 4 * 2**30 / 40e9)
    assert p.choose(0, 32768, 128).load and p.remeasured == 1


def test_re_measurements_that_find_it_slow_back_off_to_resample_max() -> None:
    clock = Clock()
    p = LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS, resample_s=60.0, resample_max_s=200.0, clock=clock)
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    p.observe_load(1 << 30, 2**30 / 1.2e9)
    waits = []
    for _ in range(4):
        waited = 0.0
        while not p.choose(0, 32768, 128).load:
            clock.now_s += 10.0
            waited += 10.0
        waits.append(waited)
        p.observe_load(1 << 30, 2**30 / 1.2e9)  # Still slow (the worker cut it short: a partial sample).
    assert waits == [60.0, 120.0, 200.0, 200.0] and p.remeasured == 4
    # A re-measurement that finds the tier fast starts the waits over.
    clock.now_s += 200.0
    assert p.choose(0, 32768, 128).remeasure
    p.observe_load(4 << 30, 4 * 2**30 / 40e9)
    assert p.choose(0, 32768, 128).load
    p.observe_load(1 << 30, 2**30 / 1.2e9)  # Slow again, for a while: recomputed...
    while p.load_s(128 * CHUNK_BYTES) < p.recompute_s(0, 32768):  # type: ignore[operator]
        p.observe_load(1 << 30, 2**30 / 1.2e9)
    clock.now_s += 60.0
    assert p.choose(0, 32768, 128).remeasure, "...and measured again after resample_s, not resample_max_s"


def test_without_resample_s_a_rate_is_kept_for_ever() -> None:
    clock = Clock()
    p = LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS, clock=clock)
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    p.observe_load(1 << 30, 2**30 / 1.2e9)
    clock.now_s += 1e6
    assert not p.choose(0, 32768, 128).load and p.remeasured == 0
    with pytest.raises(ValueError, match="resample_s must be > 0"):
        LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS, resample_s=0.0)


def test_small_samples_do_not_move_the_rates() -> None:
    p = planner()
    p.observe_load(1 << 20, 1.0)  # 1 MiB: latency, not bandwidth
    p.observe_prefill(1e9, 1.0)  # a decode step
    assert p.load_rate.rate is None and p.prefill_rate.rate is None


def test_chunk_recompute_times_cover_the_transfer() -> None:
    p = planner()
    assert p.chunk_recompute_s(0, 1024) == ()
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    per_chunk = p.chunk_recompute_s(64, 1000)  # a partial first and last chunk
    assert len(per_chunk) == 4  # chunks 0..3
    assert sum(per_chunk) == pytest.approx(p.recompute_s(64, 1000))
    assert per_chunk[1] < per_chunk[2]  # later chunks cost more


# -- the scheduler half -------------------------------------------------------------


class FakeLink:
    def __init__(self, hits: int, in_ram: bool = True) -> None:
        self.hits = hits
        self.in_ram = in_ram
        self.is_off = False

    def lookup(self, keys: Any, chunk_tokens: int, value_bytes: int = 0) -> Any:
        from kvharbor.gateway.protocol import LookupOk

        hits = min(self.hits, len(keys))
        return LookupOk(hits, hits if self.in_ram else 0)  # In RAM: promised as they are.


def scheduler(hits: int, plan: LoadPlanner | None, in_ram: bool = True) -> Any:
    from kvharbor.cache.keys import LayoutFingerprint
    from kvharbor.config import Config
    from kvharbor.connector.vllm.layout import CacheGroup, VllmLayout
    from kvharbor.connector.vllm.scheduler import SchedulerSide

    fingerprint = LayoutFingerprint(model_id="m", chunk_size=CHUNK_TOKENS)
    group = CacheGroup(0, "FullAttentionSpec", ("layers.0",), 4096, "FullAttentionSpec[1]", 16)
    layout = VllmLayout(
        chunk_size=CHUNK_TOKENS,
        block_size=16,
        tp_size=1,
        pp_size=1,
        fingerprints=(fingerprint,),
        digests=(fingerprint.digest(),),
        groups=(group,),
    )
    return SchedulerSide(layout, Config(), FakeLink(hits, in_ram), plan)  # type: ignore[arg-type]


def request(tokens: int, req_id: str = "r") -> Any:
    prompt = list(range(tokens))
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=prompt, num_tokens=tokens, cache_salt=None, num_computed_tokens=0
    )


def stats(**data: float) -> Any:
    return SimpleNamespace(data=data)


def test_scheduler_recomputes_when_the_measured_tier_is_slower() -> None:
    pytest.importorskip("vllm")
    p = planner()
    side = scheduler(hits=200, plan=p)
    req = request(32768 + 5)
    assert side.get_num_new_matched_tokens(req, 0) == (32768, False)  # nothing measured: load
    # The workers report a slow restore (1 GiB at 1.2 GB/s) and a prefill step.
    side.observe(
        stats(
            loaded_bytes=2**30, load_seconds=2**30 / 1.2e9, prefill_flops=LLAMA_8B.flops(0, 32768), prefill_seconds=1.22
        )
    )
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: counted once
    assert side.counters.chose_recompute == 1 and side.take_stats()["chose_recompute"] == 1
    # A local (GPU) hit shrinks what is left to load, not the choice's honesty.
    assert side.get_num_new_matched_tokens(req, 32768 - 256) == (0, False)
    side.request_finished(req)


def test_scheduler_restores_again_once_a_slow_rate_went_unmeasured(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("vllm")
    clock = Clock()
    side = scheduler(hits=200, plan=LoadPlanner(LLAMA_8B, CHUNK_BYTES, CHUNK_TOKENS, resample_s=60.0, clock=clock))
    side.observe(
        stats(
            loaded_bytes=2**30, load_seconds=2**30 / 1.2e9, prefill_flops=LLAMA_8B.flops(0, 32768), prefill_seconds=1.22
        )
    )
    assert side.get_num_new_matched_tokens(request(32768 + 5, "a"), 0) == (0, False)
    clock.now_s += 61.0
    with caplog.at_level(logging.INFO, logger="kvharbor"):
        assert side.get_num_new_matched_tokens(request(32768 + 5, "b"), 0) == (32768, False)
    # vLLM asks again for a request it could not schedule yet: the re-measuring one still loads,
    # another request keeps to the stale rate until the sample comes.
    assert side.get_num_new_matched_tokens(request(32768 + 5, "b"), 0) == (32768, False)
    assert side.get_num_new_matched_tokens(request(32768 + 5, "c"), 0) == (0, False)
    said = [r.getMessage() for r in caplog.records if "to measure it again" in r.getMessage()]
    assert len(said) == 1 and "engine.load_resample_s" in said[0]


def test_scheduler_loads_from_a_fast_tier_and_plans_chunk_estimates() -> None:
    pytest.importorskip("vllm")
    p = planner()
    side = scheduler(hits=200, plan=p)
    side.observe(
        stats(
            loaded_bytes=2**30, load_seconds=2**30 / 40e9, prefill_flops=LLAMA_8B.flops(0, 32768), prefill_seconds=1.22
        )
    )
    req = request(4 * CHUNK_TOKENS + 3)
    assert side.get_num_new_matched_tokens(req, 0) == (4 * CHUNK_TOKENS, False)
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 70)),))
    side.update_state_after_alloc(req, blocks, 4 * CHUNK_TOKENS)
    meta = side.build_meta(
        SimpleNamespace(
            num_scheduled_tokens={"r": 3},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        )
    )
    (load,) = meta.loads
    assert len(load.recompute_s) == load.chunks == 4
    assert meta.step_flops == 0  # a step that loads is not a prefill sample


def test_scheduler_times_prefill_steps_only() -> None:
    pytest.importorskip("vllm")
    side = scheduler(hits=0, plan=planner())
    new = SimpleNamespace(req_id="a", block_ids=([1, 2],), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=["b"], new_block_ids=[None], num_computed_tokens=[5000])
    out = SimpleNamespace(
        num_scheduled_tokens={"a": 4096, "b": 1}, scheduled_new_reqs=[new], scheduled_cached_reqs=cached
    )
    meta = side.build_meta(out)
    assert meta.step_flops == pytest.approx(LLAMA_8B.flops(0, 4096))  # the decode token is left out
    decode = SimpleNamespace(num_scheduled_tokens={"b": 1}, scheduled_new_reqs=[], scheduled_cached_reqs=cached)
    assert side.build_meta(decode).step_flops == 0


def test_scheduler_stops_restoring_once_a_worker_is_off() -> None:
    pytest.importorskip("vllm")
    side = scheduler(hits=200, plan=None)
    req = request(2048 + 1)
    assert side.get_num_new_matched_tokens(req, 0) == (2048, False)
    side.observe(stats(cache_off=1))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_nothing_is_decided_where_vllm_holds_the_whole_hit_itself(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's own prefix cache reaches the hit's end (1008 of a 1024-token prompt: the last
    block before its end, mid-chunk), the chunks on files: there is nothing to load, so no
    recompute is chosen, said or counted."""
    pytest.importorskip("vllm")
    p = planner()
    p.observe_load(2**30, 2**30 / 1.2e9)
    p.observe_prefill(LLAMA_8B.flops(0, 32768), 1.22)
    side = scheduler(hits=4, plan=p, in_ram=False)
    with caplog.at_level(logging.INFO, logger="kvharbor"):
        assert side.get_num_new_matched_tokens(request(1024), 1008) == (0, False)
    assert side.counters.chose_recompute == 0 and p.chose_recompute == 0
    assert not [r for r in caplog.records if "recomputed, not restored" in r.getMessage()]
