"""Tensor parallel (TP=2) on the vLLM CPU build: a restart restores both ranks' shards, and one rank
losing its gateway link turns the cache off on both, with unchanged output.

Two engine processes (each TP=2 start is expensive on two cores): the first
stores (its outputs are the TP=2 recompute the second must match), the second
restores after the restart, then has rank 1's connections hung up by the
gateway between two rounds.
"""

from __future__ import annotations

import pytest
from e2e_harness import BLOCK, CHUNK, OFF_LINE, Lab, bound, request, tokens

pytestmark = pytest.mark.e2e

RANKS = 2
TP = {"tensor_parallel_size": RANKS, "distributed_executor_backend": "mp", "enable_prefix_caching": False}
"""vLLM's own prefix cache off: a repeated prompt must come from kvharbor."""
RESTORED = tokens(1001, seed=60)
"""Asked after the restart: restored to the bound, 3 chunks per rank."""
FAILED = tokens(1001, seed=61)
"""Asked after rank 1 lost its links: planned as a restore, recomputed on both ranks."""
FRESH = tokens(600, seed=62)
"""Asked once the cache is off: served, and stored by neither rank."""


def test_tensor_parallel_restart_hit_and_one_ranks_failure(lab: Lab) -> None:
    lab.config_path = lab.write_config(mode="service")
    gateway = lab.start_gateway()
    # One core per rank: vLLM's CPU workers refuse to share these machines' single NUMA node otherwise.
    env = lab.env(VLLM_CPU_OMP_THREADS_BIND="0|1")

    stored = lab.run({"llm": TP, "rounds": [[request(RESTORED)], [request(FAILED)]]}, env).ok()
    assert all(f"cache tensors registered (rank {rank}," in stored.log for rank in range(RANKS))
    expected = [r["tokens"] for r in stored.requests().values()]
    assert [r["external_hits"] for r in stored.rounds()] == [0, 0]
    objects = RANKS * (len(RESTORED) // CHUNK + len(FAILED) // CHUNK)
    assert lab.stored_objects() == objects  # Each rank's shard of each chunk, once.

    cut = {"gateway_pid": gateway.pid, "gateway_log": str(lab.root / "gateway.log"), "after_round": 0}
    rounds_after = [[request(RESTORED)], [request(FAILED)], [request(FRESH)]]
    restarted = lab.run({"llm": TP, "rounds": rounds_after, "hang_up": {**cut, "client": "vllm-worker rank 1 "}}, env)
    results = list(restarted.ok().requests().values())
    rounds = restarted.rounds()

    # (a) The restart: both ranks' shards restored to the bound, the output of the TP=2 recompute.
    assert results[0]["cached"] == rounds[0]["external_hits"] == bound(len(RESTORED)) == 768
    assert results[0]["tokens"] == expected[0]

    # (b) Rank 1's load and save connections hung up: its restore of FAILED fails, rank 0's is
    # discarded with it, both ranks report the blocks and vLLM recomputes them on both.
    assert restarted.record("hung_up")["hung_up"] == 2
    assert results[1]["tokens"] == expected[1]
    assert restarted.log.count(OFF_LINE) == RANKS, restarted.log[-8000:]  # Once per rank ...
    assert restarted.log.count("rank 1 of 2 turned it off first (") == 1  # ... rank 0 naming rank 1.
    metrics = restarted.metrics()
    assert metrics["vllm:kvharbor_cache_off"] == 1
    # Load errors of FAILED's blocks only, reported by both ranks: RESTORED came whole from both.
    assert metrics["vllm:kvharbor_load_errors"] == RANKS * bound(len(FAILED)) // BLOCK
    # The engine kept serving, with the cache off on rank 0 too: FRESH was stored by neither rank.
    assert results[2]["finished"] and len(results[2]["tokens"]) == 8
    assert lab.stored_objects() == objects
