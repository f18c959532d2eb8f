"""The gateway killed while requests flow: the engine keeps serving, and says so once."""

from __future__ import annotations

import pytest
from e2e_harness import OFF_LINE, Lab, request, tokens

pytestmark = pytest.mark.e2e

STORED = [tokens(600, seed=20 + i) for i in range(4)]
FRESH = [tokens(600, seed=40 + i) for i in range(8)]


def test_gateway_killed_mid_stream(lab: Lab) -> None:
    # A RAM tier first: its hits are promised at once (verified when written), so the stream's
    # first step restores before the kill; a file-only hit would first be read back.
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.25},
        {"name": "local", "type": "file", "path": str(lab.cache), "capacity_gb": 2},
    ]
    lab.config_path = lab.write_config(mode="service", tiers=tiers)
    gateway = lab.start_gateway()
    spec = {
        # vLLM's own prefix cache off: the repeated prompts must come from kvharbor.
        "llm": {"enable_prefix_caching": False},
        "rounds": [[request(p) for p in STORED]],
        "stream": {
            "requests": [request(p) for p in STORED + FRESH],
            "gateway_pid": gateway.pid,
            "kill_after_steps": 1,
        },
    }
    run = lab.run(spec).ok()

    assert run.rounds()[0]["external_hits"] == 0
    kill = run.record("killed_gateway_after_steps")
    assert kill["unfinished_at_kill"] == len(STORED) + len(FRESH)
    assert gateway.poll() == -9
    results = run.requests()
    streamed = {tag: r for tag, r in results.items() if tag.startswith("s")}
    assert len(streamed) == len(STORED) + len(FRESH)
    assert all(r["finished"] and len(r["tokens"]) == 8 for r in streamed.values())
    # Restored before the kill or recomputed after it: either way the same tokens.
    for i in range(len(STORED)):
        assert streamed[f"s{i}"]["tokens"] == results[f"0.{i}"]["tokens"]

    assert run.log.count(OFF_LINE) == 1, run.log
    metrics = run.metrics()
    assert metrics["vllm:kvharbor_cache_off"] == 1
    assert metrics["vllm:kvharbor_loaded_chunks"] > 0  # the stream did restore before the kill
