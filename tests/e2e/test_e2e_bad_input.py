"""Bad input: refused at start with a message naming it, or a counted skip; never a failed request."""

from __future__ import annotations

import json

import pytest
from e2e_harness import CHUNK, OFF_LINE, Lab, bound, request, tokens

pytestmark = pytest.mark.e2e

LONG = tokens(1001, seed=30)
SHORT = tokens(100, seed=31)
KVHARBOR_TRANSFER = {
    "kv_connector": "KVHarborConnector",
    "kv_connector_module_path": "kvharbor.connector.vllm.connector",
    "kv_role": "kv_both",
}


def test_unknown_extra_config_key_refuses_start(lab: Lab) -> None:
    transfer = {**KVHARBOR_TRANSFER, "kv_connector_extra_config": {"engine": {"chunk_size": 512}, "chunk_sise": 512}}
    run = lab.run({"llm": {"kv_transfer_config": transfer}, "rounds": [[request(LONG)]]}, lab.env(kvharbor=False))
    assert run.returncode != 0
    assert "kvharbor: the connector refuses to start: kv_connector_extra_config: unknown key(s) chunk_sise" in run.log
    assert not run.requests()
    # The refusal is the whole story: no chained traceback out of kvharbor's config code.
    assert "pydantic" not in run.log
    assert "kvharbor/config.py" not in run.log


def test_short_prompts_and_unsalted_requests_are_counted_skips(lab: Lab) -> None:
    env = lab.env(KVHARBOR__ENGINE__REQUIRE_CACHE_SALT="true")
    rounds = [[request(LONG)], [request(LONG, "t1")], [request(SHORT, "t1")]]
    first = lab.run({"rounds": rounds}, env).ok()
    assert "requests without a cache_salt are neither looked up nor stored" in first.log
    metrics = first.metrics()
    assert metrics["vllm:kvharbor_unsalted_skipped"] == 1
    assert metrics["vllm:kvharbor_short_prompts"] == 1
    assert lab.stored_objects() == len(LONG) // 256  # the salted copy only

    restarted = lab.run({"rounds": rounds}, env).ok()
    assert [r["external_hits"] for r in restarted.rounds()] == [0, bound(len(LONG)), 0]
    assert all(len(r["tokens"]) == 8 for r in restarted.requests().values())
    assert restarted.metrics()["vllm:kvharbor_unsalted_skipped"] == 1


def test_explicit_transfer_config_wins_over_kvharbor_env(lab: Lab) -> None:
    storage = lab.root / "example-connector"
    transfer = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    run = lab.run({"llm": {"kv_transfer_config": transfer}, "rounds": [[request(LONG)]]}).ok()
    assert "explicit --kv-transfer-config (ExampleConnector) was given; it wins" in run.log
    assert "cache tensors registered" not in run.log
    assert any(storage.rglob("*")), "ExampleConnector stored nothing: it was not the connector in use"
    assert not lab.cache.exists(), "kvharbor opened its storage although it was off"


def test_gateway_of_another_release_turns_the_cache_off(lab: Lab) -> None:
    run = lab.run({"release": "0.0.0-other", "rounds": [[request(LONG)], [request(LONG)]]}).ok()
    assert "VERSION_MISMATCH" in run.log
    assert run.log.count(OFF_LINE) == 1
    assert all(len(r["tokens"]) == 8 for r in run.requests().values())
    assert [r["external_hits"] for r in run.rounds()] == [0, 0]
    assert run.metrics()["vllm:kvharbor_cache_off"] == 1
    assert json.dumps(run.requests()["0.0"]["tokens"]) == json.dumps(run.requests()["1.0"]["tokens"])


def test_engine_killed_while_it_saves_reads_nothing_wrong(lab: Lab) -> None:
    """SIGKILL with the step's chunks copied and marked but not committed: the gateway stores
    them from their marks, and a restart restores them with the tokens a recompute gives."""
    lab.config_path = lab.write_config(mode="service")
    gateway = lab.start_gateway()
    killed = lab.run({"rounds": [[request(LONG, max_tokens=1)]], "die_before_commit": True})
    assert killed.returncode == -9, killed.log[-4000:]
    chunks = len(LONG) // CHUNK
    assert killed.record("dying_before_commit")["dying_before_commit"] == chunks
    lab.wait_for_gateway_log(f"stored {chunks} value(s) it had marked complete, refused 0 mark(s)")

    # The same prompt, then under a salt of its own: a recompute, the reference.
    restarted = lab.run({"rounds": [[request(LONG)], [request(LONG, "reference")]]}).ok()
    assert [r["external_hits"] for r in restarted.rounds()] == [bound(len(LONG)), 0]
    results = restarted.requests()
    assert results["0.0"]["tokens"] == results["1.0"]["tokens"] and len(results["0.0"]["tokens"]) == 8
    metrics = restarted.metrics()
    assert metrics["vllm:kvharbor_load_errors"] == 0 and metrics["vllm:kvharbor_cache_off"] == 0
    assert gateway.poll() is None, "the gateway serves on"
