"""The connector's planning inside vLLM's real scheduler: what is loaded, what is saved, and when.

Each test runs vLLM's `Scheduler` step by step (tests/support/vllm_rig.py):
real requests, real block allocation, real prefix caching, chunked prefill
and preemption; only the model is a stand-in; the gateway is real.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput

from kvharbor.connector.vllm.chunks import NULL_BLOCK, leading_nulls, unread_chunks
from kvharbor.connector.vllm.metadata import KVHarborMetadata
from kvharbor.connector.vllm.stats import KVHarborStats, empty
from tests.support.real_gateway import RealGateway
from tests.support.vllm_rig import BLOCK, SchedulerRig

CHUNK = 256


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


def bound(n: int) -> int:
    return min(n // CHUNK * CHUNK, (n - 1) // BLOCK * BLOCK)


def saved_keys(steps: list) -> list[bytes]:
    return [bytes(k) for step in steps for save in step.meta.saves for k in save.keys[0]]


@pytest.fixture
def rig(tiny_model: Path, real_gateway: RealGateway) -> SchedulerRig:
    return SchedulerRig(tiny_model, gateway=real_gateway)


@pytest.mark.parametrize("n", [100, 255, 256, 257, 383, 384, 385, 1001, 1024, 1025])
def test_a_full_store_offers_exactly_the_bound(rig: SchedulerRig, n: int) -> None:
    tokens = prompt(n, seed=n)
    rig.hold(rig.keys(tokens))
    matched, asynchronous = rig.side.get_num_new_matched_tokens(rig.request("r", tokens), 0)
    assert (matched, asynchronous) == (bound(n), False)
    # vLLM may ask again (a request that could not be admitted): same answer, nothing else changes.
    assert rig.side.get_num_new_matched_tokens(rig.request("r", tokens), 0) == (matched, False)


def test_a_miss_saves_each_chunk_once_across_chunked_prefill(tiny_model: Path, real_gateway: RealGateway) -> None:
    rig = SchedulerRig(tiny_model, gateway=real_gateway, max_batched_tokens=512)
    tokens = prompt(1001)
    keys = rig.keys(tokens)
    rig.add("r", tokens, max_tokens=6)
    steps = rig.run()

    assert [s.scheduled("r") for s in steps[:2]] == [512, 489]
    cached = steps[1].output.scheduled_cached_reqs
    assert cached.new_block_ids[0] is not None, "the prompt's second step got no new blocks"
    blocks = list(steps[0].new_request("r").block_ids[0]) + list(cached.new_block_ids[0][0])
    assert len(blocks) == 8
    # Step 1 computed 512 tokens: chunks 0 and 1. Step 2 finished the prompt: chunk 2
    # (1001 tokens hold 3 whole chunks). Each from its own blocks, each once.
    [first] = steps[0].meta.saves
    [second] = steps[1].meta.saves
    assert [bytes(k) for k in first.keys[0]] == keys[:2] and first.block_ids == [blocks[:4]]
    assert [bytes(k) for k in second.keys[0]] == keys[2:] and second.block_ids == [blocks[4:6]]
    # The step that gives the answer's last (6th) token is the one that answers it (whose
    # saves, had they not landed, it would wait for); vLLM computes every token but that one.
    answering = [i for i, s in enumerate(steps) if s.meta.answered]
    assert answering == [6] and steps[6].meta.answered == ["r"]
    assert steps[6].output.scheduled_cached_reqs.num_computed_tokens == [len(tokens) + 6 - 2]
    assert all(not s.meta.saves and not s.meta.loads for s in steps[2:])
    assert rig.gateway.lookups == 1
    assert rig.total(steps, "lookup_chunks") == 3 and rig.total(steps, "hit_chunks") == 0


def test_a_restart_hit_loads_up_to_the_bound_and_saves_nothing_stored(rig: SchedulerRig) -> None:
    tokens = prompt(1024)
    rig.hold(rig.keys(tokens))
    rig.add("r", tokens)
    steps = rig.run()

    first = steps[0]
    new = first.new_request("r")
    assert new.num_computed_tokens == bound(1024) == 896
    assert first.scheduled("r") == 1024 - 896
    [load] = first.meta.loads
    assert [bytes(k) for k in load.keys[0]] == rig.keys(tokens)  # The last chunk is loaded in part.
    assert load.skip_blocks == 0
    assert load.block_ids == [list(new.block_ids[0][:7])]
    assert saved_keys(steps) == []
    assert all(not s.meta.loads for s in steps[1:])


def test_a_partial_store_loads_what_it_has_and_saves_the_rest(rig: SchedulerRig) -> None:
    tokens = prompt(1001)
    keys = rig.keys(tokens)
    rig.hold(keys[:2])
    rig.add("r", tokens)
    steps = rig.run()

    [load] = steps[0].meta.loads
    assert [bytes(k) for k in load.keys[0]] == keys[:2]
    assert steps[0].new_request("r").num_computed_tokens == 512
    assert saved_keys(steps) == keys[2:]


def test_a_load_starts_where_vllms_own_prefix_cache_ends(rig: SchedulerRig) -> None:
    full = prompt(1024, seed=1)
    rig.add("partial", full[:400] + prompt(100, seed=2))
    rig.run()  # Its blocks stay in vLLM's prefix cache: 3 full blocks of `full`.
    rig.hold(rig.keys(full))
    local = rig.scheduler.kv_cache_manager.get_computed_blocks(rig.request("probe", full))[1]
    assert local == 3 * BLOCK

    rig.add("full", full)
    step = rig.step()
    new = step.new_request("full")
    blocks = list(new.block_ids[0])
    assert new.num_computed_tokens == bound(1024)
    [load] = step.meta.loads
    # Local hit 384 tokens = 3 blocks = chunk 0 and half of chunk 1: load the rest of
    # chunk 1 (skipping its first block), chunk 2, and chunk 3 up to the bound.
    assert load.skip_blocks == 1
    assert [bytes(k) for k in load.keys[0]] == rig.keys(full)[1:4]
    assert load.block_ids == [blocks[3:7]]


def test_a_salt_changes_every_key_and_a_required_salt_skips_the_rest(
    tiny_model: Path, real_gateway: RealGateway
) -> None:
    rig = SchedulerRig(tiny_model, gateway=real_gateway, engine={"require_cache_salt": True})
    tokens = prompt(600)
    assert set(rig.keys(tokens, "tenantA")).isdisjoint(rig.keys(tokens, "tenantB"))
    assert set(rig.keys(tokens, "tenantA")).isdisjoint(rig.keys(tokens))

    rig.hold(rig.keys(tokens))
    rig.add("unsalted", tokens)
    rig.add("salted", tokens, salt="tenantA")
    steps = rig.run()

    assert steps[0].new_request("unsalted").num_computed_tokens == 0
    assert steps[0].new_request("salted").num_computed_tokens == 0
    assert rig.gateway.lookups == 1  # The salted request only.
    assert saved_keys(steps) == rig.keys(tokens, "tenantA")
    # vLLM asked about the unsalted request once per step until admission; counted once.
    assert rig.side.counters.unsalted_skipped == 1
    assert rig.total(steps, "unsalted_skipped") == 1
    assert rig.total(steps, "lookups") == 1
    assert rig.total(steps, "hit_chunks") == 0


def test_a_preempted_request_resumes_from_its_saved_chunks(tiny_model: Path, real_gateway: RealGateway) -> None:
    # 16 usable blocks: two prompts of 8 blocks fill them; when both need a 9th
    # block to decode, vLLM preempts the later one and frees its blocks.
    rig = SchedulerRig(tiny_model, gateway=real_gateway, num_blocks=17, prefix_caching=False)
    long, other = prompt(1000, seed=3), prompt(900, seed=4)
    rig.add("long", long, max_tokens=60)
    rig.add("other", other, max_tokens=60)
    steps = rig.run()

    preempted = [i for i, s in enumerate(steps) if "other" in (s.output.preempted_req_ids or set())]
    assert preempted, "the rig did not preempt: the test proves nothing"
    [resume] = [s for s in steps[preempted[0] :] if "other" in s.output.scheduled_cached_reqs.resumed_req_ids]
    cached = resume.output.scheduled_cached_reqs
    resumed = cached.new_block_ids[cached.req_ids.index("other")]
    assert resumed is not None, "the resumed request got no blocks"
    blocks = list(resumed[0])
    # Its prompt chunks were saved during its first prefill: they come back into its new blocks.
    [load] = resume.meta.loads
    assert load.request_id == "other"
    assert [bytes(k) for k in load.keys[0]] == rig.keys(other)
    assert load.block_ids == [blocks[:6]]
    assert resume.scheduled("other") == len(other) + cached.num_output_tokens[cached.req_ids.index("other")] - 768
    # Every chunk of both prompts saved exactly once (the rig also refuses a repeat).
    assert sorted(saved_keys(steps)) == sorted(rig.keys(long) + rig.keys(other))


def test_a_dead_gateway_is_a_miss_not_an_error(rig: SchedulerRig) -> None:
    tokens = prompt(1001)
    rig.hold(rig.keys(tokens))
    rig.gateway.stop()
    rig.add("r", tokens)
    steps = rig.run()
    assert steps[0].new_request("r").num_computed_tokens == 0
    assert rig.side.link.is_off
    assert steps[-1].stats["cache_off"] == 1


def worker_reports(
    load_errors: Callable[[KVHarborMetadata], list[set[int]]] = lambda meta: [set(), set()],
    cache_off: tuple[int, int] = (0, 0),
) -> Callable[[KVHarborMetadata], list[Any]]:
    """What each of two workers' connectors reports in a step (vLLM's `KVConnectorOutput`)."""

    def reports(meta: KVHarborMetadata) -> list[Any]:
        return [
            KVConnectorOutput(invalid_block_ids=e, kv_connector_stats=KVHarborStats(data={**empty(), "cache_off": o}))
            for e, o in zip(load_errors(meta), cache_off, strict=True)
        ]

    return reports


def test_a_block_one_rank_could_not_restore_is_recomputed_on_every_rank(rig: SchedulerRig) -> None:
    # What tensor parallelism relies on, checked against the installed vLLM: the executor
    # unions the workers' load errors, and the scheduler recomputes from the first one (for
    # every rank: they all run the step it schedules).
    tokens = prompt(1001)
    rig.hold(rig.keys(tokens))
    rig.add("r", tokens)
    # Rank 0 restored all 3 chunks, rank 1 only chunk 0.
    first = rig.step(workers=worker_reports(lambda meta: [set(), set(meta.loads[0].block_ids[0][2:])]))
    [load] = first.meta.loads
    assert first.new_request("r").num_computed_tokens == 768 and load.blocks == 6
    assert rig.requests["r"].num_output_tokens == 0  # The step's sampled token is discarded ...
    again = rig.step()
    cached = again.output.scheduled_cached_reqs
    assert cached.req_ids == ["r"] and cached.num_computed_tokens == [256]  # ... and chunk 1 on is recomputed.
    assert again.scheduled("r") == 1001 - 256
    assert not again.meta.loads


def test_a_worker_reporting_the_cache_off_stops_restores_and_marks_one_step(rig: SchedulerRig) -> None:
    stored, later = prompt(1001, seed=1), prompt(1001, seed=2)
    rig.hold(rig.keys(stored) + rig.keys(later))
    rig.add("a", stored)
    assert rig.step(workers=worker_reports(cache_off=(0, 1))).meta.loads  # Planned before any worker was off.
    rig.add("b", later)
    marked = rig.step()
    assert marked.meta.cache_off == "a worker reported it off"
    assert marked.new_request("b").num_computed_tokens == 0 and not marked.meta.loads  # Recomputed, not restored.
    steps = rig.run()
    assert all(not s.meta.cache_off and not s.meta.loads for s in steps)  # Marked once.


def test_the_schedulers_own_failure_marks_one_step_too(rig: SchedulerRig) -> None:
    tokens = prompt(600)
    rig.gateway.stop()
    rig.add("r", tokens)
    first = rig.step()
    assert first.meta.cache_off.startswith("the scheduler's gateway link failed (")
    assert all(not s.meta.cache_off for s in rig.run())


def test_a_salt_that_is_not_a_string_is_a_counted_skip(rig: SchedulerRig) -> None:
    tokens = prompt(600)
    rig.hold(rig.keys(tokens))
    request = rig.request("r", tokens)
    request.cache_salt = 42  # type: ignore[assignment]  # What a front end might pass through.
    assert rig.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert rig.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert rig.side.counters.bad_salt_skipped == 1
    assert rig.gateway.lookups == 0


def test_a_sliding_window_request_saves_live_blocks_and_restores_into_the_window(
    tiny_model: Path, real_gateway: RealGateway
) -> None:
    """vLLM's own scheduler with a sliding-window cache (512 tokens, 128-token blocks): it
    frees blocks out of the window as the prefill goes, and pads a restore's with its null
    block. kvharbor saves each chunk from live blocks in the step that computes it, and a
    restore's chunks wholly out of the window are not read."""
    rig = SchedulerRig(tiny_model, gateway=real_gateway, max_batched_tokens=512, sliding_window=512)
    tokens = prompt(1500)
    keys = rig.keys(tokens)
    rig.add("cold", tokens, max_tokens=2)
    steps = rig.run()
    assert saved_keys(steps) == keys  # 5 whole chunks, each once.
    assert all(NULL_BLOCK not in save.block_ids[0] for step in steps for save in step.meta.saves)
    assert rig.total(steps, "window_unsaved") == 0

    restart = SchedulerRig(tiny_model, gateway=real_gateway, sliding_window=512)
    request = restart.request("warm", tokens)
    matched, _ = restart.side.get_num_new_matched_tokens(request, 0)
    assert matched == bound(1500) == 1280
    restart.add("warm", tokens, max_tokens=2)
    (load,) = restart.step().meta.loads
    # 1280 restored tokens: the window before the next token holds tokens 769 .. 1279, so
    # vLLM holds no block for the first 6 (768 tokens): chunks 0 .. 2 are not read.
    assert leading_nulls(load.block_ids[0]) == 6 and NULL_BLOCK not in load.block_ids[0][6:]
    assert unread_chunks(restart.layout.blocks_per_chunk, load.skip_blocks, load.block_ids) == 3


def test_a_hybrid_request_moves_every_groups_blocks_and_the_window_groups_only_in_its_window(
    tiny_model: Path, real_gateway: RealGateway
) -> None:
    """vLLM's own scheduler with its hybrid allocator: a full-attention group and a 512-token
    sliding-window group, each with blocks of its own. Saves carry both groups' live blocks of
    each chunk; a restore carries the full group's blocks of every chunk and the window
    group's only in its window (null before), so every chunk is read."""
    rig = SchedulerRig(tiny_model, gateway=real_gateway, max_batched_tokens=512, sliding_window=512, hybrid=True)
    tokens = prompt(1500)
    keys = rig.keys(tokens)
    rig.add("cold", tokens, max_tokens=2)
    steps = rig.run()
    assert saved_keys(steps) == keys  # 5 whole chunks, each once.
    saves = [save for step in steps for save in step.meta.saves]
    assert all(len(save.block_ids) == 2 and NULL_BLOCK not in save.block_ids[1] for save in saves)
    assert all(set(save.block_ids[0]).isdisjoint(save.block_ids[1]) for save in saves)  # blocks of their own
    assert rig.total(steps, "window_unsaved") == 0

    restart = SchedulerRig(tiny_model, gateway=real_gateway, sliding_window=512, hybrid=True)
    request = restart.request("warm", tokens)
    assert restart.side.get_num_new_matched_tokens(request, 0)[0] == bound(1500) == 1280
    restart.add("warm", tokens, max_tokens=2)
    (load,) = restart.step().meta.loads
    full, window = load.block_ids
    assert len(full) == len(window) == 10 and NULL_BLOCK not in full
    assert leading_nulls(window) == 6 and NULL_BLOCK not in window[6:]
    assert unread_chunks(restart.layout.blocks_per_chunk, load.skip_blocks, load.block_ids) == 0


# -- a hybrid model: a Mamba-type group beside full attention --------------------------


@pytest.fixture
def mamba_rig(tiny_model: Path, real_gateway: RealGateway) -> SchedulerRig:
    """Chunks of one block, as kvharbor chooses for hybrid models (their blocks are larger)."""
    return SchedulerRig(tiny_model, gateway=real_gateway, mamba=True, engine={"chunk_size": BLOCK})


def test_a_hybrid_prompt_stores_the_state_where_its_step_ends_on_a_chunk_end(mamba_rig: SchedulerRig) -> None:
    tokens = prompt(1001)
    mamba_rig.add("r", tokens)
    steps = mamba_rig.run()
    # vLLM ends the first step at the prompt's last block boundary (896): 7 chunks, and
    # the state there, from the Mamba group's block at index 6; the next step completes no chunk.
    assert [s.scheduled("r") for s in steps[:2]] == [896, 105]
    [save] = steps[0].meta.saves
    assert [bytes(k) for k in save.keys[0]] == mamba_rig.keys(tokens)[:7]
    mamba_ids, attention_ids = (list(ids) for ids in steps[0].new_request("r").block_ids)
    assert save.block_ids == [attention_ids[:7]], "a chunk object holds the attention group's blocks"
    assert save.state is not None
    assert [bytes(k) for k in save.state.keys[0]] == [mamba_rig.state_keys(tokens)[6]]
    assert save.state.block_ids == [[mamba_ids[6]]] and mamba_ids[6] != NULL_BLOCK
    assert all(not s.meta.saves for s in steps[1:])


def test_a_hybrid_restore_ends_at_the_last_chunk_with_a_stored_state(mamba_rig: SchedulerRig) -> None:
    tokens = prompt(1001)
    mamba_rig.hold(mamba_rig.keys(tokens))
    mamba_rig.hold_states([mamba_rig.state_keys(tokens)[i] for i in (2, 4)])
    request = mamba_rig.add("r", tokens)
    # Stored: 7 chunks (the bound), states after chunks 3 and 5: the restore ends after chunk 5.
    step = mamba_rig.step()
    [load] = step.meta.loads
    # Several cache groups: vLLM holds the request back while it loads (it can recompute
    # a failed load of such a model only when it is reported by request).
    assert load.asynchronous and step.scheduled("r") == 0 and request.num_computed_tokens == 5 * BLOCK
    assert [bytes(k) for k in load.keys[0]] == mamba_rig.keys(tokens)[:5]
    assert load.state is not None and [bytes(k) for k in load.state.keys[0]] == [mamba_rig.state_keys(tokens)[4]]
    mamba_ids = mamba_rig.block_ids("r")  # The Mamba-type group's.
    assert load.state.block_ids == [[mamba_ids[4]]] and mamba_ids[4] != NULL_BLOCK
    assert step.stats["stateless_chunks"] == 2 and step.stats["hit_chunks"] == 5
    # Loaded (the rig's worker reports it): the next step computes on from the restore's end.
    assert mamba_rig.step().new_request("r").num_computed_tokens == 5 * BLOCK


def test_a_hybrid_prompt_without_a_stored_state_is_not_restored(mamba_rig: SchedulerRig) -> None:
    tokens = prompt(1001)
    mamba_rig.hold(mamba_rig.keys(tokens))
    request = mamba_rig.request("r", tokens)
    assert mamba_rig.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert mamba_rig.side.counters.stateless_chunks == 7
    # vLLM asks again while the request waits for blocks: its chunks are counted once.
    assert mamba_rig.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert mamba_rig.side.counters.stateless_chunks == 7
