"""The planner against the real system: a trace replayed through a real gateway with a
simulated card tier, by the scenarios' lightweight engine, hits what `kvharbor plan`
predicts for the same capacity.

The gateway runs for real (its own socket, shared memory, a card tier ``device:
sim:PARAMS.yaml`` whose tier budget holds exactly ``CAPACITY_CHUNKS`` values, the
card itself larger, so the tier's own LRU decides what stays). The engine is the
scenarios' `LightEngine`: vLLM's connector code (the scheduler half's lookup, hit
bound and read-back of chunks outside RAM, the workers' loads and saves) without
vLLM. Each of the first ``REQUESTS`` of the Mooncake conversation trace becomes a
prompt whose every ``BLOCK_TOKENS``-token block is a pure function of its hash id,
so prompts share a prefix exactly where the trace's hash ids do, and the engine's
own chunk keys (prefix-chained over the tokens) follow the trace's reuse.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvharbor.cache.format import HEADER_BYTES
from kvharbor.config import GIB, load_config
from kvharbor.scenario.drivers.light import LightEngine
from kvharbor.scenario.schema import EngineSetup
from kvharbor.sim.caches import Policy
from kvharbor.sim.sweep import sweep
from kvharbor.sim.workload import Request, read_trace
from tests.support.real_gateway import RealGateway
from tests.support.traces import mooncake_trace

BLOCK_TOKENS = 512
REQUESTS = 800
CAPACITY_CHUNKS = 5000
ENGINE = EngineSetup(chunk_size=BLOCK_TOKENS, block_size=16, layers=1, kv_heads=1, head_size=4)
"""A chunk of this shape is 2 (K, V) x 512 tokens x 4 x 2 bytes = 8 KiB: the trace's traffic stays small."""


def prompt(request: Request) -> list[int]:
    """The request's token ids: block i holds ids that only its hash id gives."""
    tokens = [hash_id * BLOCK_TOKENS + j for hash_id in request.blocks for j in range(BLOCK_TOKENS)]
    return tokens[: request.input_tokens]


def test_the_light_engine_through_a_real_gateway_and_simulated_card_hits_what_the_planner_predicts(
    tmp_path: Path,
) -> None:
    requests = read_trace(mooncake_trace(), BLOCK_TOKENS)[:REQUESTS]
    chunk_bytes = 2 * BLOCK_TOKENS * ENGINE.kv_heads * ENGINE.head_size * 2 * ENGINE.layers
    params = tmp_path / "card.yaml"
    params.write_text(yaml.safe_dump({"capacity_bytes": 2 * CAPACITY_CHUNKS * chunk_bytes, "time_scale": 0.001}))
    tier_gb = CAPACITY_CHUNKS * (chunk_bytes + HEADER_BYTES) / GIB
    tiers = [{"name": "card", "type": "nvme", "device": f"sim:{params}", "capacity_gb": tier_gb}]
    gateway = RealGateway(tmp_path / "gateway", tiers=tiers).start()
    engine_section = {"engine": {"chunk_size": ENGINE.chunk_size}}
    config = load_config(gateway.config_path, environ={}, overrides=engine_section)
    try:
        engine = LightEngine(config, ENGINE, "planner-check")
        try:
            outcomes = [engine.request(f"r{i}", prompt(r), None) for i, r in enumerate(requests)]
            assert not engine.cache_off, engine.off_reason
        finally:
            engine.close()
        gateway.settle()
        (card,) = gateway.status().store.tiers
    finally:
        gateway.close()
    assert engine.layout.chunk_bytes == chunk_bytes, "the tier's budget is counted in this engine's chunks"
    assert card.keys == CAPACITY_CHUNKS, "the tier's budget holds exactly the planned capacity, and it filled"
    assert sum(o.wrong_bytes for o in outcomes) == 0
    measured = sum(o.cached_tokens for o in outcomes) / sum(o.prompt_tokens for o in outcomes)
    (predicted,) = sweep(requests, [CAPACITY_CHUNKS * BLOCK_TOKENS], BLOCK_TOKENS, Policy.LRU)
    assert predicted.prompt_tokens == sum(o.prompt_tokens for o in outcomes)
    print(f"planner {predicted.token_hit_rate:.4f} vs light engine {measured:.4f} at {CAPACITY_CHUNKS} chunks")
    assert measured > 0.05, "the capacity is one where the cache matters"
    assert abs(predicted.token_hit_rate - measured) <= 0.02
