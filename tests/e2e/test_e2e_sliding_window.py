"""A sliding-window model (a Mistral whose every layer attends to a window: vLLM gives it
one ``SlidingWindowSpec`` cache group), and what activation does where kvharbor cannot serve.

kvharbor stores its chunks as it stores full attention; a restarted engine restores the
prompt's chunks, vLLM holding blocks only inside the window (the null block outside it):
the chunks wholly outside are not read at all. A chunk larger than the window cannot be
served: ``KVHARBOR=1`` alone then starts the engine without the external cache and says
why once (set across a fleet, it must not stop the engines of models kvharbor cannot
serve); a ``--kv-transfer-config`` naming the connector refuses to start (asked for by
name, it never silently caches nothing).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from e2e_harness import Lab, bound, request, tokens
from test_e2e_bad_input import KVHARBOR_TRANSFER

from tests.support.tiny_model import mixed_window_model, sliding_window_model

pytestmark = pytest.mark.e2e

LONG = tokens(1001, seed=40)
WINDOW = 512
OFF = "kvharbor: KVHARBOR=1, but the connector cannot serve this model, so the engine runs without the external"
TOO_LARGE = "sliding-window group 0 (window 256 tokens): engine.chunk_size 512 is larger than the window"


@pytest.fixture(scope="module")
def window_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sliding_window_model(tiny_model, tmp_path_factory.mktemp("models") / "window", window=WINDOW)


@pytest.fixture(scope="module")
def small_window_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sliding_window_model(tiny_model, tmp_path_factory.mktemp("models") / "small-window", window=256)


def test_a_restarted_engine_restores_a_sliding_window_model(lab: Lab, window_model: Path) -> None:
    spec = {"model": str(window_model), "rounds": [[request(LONG)]]}
    first = lab.run(spec).ok()
    assert "kvharbor: group 0: SlidingWindowSpec[" in first.log and f"sliding_window={WINDOW}" in first.log
    assert lab.stored_objects() == len(LONG) // 256
    restarted = lab.run(spec).ok()
    [result] = restarted.requests().values()
    assert result["cached"] == restarted.rounds()[0]["external_hits"] == bound(len(LONG)) == 768
    assert result["tokens"] == first.requests()["0.0"]["tokens"], "restored KV gives what recompute gave"
    # Restoring 768 tokens, vLLM holds blocks only for the window before the next token
    # (tokens 257 .. 767): the first chunk (0 .. 255) lies wholly outside and is not read.
    metrics = restarted.metrics()
    assert metrics["vllm:kvharbor_hit_chunks"] == 3
    assert metrics["vllm:kvharbor_loaded_chunks"] == 2


@pytest.fixture(scope="module")
def mixed_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mixed_window_model(tiny_model, tmp_path_factory.mktemp("models") / "mixed", window=WINDOW)


def test_a_model_mixing_full_and_window_layers_is_restored_group_by_group(
    lab: Lab, mixed_model: Path, tiny_model: Path
) -> None:
    """The connector supports vLLM's hybrid allocator (``SupportsHMA``), so vLLM keeps it on:
    the window layers form a sliding-window group with blocks of its own beside the full
    attention group. A restart restores the full group's blocks of every chunk and the
    window group's only inside its window; the answer is the recompute's."""
    spec = {"model": str(mixed_model), "rounds": [[request(LONG)]]}
    first = lab.run(spec).ok()
    everything = lab.run({"model": str(tiny_model), "rounds": [[request(LONG)]]}, lab.env(kvharbor=False)).ok()
    # The same weights attending to everything answer otherwise: the window layers are windowed.
    assert everything.requests()["0.0"]["tokens"] != first.requests()["0.0"]["tokens"]
    assert "Turning off hybrid kv cache manager" not in first.log
    groups = re.findall(r"kvharbor: group (\d+): (\w+)\[", first.log)
    assert sorted(kind for _, kind in set(groups)) == ["FullAttentionSpec", "SlidingWindowSpec"], groups
    restarted = lab.run(spec).ok()
    [result] = restarted.requests().values()
    assert result["cached"] == restarted.rounds()[0]["external_hits"] == bound(len(LONG)) == 768
    assert result["tokens"] == first.requests()["0.0"]["tokens"], "restored KV gives what recompute gave"
    # Chunk 0 (tokens 0 .. 255) is out of the window at 768, but the full group needs it.
    assert restarted.metrics()["vllm:kvharbor_loaded_chunks"] == 3


def test_kvharbor_env_alone_serves_a_model_it_cannot_without_the_cache(lab: Lab, small_window_model: Path) -> None:
    spec = {"model": str(small_window_model), "rounds": [[request(LONG)], [request(LONG)]]}
    run = lab.run(spec, lab.env(KVHARBOR__ENGINE__CHUNK_SIZE="512")).ok()
    assert run.log.count(OFF) == 1
    assert TOO_LARGE in run.log
    assert all(len(r["tokens"]) == 8 for r in run.requests().values())
    assert [r["external_hits"] for r in run.rounds()] == [0, 0]
    assert run.metrics()["vllm:kvharbor_cache_off"] == 1
    assert not lab.cache.exists(), "kvharbor opened its storage for a model it does not serve"


def test_a_config_naming_the_connector_refuses_to_start(lab: Lab, small_window_model: Path) -> None:
    spec = {
        "model": str(small_window_model),
        "llm": {"kv_transfer_config": KVHARBOR_TRANSFER},
        "rounds": [[request(LONG)]],
    }
    run = lab.run(spec, lab.env(kvharbor=False, KVHARBOR__ENGINE__CHUNK_SIZE="512"))
    assert run.returncode != 0
    assert "kvharbor: the connector refuses to start: " + TOO_LARGE in run.log
    assert "with KVHARBOR=1 alone the engine would start without" in run.log
    assert not run.requests()
