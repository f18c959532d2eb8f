"""The sweep: one LRU pass gives what each capacity's own replay gives, and the Mooncake
conversation trace's curve has the published shape, checked by an independent replay."""

from __future__ import annotations

import pytest

from kvharbor.sim.caches import LruCache, Policy, SlruCache, hit_tokens
from kvharbor.sim.errors import PlanInputError
from kvharbor.sim.sweep import capacity_blocks, replay, smallest_reaching, sweep
from kvharbor.sim.workload import MultiTurnChat, RagDocuments, generate, read_trace
from tests.support.traces import mooncake_trace


def test_one_lru_pass_gives_every_capacitys_own_replay() -> None:
    requests = list(generate(MultiTurnChat(conversations_active=40, turn_tokens_mean=300), 1500, 128, seed=3))
    requests += list(generate(RagDocuments(documents=50, document_tokens=512), 500, 128, seed=4))
    capacities = [128 * c for c in (1, 3, 10, 40, 150, 600, 5000)]
    results = sweep(requests, capacities, 128, Policy.LRU)
    replayed = [replay(requests, Policy.LRU, c // 128, 128) for c in capacities]
    assert [r.hit_tokens for r in results] == replayed
    rates = [r.token_hit_rate for r in results]
    assert rates == sorted(rates) and rates[0] < rates[-1], "more capacity never hits less (LRU is a stack algorithm)"


def test_slru_keeps_reused_blocks_against_a_scan() -> None:
    reused, scan = [1, 2], [[100 + i] for i in range(10)]
    lru, slru = LruCache(4), SlruCache(4)
    for cache in (lru, slru):
        cache.use(reused)
        cache.use(reused)  # Used twice: protected in SLRU.
        for blocks in scan:  # One-shot blocks, more than the capacity.
            cache.use(blocks)
    assert lru.match(reused) == 0 and slru.match(reused) == 2
    assert len(slru) == 4 and slru.evictions == 8


def test_capacities_below_one_block_or_not_positive_are_refused() -> None:
    for bad in (0, -5, 100):
        with pytest.raises(PlanInputError, match="--capacity-tokens"):
            capacity_blocks(bad, 512)


def independent_unbounded_replay(path: str) -> float:
    """Obviously correct: a prompt hits its leading blocks seen before (whole blocks
    only are ever stored), within floor(N / 512) x 512 tokens; nothing is evicted."""
    import json

    seen: set[int] = set()
    hit = total = 0
    with open(path) as lines:
        for line in lines:
            record = json.loads(line)
            n, ids = record["input_length"], record["hash_ids"]
            leading = 0
            while leading < len(ids) and ids[leading] in seen:
                leading += 1
            hit += min(leading * 512, n // 512 * 512)
            total += n
            seen.update(ids[: n // 512])
    return hit / total


def test_the_mooncake_curve_has_the_published_shape() -> None:
    trace = mooncake_trace()
    requests = read_trace(trace, 512)
    assert len(requests) == 12_031
    capacities = [1e4, 1e5, 1e6, 3e6, 1e7, 3e7, 5e7, 1e8, 1e9, 1e10]
    results = sweep(requests, capacities, 512, Policy.LRU)
    rates = [r.token_hit_rate for r in results]
    unbounded = independent_unbounded_replay(str(trace))
    # The largest capacity holds every block of the trace: it is the unbounded cache.
    assert results[-1].hit_tokens / results[-1].prompt_tokens == pytest.approx(unbounded, abs=1e-12)
    assert 0.36 < unbounded < 0.40, "about 37 % (the paper: about 40 % reusable)"
    assert rates == sorted(rates)
    assert rates[0] < 0.06 and rates[4] < 0.9 * unbounded, "small caches lose most of it"
    assert rates[6] > 0.97 * unbounded, "saturated near 50 M tokens, as the paper's figure"
    target = smallest_reaching(results, 0.3)
    assert target is not None and target.capacity_tokens == 30_000_000
    assert hit_tokens(1000, 5, 512) == 512, "a hit is bounded by floor(N / block) x block"
