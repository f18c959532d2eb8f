"""A restart hit with the offline `LLM`: what one process stored, a fresh one restores.

Also the worst case for the load plan: a prompt whose start vLLM's own prefix
cache holds (ending inside a chunk) and whose rest comes from kvharbor; and
a store damaged on disk: nothing of it is promised, and it heals at once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_harness import BLOCK, CHUNK, Lab, bound, request, tokens

from kvharbor.gateway.status import GatewayStatus
from tests.support.damage import damage_file_objects

pytestmark = pytest.mark.e2e

LONG = tokens(1001, seed=1)
"""Bounded by whole chunks: 3 x 256 = 768 of 1001."""
ROUND = tokens(1024, seed=2)
"""Four whole chunks, bounded by the last position: 7 x 128 = 896 of 1024."""
PARTIAL = ROUND[:400] + tokens(100, seed=3)
"""Shares 400 tokens with ROUND: once it ran, vLLM's own cache holds 3 of ROUND's blocks."""


def kvharbor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvharbor", *args], capture_output=True, text=True, timeout=120)


def test_restart_restores_the_bound_with_identical_output(lab: Lab) -> None:
    rounds = {"rounds": [[request(LONG)], [request(PARTIAL)], [request(ROUND)]]}
    reference = lab.run(rounds, lab.env(kvharbor=False)).ok()
    # No line of kvharbor's (the checkout's own path may hold the word: a clone named kvharbor).
    assert "kvharbor: " not in reference.log
    expected = {tag: r["tokens"] for tag, r in reference.requests().items()}

    first = lab.run({"rounds": [[request(LONG)], [request(ROUND)]]}).ok()
    assert "kvharbor: 4 cache tensors registered" in first.log
    # Each cache group said once at start: the tiny model's one group of its 4 layers.
    assert "kvharbor: group 0: FullAttentionSpec[4](bs=128," in first.log
    assert first.log.count("kvharbor: group ") == 1
    assert [r["external_hits"] for r in first.rounds()] == [0, 0]
    assert lab.stored_objects() == len(LONG) // CHUNK + len(ROUND) // CHUNK  # Each full chunk, once.
    # The engine registered its real vLLM layout with the (lingering) gateway: status names
    # it, and doctor computes LONG's keys under it and finds every chunk.
    status = GatewayStatus.from_json(kvharbor_cli("status", "--config", str(lab.config_path), "--json").stdout)
    assert [layout.fingerprint.kv_shapes[0].split("[")[0] for layout in status.layouts] == ["FullAttentionSpec"]
    prompt = lab.root / "long.json"
    prompt.write_text(json.dumps(LONG))
    doctor = kvharbor_cli("doctor", "--config", str(lab.config_path), "--prompt-file", str(prompt))
    assert doctor.returncode == 0 and "chunks 0-2 (tokens 0-767): local" in doctor.stdout, doctor.stdout

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
    # From the file tier only: each was read back in full before it was promised.
    assert metrics["vllm:kvharbor_verified_chunks"] == 3 + 1 + 3
    assert metrics["vllm:kvharbor_load_errors"] == 0
    assert metrics["vllm:kvharbor_cache_off"] == 0

    # Every stored object damaged on disk: nothing is promised (what vLLM reports as
    # cached is what was restored: nothing), the output is the same, and the chunks
    # recomputed are stored again in the same request, so the next run hits in full.
    assert damage_file_objects(lab.cache) == len(LONG) // CHUNK + len(ROUND) // CHUNK
    damaged = lab.run({"rounds": [[request(LONG)]]}).ok()
    [result] = damaged.requests().values()
    assert result["cached"] == 0 and damaged.rounds()[0]["external_hits"] == 0
    assert result["tokens"] == expected["0.0"]
    metrics = damaged.metrics()
    assert metrics["vllm:kvharbor_hit_chunks"] == metrics["vllm:kvharbor_loaded_chunks"] == 0
    assert metrics["vllm:kvharbor_unverified_chunks"] == 3
    assert "a stored chunk failed its read-back" in damaged.log

    healed = lab.run({"rounds": [[request(LONG)]]}).ok()
    [result] = healed.requests().values()
    assert result["cached"] == healed.rounds()[0]["external_hits"] == bound(len(LONG))
    assert result["tokens"] == expected["0.0"]
    assert healed.metrics()["vllm:kvharbor_loaded_chunks"] == 3


def test_blocks_larger_than_the_default_chunk_choose_whole_block_chunks(lab: Lab) -> None:
    """Hybrid models run with large blocks; with engine.chunk_size unset the chunk becomes
    whole blocks (here one 512-token block) instead of refusing the model."""
    large = {"llm": {"block_size": 512}, "rounds": [[request(LONG)]]}
    first = lab.run(large).ok()
    assert "kvharbor: engine.chunk_size is unset: chunks of 512 tokens (whole 512-token blocks of vLLM;" in first.log
    assert lab.stored_objects() == len(LONG) // 512
    restarted = lab.run(large).ok()
    assert restarted.rounds()[0]["external_hits"] == bound(len(LONG), chunk=512, block=512) == 512
    assert restarted.requests()["0.0"]["tokens"] == first.requests()["0.0"]["tokens"]
