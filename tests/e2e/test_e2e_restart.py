"""A restart hit with the offline `LLM`: what one process stored, a fresh one restores.

Also the worst case for the load plan: a prompt whose start vLLM's own prefix
cache holds (ending inside a chunk) and whose rest comes from kvharbor.
"""

from __future__ import annotations

import pytest
from e2e_harness import BLOCK, CHUNK, Lab, bound, request, tokens

pytestmark = pytest.mark.e2e

LONG = tokens(1001, seed=1)
"""Bounded by whole chunks: 3 x 256 = 768 of 1001."""
ROUND = tokens(1024, seed=2)
"""Four whole chunks, bounded by the last position: 7 x 128 = 896 of 1024."""
PARTIAL = ROUND[:400] + tokens(100, seed=3)
"""Shares 400 tokens with ROUND: once it ran, vLLM's own cache holds 3 of ROUND's blocks."""


def test_restart_restores_the_bound_with_identical_output(lab: Lab) -> None:
    rounds = {"rounds": [[request(LONG)], [request(PARTIAL)], [request(ROUND)]]}
    reference = lab.run(rounds, lab.env(kvharbor=False)).ok()
    assert "kvharbor" not in reference.log.replace("kvharbor.yaml", "")
    expected = {tag: r["tokens"] for tag, r in reference.requests().items()}

    first = lab.run({"rounds": [[request(LONG)], [request(ROUND)]]}).ok()
    assert "kvharbor: 4 cache tensors registered" in first.log
    assert [r["external_hits"] for r in first.rounds()] == [0, 0]
    assert lab.stored_objects() == len(LONG) // CHUNK + len(ROUND) // CHUNK  # Each full chunk, once.

    restarted = lab.run(rounds).ok()
    results = restarted.requests()
    hits = [r["external_hits"] for r in restarted.rounds()]

    # The long prompt: everything that can be restored is, from the file tier.
    assert results["0.0"]["cached"] == bound(len(LONG)) == 768
    assert hits[0] == bound(len(LONG))
    # PARTIAL: its first chunk is ROUND's, stored by the first process.
    assert results["1.0"]["cached"] == hits[1] == CHUNK
    # ROUND: vLLM's own cache holds 3 blocks (from PARTIAL); kvharbor restores the
    # rest up to the bound, starting mid-chunk and ending mid-chunk.
    local = len(ROUND[:400]) // BLOCK * BLOCK
    assert results["2.0"]["cached"] == bound(len(ROUND)) == 896
    assert hits[2] == bound(len(ROUND)) - local

    # Restored KV is the KV the model computes: greedy float32 output is identical.
    assert {tag: r["tokens"] for tag, r in results.items()} == expected
    assert all(len(t) == 8 for t in expected.values())
    metrics = restarted.metrics()
    assert metrics["vllm:kvharbor_loaded_chunks"] == 3 + 1 + 3
    assert metrics["vllm:kvharbor_load_errors"] == 0
    assert metrics["vllm:kvharbor_cache_off"] == 0
