"""The worker half on CPU tensors: save, then load in a new worker; partial chunks; what a failed load reports."""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvharbor.cache.purge import PurgeFilter
from kvharbor.config import Config
from kvharbor.connector.link import CacheLink, RankSwitch
from kvharbor.connector.vllm.layout import ConnectorRefusal
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.stats import KVHarborPromMetrics, KVHarborStats
from kvharbor.connector.vllm.worker import WorkerSide
from kvharbor.gateway.client import GatewayRefused
from kvharbor.gateway.protocol import ErrorCode
from tests.gateway.gateway_harness import WAIT_S
from tests.support.real_gateway import RealGateway
from tests.support.stand_ins import LAYERS, layout

NUM_BLOCKS = 16
K0, K1, MISSING = (bytes([i]) * 16 for i in (1, 2, 3))


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout for the stand-in engine: (blocks, 2 KV heads, 128 tokens, 2 x 64)."""
    storage = torch.zeros(len(LAYERS), NUM_BLOCKS, 2, 128, 128)
    if seed is not None:
        storage.copy_(torch.randn(storage.shape, generator=torch.Generator().manual_seed(seed)))
    return dict(zip(LAYERS, storage.unbind(0), strict=True))


def worker(gateway: RealGateway, kv: dict[str, torch.Tensor], **engine: Any) -> WorkerSide:
    """A worker on ``kv``; ``engine``: settings of the engine section to change."""
    config = gateway.config
    if engine:
        config = Config.model_validate({**config.model_dump(), "engine": {**config.engine.model_dump(), **engine}})
    switch = RankSwitch()
    side = WorkerSide(
        layout(),
        config,
        CacheLink(config, "load", switch=switch),
        CacheLink(config, "save", switch=switch),
        rank=0,
    )
    side.register(kv, NUM_BLOCKS)
    return side


def transfer(keys: list[bytes], blocks: list[int], skip: int = 0) -> ChunkTransfer:
    return ChunkTransfer(request_id="r", keys=[keys], block_ids=[blocks], skip_blocks=skip)


def saved(gateway: RealGateway, source: dict[str, torch.Tensor]) -> None:
    """Chunks K0 (blocks 1, 2) and K1 (blocks 3, 4) of ``source``, saved and committed."""
    puts = gateway.puts
    side = worker(gateway, source)
    side.save(KVHarborMetadata(saves=[transfer([K0, K1], [1, 2, 3, 4])]))
    side.close()  # Waits for the background commit.
    assert gateway.puts - puts == 2 and gateway.holds([K0, K1]) == 2  # K0 and K1, each once.


def same_pages(
    a: dict[str, torch.Tensor], a_blocks: list[int], b: dict[str, torch.Tensor], b_blocks: list[int]
) -> bool:
    return all(torch.equal(a[n][torch.tensor(a_blocks)], b[n][torch.tensor(b_blocks)]) for n in LAYERS)


def test_saved_chunks_load_into_other_blocks_of_a_new_worker(real_gateway: RealGateway) -> None:
    gateway, source, target = real_gateway, caches(seed=1), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    side.load(KVHarborMetadata(loads=[transfer([K0, K1], [9, 5, 12, 7])]))
    assert same_pages(target, [9, 5, 12, 7], source, [1, 2, 3, 4])
    assert side.take_load_errors() == set()
    stats = side.take_stats()
    page = 2 * 128 * 128 * 4  # 2 KV heads x 128 tokens x (K and V of 64) x float32
    assert stats["loaded_chunks"] == 2 and stats["loaded_bytes"] == 2 * len(LAYERS) * 2 * page
    assert stats["cache_off"] == 0


def test_the_load_batch_and_save_queue_settings_are_used(real_gateway: RealGateway) -> None:
    gateway, source, target = real_gateway, caches(seed=5), caches(seed=None)
    saved(gateway, source)
    default = worker(gateway, caches(seed=None))
    side = worker(gateway, target, load_batch_mb=1, save_queue_steps_max=3)  # a chunk is 1 MiB here
    try:
        assert default._path is not None and side._path is not None
        assert (default._path.copy.chunks_per_load, side._path.copy.chunks_per_load) == (256, 1)
        assert (default._saves.maxsize, side._saves.maxsize) == (64, 3)
        side.load(KVHarborMetadata(loads=[transfer([K0, K1], [9, 5, 12, 7])]))  # in two gateway requests
        assert same_pages(target, [9, 5, 12, 7], source, [1, 2, 3, 4])
        assert side.take_load_errors() == set()
    finally:
        default.close()
        side.close()


def test_a_load_may_start_and_end_inside_a_chunk(real_gateway: RealGateway) -> None:
    gateway, source, target = real_gateway, caches(seed=2), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    # The engine's own cache holds chunk 0's first block; the bound stops before K1's last block.
    side.load(KVHarborMetadata(loads=[transfer([K0, K1], [10, 11], skip=1)]))
    assert same_pages(target, [10, 11], source, [2, 3])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (10, 11)]
    assert all(not target[n][untouched].any() for n in LAYERS)
    assert side.take_load_errors() == set()


def test_blocks_the_cache_cannot_deliver_are_reported_for_recompute(real_gateway: RealGateway) -> None:
    gateway, source, target = real_gateway, caches(seed=3), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    side.load(KVHarborMetadata(loads=[transfer([K0, MISSING], [5, 6, 7, 8])]))
    assert same_pages(target, [5, 6], source, [1, 2])
    assert side.take_load_errors() == {7, 8}
    assert side.take_load_errors() == set()  # Reported once.
    assert side.take_stats()["load_errors"] == 2


def test_a_request_whose_load_falls_short_stores_nothing_of_that_step(real_gateway: RealGateway) -> None:
    gateway = real_gateway
    saved(gateway, caches(seed=5))
    side = worker(gateway, caches(seed=None))
    later, other = bytes([4]) * 16, bytes([5]) * 16
    # Request r's load stops at its second chunk; the step also completes r's next chunk,
    # computed over the blocks that did not load, and a chunk of another request.
    meta = KVHarborMetadata(
        loads=[transfer([K0, MISSING], [5, 6, 7, 8])],
        saves=[transfer([later], [9, 10]), ChunkTransfer(request_id="other", keys=[[other]], block_ids=[[11, 12]])],
    )
    side.load(meta)
    side.save(meta)
    side.close()  # Waits for the background commit.
    assert gateway.holds([other]) == 1
    assert gateway.holds([later]) == 0  # Its KV is wrong: recomputed by vLLM, saved then.


def test_a_value_of_another_size_is_never_copied_in(real_gateway: RealGateway) -> None:
    gateway, target = real_gateway, caches(seed=None)
    gateway.hold([K0], b"\x7f" * 1000, fingerprint=layout().digests[0])  # The worker's own fingerprint.
    side = worker(gateway, target)
    side.load(KVHarborMetadata(loads=[transfer([K0], [5, 6])]))
    assert side.take_load_errors() == {5, 6}
    assert all(not t.any() for t in target.values())


def test_a_dead_gateway_fails_loads_not_the_step(tmp_path: Path) -> None:
    # A file tier keeps what was stored across the gateway's death, so what it holds can be read after.
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.25},
        {"name": "disk", "type": "file", "path": str(tmp_path / "disk"), "capacity_gb": 0.25, "fsync": False},
    ]
    gateway, source, target = RealGateway(tmp_path / "gateway", tiers=tiers).start(), caches(seed=4), caches(seed=None)
    try:
        dead_gateway_fails_loads_not_the_step(gateway, source, target)
    finally:
        gateway.close()


def dead_gateway_fails_loads_not_the_step(
    gateway: RealGateway, source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]
) -> None:
    saved(gateway, source)
    side = worker(gateway, target)
    gateway.stop()
    side.load(KVHarborMetadata(loads=[transfer([K0, K1], [5, 6, 7, 8])]))
    side.save(KVHarborMetadata(saves=[transfer([MISSING], [1, 2])]))
    assert side.take_load_errors() == {5, 6, 7, 8}
    assert side.take_stats()["cache_off"] == 1
    assert side.take_stats()["cache_off"] == 1  # Every step from now on, not only the failing one.
    side.close()
    gateway.start()  # The same storage, served again: the saves before the death are there, the one after is not.
    assert gateway.holds([K0, K1]) == 2
    assert gateway.holds([MISSING]) == 0


def test_an_asynchronous_load_is_reported_by_request_also_when_it_falls_short(real_gateway: RealGateway) -> None:
    """vLLM holds such a request back until the load is reported, and recomputes one reported
    failed; a failed block is not reported for it (vLLM cannot map blocks back to requests
    when there are several cache groups)."""
    source, target = caches(seed=7), caches(seed=None)
    saved(real_gateway, source)
    side = worker(real_gateway, target)
    whole = ChunkTransfer(request_id="whole", keys=[[K0, K1]], block_ids=[[5, 6, 7, 8]], asynchronous=True)
    short = ChunkTransfer(request_id="short", keys=[[K0, MISSING]], block_ids=[[9, 10, 11, 12]], asynchronous=True)
    side.load(KVHarborMetadata(loads=[whole, short]))
    received = side.take_received()
    assert received.done == {"whole", "short"} and received.failed == {"short"}
    assert side.take_load_errors() == set()
    assert all(torch.equal(target[name][5:9], source[name][1:5]) for name in LAYERS)
    assert side.take_received().done == set()  # Each reported once.
    side.close()


def test_the_report_that_says_no_save_is_pending_counts_every_commit(real_gateway: RealGateway) -> None:
    """What keeps vLLM stepping until ``stored_chunks`` includes the last commit (see `worker`)."""
    side = worker(real_gateway, caches(seed=5))
    side.save(KVHarborMetadata(saves=[transfer([K0, K1], [1, 2, 3, 4])]))
    first = side.take_stats()  # The commit runs behind: it may or may not be counted yet.
    side.close()  # Waits for it.
    last = side.take_stats()
    assert first["saves_pending"] in (0, 1) and last["saves_pending"] == 0
    if first["saves_pending"] == 0:
        assert first["stored_chunks"] == 2, "a report without pending saves has counted them"
    assert first["stored_chunks"] + last["stored_chunks"] == 2
    assert first["saves"] + last["saves"] == 1


def test_what_a_worker_saves_records_its_namespace_for_purge(real_gateway: RealGateway) -> None:
    saved(real_gateway, caches(seed=6))
    client = real_gateway.client()
    try:
        # The stand-in engine's layout has the default engine.key_namespace.
        ours = client.purge(PurgeFilter(namespace="default"), apply=False)
        other = client.purge(PurgeFilter(namespace="another"), apply=False)
    finally:
        client.close()
    assert ours.objects == 2 and not ours.applied
    assert other.objects == 0 and sum(t.namespace_unknown for t in other.tiers) == 0
    assert real_gateway.holds([K0, K1]) == 2  # Dry runs: nothing removed.


def test_a_restore_prepared_at_the_step_start_runs_on_the_loader_thread(real_gateway: RealGateway) -> None:
    """``handle_preemptions`` (`WorkerSide.prepare_load`) starts the step's restore; the
    engine's thread goes on (the model runner prepares the step's inputs) and `load` then
    only waits for it and reports what it restored."""
    gateway, source, target = real_gateway, caches(seed=7), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    try:
        meta = KVHarborMetadata(loads=[transfer([K0, MISSING], [9, 5, 12, 7])])
        threads: list[str] = []
        path = side._path
        assert path is not None
        real_load = path.load

        def load(*args: Any) -> int:
            threads.append(threading.current_thread().name)
            return real_load(*args)

        path.load = load  # type: ignore[assignment]
        side.prepare_load(meta)
        assert side._loading is not None
        assert side._loading.restores is not None
        assert side._loading.restores.done.result(timeout=60) == [2]  # Done before `load` is called.
        assert same_pages(target, [9, 5], source, [1, 2])
        assert side.take_load_errors() == set()  # Known only once the step's `load` took it.
        side.load(meta)
        assert len(threads) == 1 and threads[0].startswith("kvharbor-loader"), threads  # Not restored twice.
        assert side.take_load_errors() == {12, 7}
        assert side.take_stats()["loaded_chunks"] == 1
    finally:
        side.close()


def held_flush(side: WorkerSide, held: int, release: threading.Event) -> list[bool]:
    """The worker's copy made to hold its flush number ``held`` (from 1) until ``release`` is
    set (60 s at most); returned: per held flush, whether ``release`` came."""
    path = side._path
    assert path is not None
    copy, real_flush, came = path.copy, path.copy.flush_load, []
    flushes = 0

    def flush_load(mapping: Any) -> Any:
        nonlocal flushes
        flushes += 1
        if flushes == held:
            came.append(release.wait(60))
        return real_flush(mapping)

    copy.flush_load = flush_load  # type: ignore[method-assign]
    return came


def test_a_restore_prepared_early_returns_once_its_first_copies_are_under_way(real_gateway: RealGateway) -> None:
    """The engine's thread waits in `prepare_load` until the loader's copies are as far ahead as
    they get (on a CPU, whose loader makes them in its flush: the first request's; on a GPU
    `test_datapath`'s ``ahead`` test): busy in Python, it would otherwise keep the
    interpreter from the loader."""
    gateway, source, target = real_gateway, caches(seed=9), caches(seed=None)
    saved(gateway, source)
    # One chunk per request, streamed chunk by chunk (none held for a layered copy).
    side = worker(gateway, target, load_batch_mb=1, load_start_wait_ms=60_000, load_layered_mb=0)
    release = threading.Event()
    try:
        came = held_flush(side, 2, release)
        meta = KVHarborMetadata(loads=[transfer([K0, K1], [9, 5, 12, 7])])
        side.prepare_load(meta)
        first_copied = same_pages(target, [9, 5], source, [1, 2])
        second_untouched = all(not target[n][[12, 7]].any() for n in LAYERS)
        release.set()
        assert first_copied and second_untouched
        side.load(meta)
        assert came == [True]
        assert same_pages(target, [9, 5, 12, 7], source, [1, 2, 3, 4])
        assert side.take_load_errors() == set()
    finally:
        release.set()
        side.close()


def test_a_first_copy_that_does_not_come_holds_the_engine_no_longer_than_the_start_wait(
    real_gateway: RealGateway,
) -> None:
    gateway, source, target = real_gateway, caches(seed=10), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target, load_start_wait_ms=1, load_layered_mb=0)
    release = threading.Event()
    try:
        came = held_flush(side, 1, release)  # The first request's copy waits for this thread.
        meta = KVHarborMetadata(loads=[transfer([K0, K1], [9, 5, 12, 7])])
        side.prepare_load(meta)  # Returns after its 1 ms, the copy still held.
        release.set()
        side.load(meta)
        assert came == [True]  # Released by this thread, after `prepare_load` had returned.
        assert same_pages(target, [9, 5, 12, 7], source, [1, 2, 3, 4])
    finally:
        release.set()
        side.close()


def test_a_layered_restore_lets_the_step_go_on_once_the_gateway_answered(real_gateway: RealGateway) -> None:
    """The last requests of an early restore (here all: ``engine.load_layered_mb`` covers them)
    are copied layer by layer after the gateway answered them: `load` returns then, and the
    forward pass waits for each layer's copies (`wait_layer`) while the rest are made."""
    gateway, source, target = real_gateway, caches(seed=11), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    release = threading.Event()
    try:
        path = side._path
        assert path is not None
        copy, real_flush = path.copy, path.copy.flush_held

        def flush_held(mapping: Any) -> Any:
            assert release.wait(60)
            return real_flush(mapping)

        copy.flush_held = flush_held  # type: ignore[method-assign]
        meta = KVHarborMetadata(loads=[transfer([K0, K1], [9, 5, 12, 7])])
        side.prepare_load(meta)
        side.begin_step(meta)
        side.load(meta)  # Answered: the held copies wait for this thread.
        assert all(not target[n][[9, 5, 12, 7]].any() for n in LAYERS)
        layer = threading.Thread(target=side.wait_layer, args=(LAYERS[1],))
        layer.start()
        layer.join(0.05)
        assert layer.is_alive()  # The forward pass at its second layer: waiting for its copies.
        release.set()
        layer.join(30)
        assert not layer.is_alive() and same_pages(target, [9, 5, 12, 7], source, [1, 2, 3, 4])
        side.save(meta)
        assert side.take_load_errors() == set()
        stats = side.take_stats()
        assert (stats["loads"], stats["loaded_chunks"], stats["load_errors"]) == (1, 2, 0)
    finally:
        release.set()
        side.close()


def test_a_restore_that_falls_short_after_the_answer_is_recomputed_and_not_saved(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway answered a restore in full, then refuses to take back the room of its held
    request after the copy (the bytes may not have been the gateway's to read): the forward pass
    has run over the restore, so its blocks are reported after it (vLLM discards the step's
    answer and recomputes) and the request's chunks of that step are not stored; the cache
    stays on, and another request's chunk of the step is stored."""
    gateway, source, target = real_gateway, caches(seed=12), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    try:
        client = side._load_link._client
        assert client is not None

        def refuse(batch: Any) -> None:
            raise GatewayRefused(ErrorCode.BUSY, "busy")

        client.release = refuse  # type: ignore[method-assign]
        later, other = bytes([6]) * 16, bytes([7]) * 16
        meta = KVHarborMetadata(
            loads=[transfer([K0, K1], [9, 5, 12, 7])],
            saves=[transfer([later], [13, 14]), ChunkTransfer(request_id="other", keys=[[other]], block_ids=[[1, 2]])],
        )
        side.prepare_load(meta)
        side.begin_step(meta)
        side.load(meta)
        assert [s.request_id for s in meta.saves] == ["r", "other"]  # Answered in full: saves stand, so far.
        with caplog.at_level(logging.WARNING, "kvharbor"):
            side.save(meta)
        assert side.take_load_errors() == {9, 5, 12, 7}
        stats = side.take_stats()
        assert (stats["load_errors"], stats["cache_off"]) == (4, 0)
        assert sum("fell short" in r.getMessage() for r in caplog.records) == 1
    finally:
        side.close()
    assert (gateway.holds([later]), gateway.holds([other])) == (0, 1)


def test_a_restore_prepared_for_a_step_that_never_ran_is_not_taken_for_the_next(real_gateway: RealGateway) -> None:
    gateway, source, target = real_gateway, caches(seed=8), caches(seed=None)
    saved(gateway, source)
    side = worker(gateway, target)
    try:
        side.prepare_load(KVHarborMetadata(loads=[transfer([K0], [9, 5])]))
        other = KVHarborMetadata(loads=[transfer([K1], [12, 7])])
        side.load(other)  # Not the prepared step's metadata: restored now, from its own plan.
        assert same_pages(target, [12, 7], source, [3, 4])
        assert side.take_load_errors() == set()
        assert side._loading is None
    finally:
        side.close()


def test_a_worker_that_stays_off_restores_nothing_and_stores_nothing(real_gateway: RealGateway) -> None:
    """What only the registered tensors show (here: layers of two dtypes) refuses this rank's
    cache; under KVHARBOR=1 alone the engine runs on: restores planned before the scheduler
    learns it are reported for recompute, saves store nothing, the stats say the cache is off."""
    kv = caches(seed=1)
    kv[LAYERS[-1]] = kv[LAYERS[-1]].to(torch.float16)
    config = real_gateway.config
    switch = RankSwitch()
    side = WorkerSide(
        layout(), config, CacheLink(config, "load", switch=switch), CacheLink(config, "save", switch=switch), 0
    )
    with pytest.raises(ConnectorRefusal, match="differ in page shape or dtype"):
        side.register(kv, NUM_BLOCKS)
    side.stay_off("layers of two dtypes")
    puts, connects = real_gateway.puts, real_gateway.connects

    meta = KVHarborMetadata(loads=[transfer([K0, K1], [5, 6, 7, 8])], saves=[transfer([K0], [1, 2])])
    side.prepare_load(meta)
    side.begin_step(meta)
    side.load(meta)
    side.save(meta)
    assert side.take_load_errors() == {5, 6, 7, 8}
    assert side.take_stats()["cache_off"] == 1
    side.close()
    assert (real_gateway.puts, real_gateway.connects) == (puts, connects)  # Never connected, nothing stored.


# -- saves that fall behind the storage ------------------------------------------------------


def save_step(side: WorkerSide, keys: list[bytes], blocks: list[int], answers: bool = False) -> None:
    """One engine step that completes ``keys`` (request r's chunks in ``blocks``); with
    ``answers`` it also gives r its answer's last token."""
    save = ChunkTransfer(request_id="r", keys=[keys], block_ids=[blocks])
    side.save(KVHarborMetadata(saves=[save], answered=["r"] if answers else []))


def exported(*reports: dict[str, float]) -> CollectorRegistry:
    """The workers' ``reports`` as vLLM hands them to the connector's Prometheus series."""
    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = KVHarborPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    for report in reports:
        metrics.observe(KVHarborStats(data=dict(report)).to_dict(), 0)
    return registry


def said(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in record.getMessage() for record in caplog.records)


def test_a_first_tier_that_cannot_keep_up_costs_saves_never_the_engines_steps(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway's writes stall (its first tier cannot keep up) while room is lent as usual.
    The first step lands its chunk itself (the saver is idle) and its commit stalls; no later
    step waits for it: each copies its chunks out of the blocks into staging of its own and is
    queued, the chunks without staging room (engine.save_staging_mb_max: 2 here) or without a
    place in the queue (engine.save_queue_steps_max: 2) are dropped, and a step that answers
    the request stops waiting for its saves after engine.save_wait_ms (0). Every chunk not saved is
    counted, reaches the Prometheus series, and each cause is said once. Had a step waited for
    the stalled write, it would have returned only once the stall gave up (`Stall.outlasted`)."""
    gateway, kv = real_gateway, caches(seed=13)
    keys = [bytes([40 + i]) * 16 for i in range(6)]
    original = {name: t.clone() for name, t in kv.items()}
    side = worker(gateway, kv, save_staging_mb_max=2, save_queue_steps_max=2, save_wait_ms=0)  # a chunk is 1 MiB
    try:
        with gateway.stalled_writes() as stall, caplog.at_level(logging.WARNING, "kvharbor"):
            save_step(side, keys[0:1], [1, 2])  # Landed by the step; its commit waits at the stall.
            assert stall.reached.wait(WAIT_S)
            save_step(side, keys[1:2], [3, 4], answers=True)  # Snapshotted, queued; not waited for.
            save_step(side, keys[2:4], [5, 6, 7, 8])  # One chunk has staging room, one is dropped.
            save_step(side, keys[4:5], [9, 10])  # The queue is full: dropped.
            save_step(side, keys[5:6], [11, 12])  # Again, not said again.
            assert not stall.outlasted  # No step waited for the stalled write.
            for t in kv.values():
                t.zero_()  # Later steps reuse the blocks: the queued saves hold copies of their own.
            behind = side.take_stats()
    finally:
        side.close()  # The writes go through (the stall is over): the saver lands and commits what it holds.
    after = side.take_stats()
    assert (behind["save_dropped"], behind["saves_pending"], behind["stored_chunks"]) == (3, 3, 0)
    assert (after["save_dropped"], after["saves_pending"], after["stored_chunks"]) == (0, 0, 3)
    registry = exported(behind, after)
    assert registry.get_sample_value("vllm:kvharbor_save_dropped_total", {"engine": "0"}) == 3
    assert registry.get_sample_value("vllm:kvharbor_stored_chunks_total", {"engine": "0"}) == 3
    assert said(caplog, "engine.save_staging_mb_max") == 1
    assert said(caplog, "engine.save_queue_steps_max") == 1
    assert said(caplog, "engine.save_wait_ms") == 1
    assert [gateway.holds([key]) for key in keys] == [1, 1, 1, 0, 0, 0]
    restored = caches(seed=None)
    reader = worker(gateway, restored)
    try:
        reader.load(KVHarborMetadata(loads=[transfer(keys[:3], [1, 2, 3, 4, 5, 6])]))
        assert reader.take_load_errors() == set()
    finally:
        reader.close()
    assert same_pages(restored, [1, 2, 3, 4, 5, 6], original, [1, 2, 3, 4, 5, 6])  # What the steps had.


def test_a_step_that_answers_a_request_waits_for_its_saves_and_only_for_its_own(real_gateway: RealGateway) -> None:
    """The saver is held in a stalled commit, so a later step's save of request a is queued
    and not landed. A step that answers another request (b) does not wait for a's save; the
    step that answers a (gives its last token) returns only once a's chunk is landed: here,
    once the stall is over (engine.save_wait_ms bounds it, a minute here)."""
    gateway, kv = real_gateway, caches(seed=17)
    keys = [bytes([60 + i]) * 16 for i in range(2)]
    side = worker(gateway, kv, save_wait_ms=60_000)
    answered = threading.Event()
    released_first: list[bool] = []
    try:
        with gateway.stalled_writes() as stall:
            save_step(side, keys[0:1], [1, 2])  # Landed by the step (the saver is idle); its commit stalls.
            assert stall.reached.wait(WAIT_S)
            a_save = ChunkTransfer(request_id="a", keys=[keys[1:2]], block_ids=[[3, 4]])
            side.save(KVHarborMetadata(saves=[a_save]))  # Snapshotted and queued behind the stalled commit.
            side.save(KVHarborMetadata(answered=["b"]))  # Not a's answer: no wait.
            assert not stall.outlasted

            def answer_a() -> None:
                side.save(KVHarborMetadata(answered=["a"]))
                released_first.append(stall.release.is_set())
                answered.set()

            thread = threading.Thread(target=answer_a)
            thread.start()
            assert not answered.wait(0.5), "the step answering a returned before a's save landed"
            stall.release.set()
            assert answered.wait(WAIT_S)
            thread.join(WAIT_S)
    finally:
        side.close()
    assert released_first == [True]
    assert [gateway.holds([key]) for key in keys] == [1, 1]


def test_chunks_the_gateway_has_no_room_for_are_dropped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another client holds the room the gateway lends (gateway.in_place_mb_max in place, the
    ring's): a step's chunks find none by gateway.ring_wait_ms (0 here), are dropped and
    counted, said once; none of them is taken for stored already."""
    gateway = RealGateway(tmp_path / "gateway", ring_mb=2, ring_mb_min=1, ring_wait_ms=0, in_place_mb_max=1).start()
    holder = gateway.client("holder")
    try:
        value = 1 << 20  # A chunk's size here.
        held = [holder.prepare_put(bytes(16), [(bytes([200]) * 16, value)])]  # In place: the budget.
        while not held[-1].no_room:  # Then the ring, value by value, until it has no room for one.
            held.append(holder.prepare_put(bytes(16), [(bytes([201 + len(held)]) * 16, value)]))
        side = worker(gateway, caches(seed=14))
        try:
            with caplog.at_level(logging.WARNING, "kvharbor"):
                save_step(side, [K0], [1, 2])
                save_step(side, [K1], [3, 4])
        finally:
            side.close()
        stats = side.take_stats()
        assert (stats["save_dropped"], stats["stored_chunks"], stats["saves"]) == (2, 0, 2)
        assert said(caplog, "gateway.ring_wait_ms") == 1
        assert side._save_link.counters.no_room_chunks == 2
    finally:
        holder.close()
        gateway.close()
    assert exported(stats).get_sample_value("vllm:kvharbor_save_dropped_total", {"engine": "0"}) == 2
