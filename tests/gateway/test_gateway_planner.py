"""The planner against the real system: a trace replayed through a real gateway with a
simulated card tier hits what `kvharbor plan` predicts for the same capacity.

The gateway runs for real (its own socket, shared memory, a card tier ``device:
sim:PARAMS.yaml`` whose tier budget holds exactly ``CAPACITY_BLOCKS`` values, the
card itself larger, so the tier's own LRU decides what stays). The test drives a
real gateway client as an engine's connector does, per request of the first
``REQUESTS`` of the Mooncake conversation trace: LOOKUP the chunk keys (one per
hash id), GET and RELEASE the hits (which touches them tail-first), PUT the
prompt's whole chunks that missed. Keys are derived from the trace's hash ids.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvharbor.cache.format import HEADER_BYTES
from kvharbor.config import GIB
from kvharbor.sim.caches import Policy, hit_tokens, stored_blocks
from kvharbor.sim.sweep import sweep
from kvharbor.sim.workload import read_trace
from tests.support.real_gateway import RealGateway
from tests.support.traces import mooncake_trace

BLOCK_TOKENS = 512
REQUESTS = 800
CAPACITY_BLOCKS = 5000
VALUE_BYTES = 1024
FINGERPRINT = bytes(range(16))


def chunk_key(hash_id: int) -> bytes:
    return b"kvh-plan" + hash_id.to_bytes(8, "big")


def test_a_real_gateway_with_a_simulated_card_hits_what_the_planner_predicts(tmp_path: Path) -> None:
    requests = read_trace(mooncake_trace(), BLOCK_TOKENS)[:REQUESTS]
    params = tmp_path / "card.yaml"
    params.write_text(yaml.safe_dump({"capacity_bytes": 64 << 20, "time_scale": 0.001}))
    entry_bytes = VALUE_BYTES + HEADER_BYTES
    tiers = [
        {
            "name": "card",
            "type": "nvme",
            "device": f"sim:{params}",
            "capacity_gb": CAPACITY_BLOCKS * entry_bytes / GIB,
        }
    ]
    gateway = RealGateway(tmp_path / "gateway", tiers=tiers).start()
    try:
        client = gateway.client("planner-check")
        measured = 0
        for request in requests:
            keys = [chunk_key(h) for h in request.blocks]
            hits = client.lookup(keys)
            measured += hit_tokens(request.input_tokens, hits, BLOCK_TOKENS)
            if hits:
                batch = client.get(FINGERPRINT, keys[:hits])
                assert len(batch.views) == hits, "a chunk LOOKUP found was not served"
                client.release(batch)
            misses = list(stored_blocks(request.input_tokens, keys, BLOCK_TOKENS))[hits:]
            if misses:
                put = client.prepare_put(FINGERPRINT, [(key, VALUE_BYTES) for key in misses])
                for view in put.views:
                    if view is not None:
                        view[:] = b"\x5a" * VALUE_BYTES
                client.commit_put(put)
        (card,) = gateway.status().store.tiers
        client.close()
    finally:
        gateway.close()
    assert card.keys == CAPACITY_BLOCKS, "the tier's budget holds exactly the planned capacity, and it filled"
    (predicted,) = sweep(requests, [CAPACITY_BLOCKS * BLOCK_TOKENS], BLOCK_TOKENS, Policy.LRU)
    measured_rate = measured / predicted.prompt_tokens
    print(f"planner {predicted.token_hit_rate:.4f} vs real gateway {measured_rate:.4f} at {CAPACITY_BLOCKS} chunks")
    assert measured_rate > 0.05, "the capacity is one where the cache matters"
    assert abs(predicted.token_hit_rate - measured_rate) <= 0.02
