"""The GPU data path's logic (`kvharbor.connector.vllm.gpu`), on CPU tensors.

CI has no GPU: streams and events are no-ops on the CPU, and everything else —
the block-major views, gathering, staging, scatter, partial chunks, runs of
adjacent chunks, the staging budget, pinning failures, the streamed load with
its waits — runs the same code as on the H200 (bench/gpu.py runs it there).
"""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvharbor.connector.link import CacheLink  # noqa: E402
from kvharbor.connector.vllm.gpu import (  # noqa: E402
    GpuPages,
    GpuWorkerPath,
    PinError,
    PinnedMapping,
    StepTimer,
    block_major,
    contiguous_runs,
)
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata  # noqa: E402
from kvharbor.connector.vllm.pages import PageCopier  # noqa: E402
from kvharbor.gateway.client import GatewayRefused, GatewayUnavailable, GetBatch  # noqa: E402
from kvharbor.gateway.protocol import ErrorCode  # noqa: E402

BLOCKS = 40
HEADS, TOKENS, HEAD2 = 2, 16, 8  # per layer: (blocks, heads, tokens, 2*head)
LAYERS = 3
PER_CHUNK = 4


def flash_nhd(blocks: int = BLOCKS) -> torch.Tensor:
    """flash-attn's logical (blocks, heads, tokens, 2*head) over NHD memory (blocks, tokens, heads, 2*head)."""
    return torch.randn(blocks, TOKENS, HEADS, HEAD2).permute(0, 2, 1, 3)


def layers(make: Callable[[], torch.Tensor] = flash_nhd) -> list[torch.Tensor]:
    return [make() for _ in range(LAYERS)]


def block_bytes(t: torch.Tensor, b: int) -> bytes:
    """Block b's memory as it lies (what the GPU path stores)."""
    view = block_major(t, BLOCKS)[b]
    return view.contiguous().numpy().tobytes()


class Shm:
    """A writable buffer standing in for the gateway's segment."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self.mapping = PinnedMapping(self.view, register=None)

    def span(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]


# -- views and runs ---------------------------------------------------------------


def test_block_major_keeps_each_block_as_it_lies_in_memory() -> None:
    t = flash_nhd()
    view = block_major(t, BLOCKS)
    assert view.shape == (BLOCKS, HEADS * TOKENS * HEAD2) and view.stride() == (HEADS * TOKENS * HEAD2, 1)
    raw = t.permute(0, 2, 1, 3).contiguous()  # the NHD memory
    assert torch.equal(view[7], raw[7].reshape(-1))
    contiguous = torch.randn(BLOCKS, HEADS, TOKENS, HEAD2)
    assert torch.equal(block_major(contiguous, BLOCKS)[3], contiguous[3].reshape(-1))


def test_block_major_handles_a_kv_dimension_before_the_blocks() -> None:
    t = torch.randn(2, BLOCKS, TOKENS, HEADS, HEAD2 // 2)  # K and V apart: a block is two ranges
    view = block_major(t, BLOCKS)
    assert view.shape == (BLOCKS, 2, TOKENS * HEADS * HEAD2 // 2)
    assert torch.equal(view[5, 1], t[1, 5].reshape(-1))


def test_contiguous_runs() -> None:
    assert list(contiguous_runs([0, 10, 20, 40, 50, 100], 10)) == [(0, 3, 0), (3, 2, 40), (5, 1, 100)]
    assert list(contiguous_runs([], 10)) == []


# -- saves and loads through a stand-in segment -----------------------------------


def test_save_then_restore_round_trip_with_partial_chunks() -> None:
    src = layers()
    pages = GpuPages(src, BLOCKS, PER_CHUNK, load_batch_bytes=1)
    size = pages.chunk_bytes
    assert size == LAYERS * PER_CHUNK * HEADS * TOKENS * HEAD2 * 4
    chunks = [[1, 9, 3, 30], [4, 5, 6, 7], [20, 2, 11, 12]]
    shm = Shm(8 * size)
    save = pages.open_save(chunks)
    assert save is not None and save.chunks == 3
    for i in (2, 0):  # the forward pass reports some layers; close_save gathers the rest
        pages.gather_layer(save, i)
    pages.close_save(save)
    offsets = [5 * size, 0, size]  # chunk 0 apart, chunks 1 and 2 back to back
    for c, offset in enumerate(offsets):
        pages.stage_save(save, c, shm.mapping, shm.span(offset, size))
    pages.flush_save(save, shm.mapping)()
    pages.release_save(save)
    assert pages.staging_bytes == 0
    for c, offset in enumerate(offsets):  # stored as [layer][block][page as in memory]
        expected = b"".join(block_bytes(src[layer], b) for layer in range(LAYERS) for b in chunks[c])
        assert bytes(shm.span(offset, size)) == expected

    dst = [torch.zeros_like(t) for t in src]
    loader = GpuPages(dst, BLOCKS, PER_CHUNK, load_batch_bytes=2 * size)
    assert loader.chunks_per_load == 2
    # Restore chunk 0 from its block 1 on (the first block was a local hit), chunk 1
    # whole, then chunk 2's first two blocks (the load stops short of the prompt end).
    loader.stage_load(shm.mapping, shm.span(offsets[0], size), 1, [21, 22, 23])
    loader.stage_load(shm.mapping, shm.span(offsets[1], size), 0, [24, 25, 26, 27])
    loader.flush_load(shm.mapping)()
    loader.stage_load(shm.mapping, shm.span(offsets[2], size), 0, [28, 29])
    loader.flush_load(shm.mapping)()
    loader.wait_layer(0)
    loader.wait_loads()
    restored = dict(zip([21, 22, 23, 24, 25, 26, 27, 28, 29], [9, 3, 30, 4, 5, 6, 7, 20, 2], strict=True))
    for layer in range(LAYERS):
        for b in range(BLOCKS):
            if b in restored:
                assert torch.equal(dst[layer][b], src[layer][restored[b]]), (layer, b)
            else:
                assert not dst[layer][b].any(), (layer, b)  # nothing else written


def test_same_bytes_as_the_cpu_path_for_contiguous_caches() -> None:
    """The CPU backend's PageCopier stores logical order; for a contiguous cache that
    is memory order, so both paths store identical bytes."""
    src = layers(lambda: torch.randn(BLOCKS, HEADS, TOKENS, HEAD2))
    pages = GpuPages(src, BLOCKS, PER_CHUNK)
    shm = Shm(pages.chunk_bytes)
    save = pages.open_save([[3, 1, 4, 15]])
    assert save is not None
    pages.close_save(save)
    pages.stage_save(save, 0, shm.mapping, shm.span(0, pages.chunk_bytes))
    pages.flush_save(save, shm.mapping)()
    reference = memoryview(bytearray(pages.chunk_bytes))
    PageCopier(src, BLOCKS).gather([3, 1, 4, 15], reference)
    assert bytes(shm.span(0, pages.chunk_bytes)) == bytes(reference)


def test_uniform_layers_only() -> None:
    from kvharbor.connector.vllm.layout import ConnectorRefusal

    with pytest.raises(ConnectorRefusal):
        GpuPages([flash_nhd(), torch.randn(BLOCKS, HEADS, TOKENS, 2 * HEAD2)], BLOCKS, PER_CHUNK)


def test_save_staging_is_bounded() -> None:
    pages = GpuPages(layers(), BLOCKS, PER_CHUNK, save_staging_bytes_max=1)
    size = pages.chunk_bytes
    assert pages.save_staging_bytes_max == size  # at least one chunk
    first = pages.open_save([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert first is not None and first.chunks == 1  # the rest does not fit
    assert pages.open_save([[9, 10, 11, 12]], wait_s=0) is None  # full: skipped, no wait
    pages.release_save(first)
    again = pages.open_save([[9, 10, 11, 12]], wait_s=0)
    assert again is not None and pages.staging_bytes == size


def test_pinned_mapping_offsets_and_register_calls() -> None:
    calls: list[tuple[str, int, int]] = []
    shm = bytearray(1 << 16)
    view = memoryview(shm)
    base = ctypes.addressof(ctypes.c_char.from_buffer(view))
    pin = PinnedMapping(
        view,
        register=lambda a, n: calls.append(("register", a, n)),
        unregister=lambda a: calls.append(("unregister", a, 0)),
    )
    # One registration, read-write: the GPU writes puts in place into the RAM tiers too.
    assert calls == [("register", base, 1 << 16)]
    assert pin.offset(view[4096:8192]) == 4096
    pin.tensor[4096] = 7
    assert shm[4096] == 7
    pin.close()
    pin.close()
    assert calls[1:] == [("unregister", base, 0)]
    view.release()  # the mapping left no export behind: the owner can unmap


def test_step_timer_on_cpu() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin()
    timer.end(1e12)
    timer.begin()
    timer.cancel()
    timer.end(5e12)  # cancelled: no sample
    flops, seconds = timer.take()
    assert flops == 1e12 and seconds > 0
    assert timer.take() == (0.0, 0.0)


# -- the streamed load of CacheLink --------------------------------------------------


class FakeClient:
    """Serves GETs from a dict of values; records the order of waits and releases."""

    def __init__(self, values: dict[bytes, bytes], events: list[str], fail_get: int | None = None) -> None:
        self.values = values
        self.events = events
        self.fail_get = fail_get
        self.gets = 0
        self.segment = None

    def get(self, fingerprint: bytes, keys: list[bytes]) -> GetBatch:
        self.gets += 1
        if self.fail_get == self.gets:
            raise self.error
        views = []
        for key in keys:
            if key not in self.values:
                break
            views.append(memoryview(bytearray(self.values[key])))
        self.events.append(f"get{self.gets}")
        return GetBatch(self.gets, views)

    def release(self, batch: GetBatch) -> None:
        self.events.append(f"release{batch.batch}")

    def close(self) -> None:
        pass


def streamed(
    client: FakeClient, keys: list[bytes], per_get: int, proceed: Callable[[int], bool] | None = None
) -> tuple[int, list[int], CacheLink]:
    from kvharbor.config import Config
    from kvharbor.connector.link import RankSwitch

    link = CacheLink(Config(), "test", connect=lambda c, n: client, switch=RankSwitch())  # type: ignore[arg-type,return-value]
    sunk: list[int] = []
    flushes = iter(range(1, 100))

    def flush() -> Callable[[], None]:
        n = next(flushes)
        return lambda: client.events.append(f"wait{n}")

    done = link.load_streamed(b"f" * 16, keys, per_get, lambda i, v: sunk.append(i), flush, proceed)
    return done, sunk, link


KEYS = [bytes([i]) * 16 for i in range(7)]


def test_load_streamed_overlaps_and_releases_after_the_wait() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events)
    done, sunk, link = streamed(client, KEYS, 3)
    assert done == 7 and sunk == list(range(7))
    # Request n+1 is asked for before request n's copies are waited for and its room given back.
    assert events == ["get1", "get2", "wait1", "release1", "get3", "wait2", "release2", "wait3", "release3"]
    assert link.counters.loaded_chunks == 7


def test_load_streamed_stops_at_the_first_miss_and_when_told() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS[:4]}, events)
    assert streamed(client, KEYS, 3)[0] == 4
    events.clear()
    client = FakeClient({k: b"x" for k in KEYS}, events)
    done, sunk, _ = streamed(client, KEYS, 3, proceed=lambda n: n < 3)
    assert done == 3 and sunk == [0, 1, 2] and events[-1] == "release1"


def test_load_streamed_after_a_refusal_keeps_what_was_copied() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS}, events, fail_get=2)
    client.error = GatewayRefused(ErrorCode.BUSY, "busy")  # type: ignore[attr-defined]
    done, _, link = streamed(client, KEYS, 3)
    assert done == 3 and events == ["get1", "wait1", "release1"] and not link.is_off


def test_load_streamed_after_a_lost_gateway_counts_nothing_in_flight() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS}, events, fail_get=3)
    client.error = GatewayUnavailable("gone")  # type: ignore[attr-defined]
    done, _, link = streamed(client, KEYS, 3)
    # Request 2's copies were waited for, but its memory may have been reused: not counted.
    assert done == 3 and events == ["get1", "get2", "wait1", "release1", "wait2"] and link.is_off


# -- the worker's GPU half against a real gateway (CPU tensors) ----------------------


@pytest.fixture
def gateway_config(tmp_path: Path) -> Iterator[Any]:
    from kvharbor.config import load_config
    from kvharbor.gateway.shm import SHM_DIR

    name = f"kvh-gpu-test-{uuid.uuid4().hex[:8]}"
    config = load_config(
        None,
        {},
        overrides={
            "gateway": {"socket": str(tmp_path / "gw.sock"), "shm_name": name, "ring_mb": 64, "ring_mb_min": 16},
            "storage": {"tiers": [{"name": "ram", "type": "ram", "capacity_gb": 0.25}], "probe": False},
        },
    )
    yield config
    for path in SHM_DIR.glob(f"{name}.*"):
        path.unlink(missing_ok=True)


def worker_path(
    config: Any, tensors: list[torch.Tensor], register: Any = None
) -> tuple[GpuWorkerPath, dict[str, float]]:
    from kvharbor.connector.link import RankSwitch

    switch = RankSwitch()
    counts: dict[str, float] = {}

    def count(**deltas: float) -> None:
        for k, v in deltas.items():
            counts[k] = counts.get(k, 0) + v

    pages = GpuPages(tensors, BLOCKS, PER_CHUNK, load_batch_bytes=1)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    path = GpuWorkerPath(
        pages,
        names,
        CacheLink(config, "load", switch=switch),
        CacheLink(config, "save", switch=switch),
        0,
        b"F" * 16,
        count,
        register=register,
    )
    return path, counts


def test_worker_gpu_path_saves_and_restores_through_the_gateway(gateway_config: Any) -> None:
    src = layers()
    saver, _ = worker_path(gateway_config, src)
    try:
        assert saver.pin() and len(saver.pins) == 2
        keys = [bytes([9, i]) * 8 for i in range(3)]
        save = ChunkTransfer("r", [keys], block_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
        meta = KVHarborMetadata(saves=[save])
        saver.begin_step(meta)
        for i in range(LAYERS):
            saver.save_layer(f"model.layers.{i}.self_attn.attn")
        parts = saver.end_step(meta)
        assert parts is not None and parts.keys == keys
        store_link = saver._save_link
        stored = store_link.store(
            saver.fingerprint, [(k, saver.pages.chunk_bytes) for k in keys], parts.fill, parts.settle
        )
        parts.done()
        assert stored == 3

        dst = [torch.zeros_like(t) for t in src]
        loader, counts = worker_path(gateway_config, dst)
        assert loader.pin()
        load = ChunkTransfer("r", [keys], block_ids=[30, 31, 32, 33, 34, 35, 36, 37, 38], skip_blocks=2)
        loader.begin_step(KVHarborMetadata(loads=[load]))
        # Chunk 0 from its third block (two blocks were a local hit) + chunk 1 + 3 blocks of chunk 2.
        assert loader.load(load) == 9
        loader.end_step(KVHarborMetadata())
        sources = [3, 4, 5, 6, 7, 8, 9, 10, 11]
        for layer in range(LAYERS):
            for target, source in zip(load.block_ids, sources, strict=True):
                assert torch.equal(dst[layer][target], src[layer][source])
        assert counts["loaded_chunks"] == 3
        loader.close()
    finally:
        saver.close()


def test_worker_gpu_path_turns_the_cache_off_when_pinning_fails(
    gateway_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(address: int, nbytes: int) -> None:
        raise PinError("cudaHostRegister(64 MiB) failed with CUDA error 2 cudaErrorMemoryAllocation")

    path, _ = worker_path(gateway_config, layers(), register=refuse)
    try:
        assert not path.pin()
        assert path.pins == [] and path._load_link.is_off and path._save_link.is_off
        assert "cannot be page-locked" in caplog.text and "keeps serving" in caplog.text
        load = ChunkTransfer("r", [[b"k" * 16]], block_ids=[1, 2, 3, 4])
        assert path.load(load) == 0  # every planned block is a load error: recomputed
        meta = KVHarborMetadata(saves=[load])
        path.begin_step(meta)
        path.save_layer("model.layers.0.self_attn.attn")
        assert path.end_step(meta) is None  # nothing staged, nothing stored
    finally:
        path.close()


def test_a_step_that_waited_for_staging_is_not_a_prefill_sample() -> None:
    import threading

    from kvharbor.config import Config
    from kvharbor.connector.link import RankSwitch

    pages = GpuPages(layers(), BLOCKS, PER_CHUNK, save_staging_bytes_max=1)
    switch = RankSwitch()
    path = GpuWorkerPath(
        pages,
        [str(i) for i in range(LAYERS)],
        CacheLink(Config(), "load", connect=lambda c, n: None, switch=switch),  # type: ignore[arg-type,return-value]
        CacheLink(Config(), "save", connect=lambda c, n: None, switch=switch),  # type: ignore[arg-type,return-value]
        0,
        b"F" * 16,
        lambda **kw: None,
        register=None,
    )
    path.pins = [Shm(pages.chunk_bytes).mapping, Shm(pages.chunk_bytes).mapping]
    meta = KVHarborMetadata(saves=[ChunkTransfer("r", [[b"k" * 16]], block_ids=[1, 2, 3, 4])])
    path.begin_step(meta)
    path.save_layer("0")
    assert not path.stalled
    parts = path.end_step(meta)
    assert parts is not None  # holds the only chunk of staging until done()
    path.begin_step(meta)
    threading.Timer(0.05, parts.done).start()
    path.save_layer("0")  # waits for the staging the previous step still holds
    assert path.stalled
    later = path.end_step(meta)
    assert later is not None
    later.done()
