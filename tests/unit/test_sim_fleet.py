"""The fleet run: tiers serve what they hold, the connector's load-or-recompute choice
decides, routing matters, and the outputs add up."""

from __future__ import annotations

import dataclasses

from kvharbor.hal.sim.params import CardParams
from kvharbor.sim.caches import Policy
from kvharbor.sim.cost import engine_cost
from kvharbor.sim.fleet import FleetConfig, FleetResult, Routing, Tier, run_fleet
from kvharbor.sim.workload import Arrivals, SystemPrompts, generate

ENGINE = engine_cost("llama-3.1-8b", "h200")
WORKLOAD = SystemPrompts(prompts=8, prompt_tokens=16_384, user_tokens_mean=400)
REQUESTS = 600


def run(**settings: object) -> FleetResult:
    config = FleetConfig(**{"engines": 4, "engine": ENGINE, "block_tokens": 512, "card_tokens": 0, **settings})  # type: ignore[arg-type]
    return run_fleet(config, generate(WORKLOAD, REQUESTS, 512, Arrivals(1.0), seed=1), REQUESTS)


def test_a_card_serves_what_the_gpus_evicted_and_saves_gpu_time() -> None:
    small_gpu = dataclasses.replace(ENGINE.gpu, memory_bytes=ENGINE.model.weight_bytes / 0.9 + 20_000 * 131072)
    engine = dataclasses.replace(ENGINE, gpu=small_gpu)  # 20,000 tokens of GPU cache: one prompt or so.
    bare = run(engine=engine)
    carded = run(engine=engine, card_tokens=10_000_000)
    assert bare.token_hit_rate(Tier.CARD) == 0 and bare.chose_load == 0
    assert carded.token_hit_rate(Tier.CARD) > 0.3 and carded.chose_load > 0
    assert carded.prefill_gpu_s < bare.prefill_gpu_s and carded.prefill_gpu_s_saved > 0
    assert carded.ttft_quantile_s(0.5) < bare.ttft_quantile_s(0.5)
    for result in (bare, carded):
        assert result.requests == REQUESTS and len(result.ttft_s) == REQUESTS
        assert list(result.ttft_s) == sorted(result.ttft_s) and result.ttft_s[0] > 0
        assert result.prefill_gpu_s_without_cache > 0
        assert 0 < len(result.fill) <= 201 and result.fill[-1].used_ratio[Tier.GPU] > 0
    assert carded.fill[-1].used_ratio[Tier.CARD] > 0


def test_a_card_slower_than_recomputing_is_not_loaded_from() -> None:
    small_gpu = dataclasses.replace(ENGINE.gpu, memory_bytes=ENGINE.model.weight_bytes / 0.9 + 20_000 * 131072)
    engine = dataclasses.replace(ENGINE, gpu=small_gpu)
    slow = CardParams(read_bandwidth_bytes_per_s=1e8, write_bandwidth_bytes_per_s=1e8)
    result = run(engine=engine, card_tokens=10_000_000, card=slow)
    # Each engine's first load teaches its planner the card's read-back rate; it recomputes
    # from then on, but for a load that measures it again 1, 3 and 7 minutes in (the waits
    # double from engine.load_resample_s, 60 s, as each finds it slow): 4 engines x 4 in
    # these ~10 minutes of arrivals.
    assert result.chose_load <= 4 * 4 and result.chose_recompute > 100


def test_behind_a_slow_card_the_ram_tier_is_still_loaded_from() -> None:
    """The card's part of a hit is read back first, and the planner learns that rate apart
    from the load's: a slow card is not read from, while a prefix in RAM is still loaded."""
    small_gpu = dataclasses.replace(ENGINE.gpu, memory_bytes=ENGINE.model.weight_bytes / 0.9 + 20_000 * 131072)
    engine = dataclasses.replace(ENGINE, gpu=small_gpu)
    slow = CardParams(read_bandwidth_bytes_per_s=1e8, write_bandwidth_bytes_per_s=1e8)
    result = run(engine=engine, card_tokens=10_000_000, card=slow, ram_tokens=50_000)
    assert result.token_hit_rate(Tier.RAM) > 0.1  # Before, one blended rate: 0.8 %, TTFT p50 142 s.
    assert result.token_hit_rate(Tier.CARD) < 0.05
    assert result.chose_load > 100 and result.chose_recompute > 100


def test_prefix_aware_routing_hits_more_on_the_gpus_than_round_robin() -> None:
    aware = run(routing=Routing.PREFIX_AWARE)
    blind = run(routing=Routing.ROUND_ROBIN)
    assert aware.token_hit_rate(Tier.GPU) > blind.token_hit_rate(Tier.GPU)


def test_a_ram_tier_and_slru_run() -> None:
    small_gpu = dataclasses.replace(ENGINE.gpu, memory_bytes=ENGINE.model.weight_bytes / 0.9 + 20_000 * 131072)
    result = run(engine=dataclasses.replace(ENGINE, gpu=small_gpu), ram_tokens=2_000_000, policy=Policy.SLRU)
    assert result.token_hit_rate(Tier.RAM) > 0.3 and result.token_hit_rate(Tier.CARD) == 0
