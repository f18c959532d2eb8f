"""A model whose KV cache kvharbor cannot exchange (a sliding-window model): activation decides.

``KVHARBOR=1`` alone starts the engine without the external cache and says why once (set
across a fleet, it must not stop the engines of models kvharbor cannot serve); a
``--kv-transfer-config`` naming the connector refuses to start (asked for by name, it never
silently caches nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import Lab, request, tokens
from test_e2e_bad_input import KVHARBOR_TRANSFER

from tests.support.tiny_model import sliding_window_model

pytestmark = pytest.mark.e2e

LONG = tokens(1001, seed=40)
OFF = "kvharbor: KVHARBOR=1, but the connector cannot serve this model, so the engine runs without the external"
GROUP = "group 0 SlidingWindowSpec (layer model.layers.0.self_attn.attn)"


@pytest.fixture(scope="module")
def window_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sliding_window_model(tiny_model, tmp_path_factory.mktemp("models") / "window", window=256)


def test_kvharbor_env_alone_serves_the_model_without_the_cache(lab: Lab, window_model: Path) -> None:
    run = lab.run({"model": str(window_model), "rounds": [[request(LONG)], [request(LONG)]]}).ok()
    assert run.log.count(OFF) == 1
    assert GROUP in run.log
    assert all(len(r["tokens"]) == 8 for r in run.requests().values())
    assert [r["external_hits"] for r in run.rounds()] == [0, 0]
    assert run.metrics()["vllm:kvharbor_cache_off"] == 1
    assert not lab.cache.exists(), "kvharbor opened its storage for a model it does not serve"


def test_a_config_naming_the_connector_refuses_to_start(lab: Lab, window_model: Path) -> None:
    spec = {"model": str(window_model), "llm": {"kv_transfer_config": KVHARBOR_TRANSFER}, "rounds": [[request(LONG)]]}
    run = lab.run(spec, lab.env(kvharbor=False))
    assert run.returncode != 0
    assert "kvharbor: the connector refuses to start: KV cache registry: 1 of 1 cache group(s)" in run.log
    assert GROUP in run.log and "with KVHARBOR=1 alone the engine would start without" in run.log
    assert not run.requests()
