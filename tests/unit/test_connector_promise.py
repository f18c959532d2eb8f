"""A promise is kept: vLLM is told a chunk is cached only once it is known intact.

vLLM's real scheduler (tests/support/vllm_rig.py) against a real gateway: a
RAM tier in shared memory (hits promised at once), or a file tier only, as
after a restart (hits read back in full first, while vLLM is told "not known
yet"). Damage is real: objects rewritten on disk with a flipped byte.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvharbor.cache.bandwidth import LoadPlanner
from kvharbor.connector.vllm.costs import chunk_bytes_per_rank, prefill_cost
from tests.support.damage import damage_file_objects
from tests.support.real_gateway import RealGateway
from tests.support.vllm_rig import BLOCK, SchedulerRig, Step

CHUNK = 256


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


def bound(n: int) -> int:
    return min(n // CHUNK * CHUNK, (n - 1) // BLOCK * BLOCK)


def saved_keys(steps: list[Step]) -> list[bytes]:
    return [bytes(k) for step in steps for save in step.meta.saves for k in save.keys[0]]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    return tmp_path / "files"


@pytest.fixture
def files_gateway(tmp_path: Path, files: Path) -> Iterator[RealGateway]:
    """A gateway with a file tier only: what a restarted gateway without RAM holds."""
    tier = {"name": "local", "type": "file", "path": str(files), "capacity_gb": 1}
    gateway = RealGateway(tmp_path / "gateway", tiers=[tier]).start()
    try:
        yield gateway
    finally:
        gateway.close()


def admit_after_read_back(rig: SchedulerRig, req_id: str, tokens: list[int]) -> list[Step]:
    """Add a request whose stored chunks are on files: vLLM cannot schedule it until they are
    read back (it asks again each step), then it runs to the end."""
    rig.add(req_id, tokens)
    waiting = rig.step()
    assert waiting.scheduled(req_id) == 0 and waiting.new_request(req_id) is None
    rig.wait_read_back(req_id)
    return rig.run()


def test_chunks_on_files_are_promised_once_read_back(tiny_model: Path, files_gateway: RealGateway) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway)
    tokens = prompt(1001)
    rig.hold(rig.keys(tokens))

    steps = admit_after_read_back(rig, "r", tokens)

    assert steps[0].new_request("r").num_computed_tokens == bound(1001) == 768
    [load] = steps[0].meta.loads
    assert [bytes(k) for k in load.keys[0]] == rig.keys(tokens)
    assert saved_keys(steps) == []
    counters = rig.side.counters
    assert (counters.hit_chunks, counters.verified_chunks, counters.unverified_chunks) == (3, 3, 0)
    assert rig.gateway.lookups == 1  # vLLM asked twice; one lookup, one read-back.


def test_a_store_damaged_on_disk_is_not_promised_and_is_stored_again_at_once(
    tiny_model: Path, files_gateway: RealGateway, files: Path
) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway, prefix_caching=False)
    tokens = prompt(1024)
    keys = rig.keys(tokens)
    rig.hold(keys)
    assert damage_file_objects(files) == 4

    steps = admit_after_read_back(rig, "r", tokens)

    # Nothing promised: vLLM computes the whole prompt and reports nothing cached.
    assert steps[0].new_request("r").num_computed_tokens == 0
    assert all(not s.meta.loads for s in steps)
    # The first chunk failed its read-back; it and the three behind it were dropped, so
    # every chunk is stored again from the recomputed KV (the rig's worker checks each
    # lands as a new value).
    assert saved_keys(steps) == keys
    counters = rig.side.counters
    assert (counters.hit_chunks, counters.verified_chunks, counters.unverified_chunks) == (0, 0, 4)

    # Healed: the next request of the prompt is read back intact and restored to the bound.
    steps = admit_after_read_back(rig, "again", tokens)
    assert steps[0].new_request("again").num_computed_tokens == bound(1024)
    assert saved_keys(steps) == []


def test_a_chunk_damaged_mid_prompt_ends_the_promise_there(
    tiny_model: Path, files_gateway: RealGateway, files: Path
) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway)
    tokens = prompt(1024, seed=1)
    keys = rig.keys(tokens)
    rig.hold(keys)
    assert damage_file_objects(files, only={keys[2]}) == 1

    steps = admit_after_read_back(rig, "r", tokens)

    assert steps[0].new_request("r").num_computed_tokens == 2 * CHUNK
    [load] = steps[0].meta.loads
    assert [bytes(k) for k in load.keys[0]] == keys[:2]
    assert saved_keys(steps) == keys[2:]  # The damaged chunk and the one behind it.
    assert (rig.side.counters.verified_chunks, rig.side.counters.unverified_chunks) == (2, 2)


def test_without_a_wait_only_chunks_in_ram_are_promised(tiny_model: Path, files_gateway: RealGateway) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway, engine={"verify_wait_ms": 0})
    tokens = prompt(1001)
    rig.hold(rig.keys(tokens))
    assert rig.side.get_num_new_matched_tokens(rig.request("r", tokens), 0) == (0, False)
    assert rig.side.counters.unverified_chunks == 3


def test_chunks_in_ram_are_promised_at_once_and_a_wrong_size_is_no_hit(rig: SchedulerRig) -> None:
    tokens, other = prompt(1001), prompt(1001, seed=5)
    rig.hold(rig.keys(tokens))
    rig.gateway.hold(rig.keys(other), b"short", fingerprint=rig.layout.digests[0])

    assert rig.side.get_num_new_matched_tokens(rig.request("r", tokens), 0) == (bound(1001), False)
    assert rig.side.get_num_new_matched_tokens(rig.request("o", other), 0) == (0, False)
    assert rig.side.counters.verified_chunks == rig.side.counters.unverified_chunks == 0


def test_a_load_that_fails_after_its_promise_is_recomputed_and_saved_again(
    rig: SchedulerRig, real_gateway: RealGateway
) -> None:
    tokens = prompt(600)
    keys = rig.keys(tokens)
    rig.hold(keys)
    rig.add("r", tokens)
    # Promised in full; then the worker finds chunk 1 damaged as it loads (and the gateway
    # drops a damaged chunk).
    first = rig.step(load_errors=lambda meta: set(meta.loads[0].block_ids[0][2:]))
    assert first.new_request("r").num_computed_tokens == 2 * CHUNK
    assert saved_keys([first]) == []
    client = real_gateway.client()
    client.drop([keys[1]])
    client.close()

    steps = rig.run()
    # vLLM recomputes from chunk 1's first block; chunk 1 is saved again from that KV.
    assert steps[0].scheduled("r") == len(tokens) - CHUNK
    assert saved_keys(steps) == keys[1:]


def test_a_hybrid_models_load_that_fails_is_recomputed_whole_and_saved_again(
    tiny_model: Path, real_gateway: RealGateway
) -> None:
    """Several cache groups: the load is asynchronous, a failed one is reported by request,
    and vLLM recomputes the request from its start (the engine keeps serving it)."""
    rig = SchedulerRig(tiny_model, gateway=real_gateway, mamba=True, engine={"chunk_size": BLOCK})
    tokens = prompt(1001)
    keys = rig.keys(tokens)
    rig.hold(keys)
    rig.hold_states([rig.state_keys(tokens)[6]])
    rig.add("r", tokens)
    # Promised in full (7 chunks and the state at their end); the worker's load falls short.
    first = rig.step(load_errors=lambda meta: {meta.loads[0].block_ids[0][3]})
    [load] = first.meta.loads
    assert load.asynchronous and first.scheduled("r") == 0
    client = real_gateway.client()
    client.drop(keys[3:])  # As after a damaged chunk: not stored any more.
    client.close()

    steps = rig.run()
    # Recomputed from the start, never offered a load again; the chunks are stored again.
    assert steps[0].new_request("r").num_computed_tokens == 0
    assert all(not step.meta.loads for step in steps)
    assert saved_keys(steps) == keys[:7]


@pytest.fixture
def rig(tiny_model: Path, real_gateway: RealGateway) -> SchedulerRig:
    return SchedulerRig(tiny_model, gateway=real_gateway)


def test_an_idle_step_waits_for_the_read_back_instead_of_spinning(tiny_model: Path, files_gateway: RealGateway) -> None:
    """A step with nothing to run gives the verifier's thread the interpreter: it returns
    with the read-back finished (its bound here is far beyond any read-back's time)."""
    rig = SchedulerRig(tiny_model, gateway=files_gateway, engine={"verify_idle_wait_ms": 600_000})
    tokens = prompt(1001)
    rig.hold(rig.keys(tokens))
    rig.add("r", tokens)

    idle = rig.step()

    assert idle.scheduled("r") == 0
    job = rig.side._requests["r"].verification
    assert job is not None and job.done.is_set() and job.verified == 3
    steps = rig.run()
    assert steps[0].new_request("r").num_computed_tokens == bound(1001)


WINDOW = 512
"""Tokens of the rig's sliding window (128-token blocks): a restore of 1,280 tokens needs the
blocks of tokens 769 .. 1279, so its chunks 0 .. 2 are never read (see test_connector_scheduler)."""


def test_a_sliding_window_reads_back_only_the_chunks_a_restore_reads(
    tiny_model: Path, files_gateway: RealGateway, files: Path
) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway, sliding_window=WINDOW)
    tokens = prompt(1500, seed=2)
    keys = rig.keys(tokens)
    rig.hold(keys)
    # Damage no restore reads: the first chunk lies wholly before the window.
    assert damage_file_objects(files, only={keys[0]}) == 1

    steps = admit_after_read_back(rig, "r", tokens)

    assert steps[0].new_request("r").num_computed_tokens == bound(1500) == 1280
    counters = rig.side.counters
    # Chunks 3 and 4 read back; all five promised (vLLM holds no block of the first three).
    assert (counters.hit_chunks, counters.verified_chunks, counters.unverified_chunks) == (5, 2, 0)
    assert saved_keys(steps) == []


def test_a_sliding_window_read_back_that_fails_promises_only_what_needed_none(
    tiny_model: Path, files_gateway: RealGateway, files: Path
) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway, sliding_window=WINDOW, prefix_caching=False)
    tokens = prompt(1500, seed=3)
    keys = rig.keys(tokens)
    rig.hold(keys)
    assert damage_file_objects(files, only={keys[4]}) == 1

    steps = admit_after_read_back(rig, "r", tokens)

    # Chunk 3 read back intact, chunk 4 not. A promise of 4 chunks (1,024 tokens) would need
    # the window's chunk 2, never read back: nothing is promised, the prompt is computed.
    assert steps[0].new_request("r").num_computed_tokens == 0
    assert all(not s.meta.loads for s in steps)
    counters = rig.side.counters
    assert (counters.hit_chunks, counters.verified_chunks, counters.unverified_chunks) == (0, 1, 5)
    assert saved_keys(steps) == keys[4:]  # The damaged chunk was dropped and is stored again.


def planner_for(rig: SchedulerRig, recompute_s: float, tokens: int) -> LoadPlanner:
    """The connector's planner for the rig's model, its rates as if measured: loads from RAM
    at 50 GB/s, ``tokens`` recomputed in ``recompute_s``."""
    cost = prefill_cost(rig.vllm_config)
    assert cost is not None
    return LoadPlanner(
        cost,
        chunk_bytes_per_rank(rig.layout),
        CHUNK,
        load_prior_bytes_per_s=50e9,
        prefill_prior_flops_per_s=cost.flops(0, tokens) / recompute_s,
    )


@pytest.mark.parametrize(("read_back_s", "restored"), [(10.0, 0), (0.01, bound(2400))])
def test_chunks_on_files_are_read_back_only_when_that_is_faster_than_recomputing_them(
    tiny_model: Path, files_gateway: RealGateway, read_back_s: float, restored: int
) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway)
    tokens = prompt(2400)
    rig.hold(rig.keys(tokens))
    rig.side.planner = planner = planner_for(rig, recompute_s=1.0, tokens=bound(2400))
    # Read-backs measured before: 64 MiB in ``read_back_s``; this prompt's 9 MiB then take
    # 1.4 s (slower than its 1 s recompute: not read back) or 1.4 ms.
    planner.observe_read_back(64 << 20, read_back_s)

    if restored:
        steps = admit_after_read_back(rig, "r", tokens)
    else:
        rig.add("r", tokens)
        steps = rig.run()

    assert steps[0].new_request("r").num_computed_tokens == restored
    counters = rig.side.counters
    if restored:
        assert (counters.verified_chunks, counters.read_back_skipped_chunks) == (9, 0)
        assert planner.read_back_rate.samples == 2  # This read-back was timed too.
    else:
        assert rig.side._requests.get("r") is None or rig.side._requests["r"].verification is None
        assert (counters.verified_chunks, counters.read_back_skipped_chunks) == (0, 9)
        assert counters.chose_recompute == 1
        assert saved_keys(steps) == []  # Still stored: nothing to store again.


def test_a_read_back_teaches_the_planner_its_rate(tiny_model: Path, files_gateway: RealGateway) -> None:
    rig = SchedulerRig(tiny_model, gateway=files_gateway)
    tokens = prompt(2400)
    rig.hold(rig.keys(tokens))
    rig.side.planner = planner = planner_for(rig, recompute_s=100.0, tokens=bound(2400))
    assert planner.read_back_rate.rate is None

    steps = admit_after_read_back(rig, "r", tokens)

    assert steps[0].new_request("r").num_computed_tokens == bound(2400) == 9 * CHUNK
    assert planner.read_back_rate.samples == 1
    rate = planner.read_back_rate.rate
    assert rate is not None and rate > 0
    # What the planner predicts for these 9 chunks is what the read-back took, at most.
    assert 9 * rig.layout.chunk_bytes / rate < 100.0


def test_a_read_back_slower_than_recomputing_is_cut_after_its_first_request(
    tiny_model: Path, files_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """No read-back rate known yet, so the chunks on files are read back; after the first
    request's 8 chunks the rate seen says the other 7 arrive slower than vLLM recomputes them
    (here, in a microsecond): those are left stored and unread, and recomputed."""
    rig = SchedulerRig(tiny_model, gateway=files_gateway)
    tokens = prompt(3900)
    rig.hold(rig.keys(tokens))
    cost = prefill_cost(rig.vllm_config)
    assert cost is not None
    rig.side.planner = LoadPlanner(
        cost, chunk_bytes_per_rank(rig.layout), CHUNK, prefill_prior_flops_per_s=cost.flops(0, 3840) / 1e-6
    )

    with caplog.at_level(logging.INFO, logger="kvharbor"):
        steps = admit_after_read_back(rig, "r", tokens)

    assert bound(3900) == 15 * CHUNK
    assert steps[0].new_request("r").num_computed_tokens == 8 * CHUNK
    counters = rig.side.counters
    assert (counters.verified_chunks, counters.read_back_skipped_chunks, counters.unverified_chunks) == (8, 7, 0)
    assert saved_keys(steps) == []  # The unread chunks are still stored: not stored again.
    said = [r.getMessage() for r in caplog.records if "read-back from a tier outside RAM was stopped" in r.getMessage()]
    assert len(said) == 1 and "after 8 of 15 chunks" in said[0]
