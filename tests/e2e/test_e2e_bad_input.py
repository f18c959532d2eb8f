"""Bad input: refused at start with a message naming it, or a counted skip; never a failed request."""

from __future__ import annotations

import json

import pytest
from e2e_harness import OFF_LINE, Lab, bound, request, tokens

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
