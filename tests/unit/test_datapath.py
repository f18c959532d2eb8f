"""The worker's data path (`datapath`, the copy backends, `pinning`, `streams`, `timing`) on CPU tensors.

One set of pipeline tests runs over both copy backends: `HostCopy` (the CPU
engine's) and `DeviceCopy` (the GPU engine's), whose streams and events are
no-ops on the CPU. Everything else of the GPU path — the block-major views,
gathering, staging, scatter, partial chunks, runs of adjacent chunks, the
staging budget, pinning failures, the streamed load with its waits — runs the
same code as on the H200 (bench/gpu.py runs it there).
"""

from __future__ import annotations

import ctypes
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvharbor.config import Config, EngineSection
from kvharbor.connector.link import CacheLink, RankSwitch
from kvharbor.connector.vllm.chunks import ChunkPart
from kvharbor.connector.vllm.copier import PageCopy, Wait
from kvharbor.connector.vllm.datapath import DataPath
from kvharbor.connector.vllm.device_copy import DeviceCopy
from kvharbor.connector.vllm.host_copy import HostCopy
from kvharbor.connector.vllm.metadata import ChunkTransfer, KVHarborMetadata
from kvharbor.connector.vllm.pages import block_first, block_major
from kvharbor.connector.vllm.pinning import PinError, PinnedMapping
from kvharbor.connector.vllm.timing import StepTimer
from kvharbor.gateway.client import GatewayRefused, GatewayUnavailable, GetBatch
from kvharbor.gateway.protocol import ErrorCode

BLOCKS = 40
HEADS, TOKENS, HEAD2 = 2, 16, 8  # per layer: (blocks, heads, tokens, 2*head)
LAYERS = 3
PER_CHUNK = 4
BACKENDS = ["host", "device"]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def flash_nhd(blocks: int = BLOCKS) -> torch.Tensor:
    """flash-attn's logical (blocks, heads, tokens, 2*head) over NHD memory (blocks, tokens, heads, 2*head)."""
    return torch.randn(blocks, TOKENS, HEADS, HEAD2).permute(0, 2, 1, 3)


def layers(make: Callable[[], torch.Tensor] = flash_nhd) -> list[torch.Tensor]:
    return [make() for _ in range(LAYERS)]


def make_copy(
    backend: str,
    tensors: list[torch.Tensor],
    load_batch_bytes: int = 1,
    save_staging_bytes_max: int = 1 << 30,
    groups: list[int] | None = None,
) -> PageCopy:
    if backend == "host":
        return HostCopy(tensors, BLOCKS, PER_CHUNK, load_batch_bytes, save_staging_bytes_max, groups)
    # Three load requests under way over the two staging slots: a slot is reused while the
    # request that used it before is still held.
    return DeviceCopy(tensors, BLOCKS, PER_CHUNK, load_batch_bytes, save_staging_bytes_max, groups, 3, 0)


def stored_block(backend: str, t: torch.Tensor, b: int) -> bytes:
    """Block b as the backend stores it: in logical order (host), as it lies in memory (device)."""
    view = (block_first if backend == "host" else block_major)(t, BLOCKS)[b]
    return view.contiguous().numpy().tobytes()


class Shm:
    """A writable buffer standing in for the gateway's segment."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self.mapping = PinnedMapping(self.view, register=None)

    def span(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]


def save_chunks(copy: PageCopy, chunks: list[list[int]], shm: Shm, offsets: list[int]) -> None:
    """The save pipeline as the worker drives it: open, gather (some layers), close, stage, flush, wait."""
    save = copy.open_save([[blocks] for blocks in chunks], 0)
    assert save is not None and save.chunks == len(chunks)
    for layer in (2, 0):  # the forward pass reports some layers; close gathers the rest
        save.gather_layer(layer)
    save.close()
    for c, offset in enumerate(offsets):
        save.stage(c, shm.mapping, shm.span(offset, copy.chunk_bytes))
    save.flush(shm.mapping).synchronize()
    save.release()


# -- both backends ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_then_restore_round_trip_with_partial_chunks(backend: str) -> None:
    src = layers()
    saver = make_copy(backend, src)
    size = saver.chunk_bytes
    assert size == LAYERS * PER_CHUNK * HEADS * TOKENS * HEAD2 * 4
    chunks = [[1, 9, 3, 30], [4, 5, 6, 7], [20, 2, 11, 12]]
    shm = Shm(8 * size)
    offsets = [5 * size, 0, size]  # chunk 0 apart, chunks 1 and 2 back to back
    save_chunks(saver, chunks, shm, offsets)
    for c, offset in enumerate(offsets):  # stored as [layer][block][page]
        expected = b"".join(stored_block(backend, src[layer], b) for layer in range(LAYERS) for b in chunks[c])
        assert bytes(shm.span(offset, size)) == expected

    dst = [torch.zeros_like(t) for t in src]
    loader = make_copy(backend, dst, load_batch_bytes=2 * size)
    assert loader.chunks_per_load == 2
    loader.begin_loads()
    # Restore chunk 0 from its block 1 on (the first block was a local hit), chunk 1
    # whole, then chunk 2's first two blocks (the load stops short of the prompt end).
    loader.stage_load(shm.mapping, shm.span(offsets[0], size), [ChunkPart(1, [21, 22, 23])])
    loader.stage_load(shm.mapping, shm.span(offsets[1], size), [ChunkPart(0, [24, 25, 26, 27])])
    with pytest.raises(RuntimeError, match="flush_load after chunks_per_load"):
        loader.stage_load(shm.mapping, shm.span(offsets[2], size), [ChunkPart(0, [28, 29])])
    loader.flush_load(shm.mapping).synchronize()
    loader.stage_load(shm.mapping, shm.span(offsets[2], size), [ChunkPart(0, [28, 29])])
    loader.flush_load(shm.mapping).synchronize()
    loader.wait_layer(0)
    loader.wait_loads()
    restored = dict(zip([21, 22, 23, 24, 25, 26, 27, 28, 29], [9, 3, 30, 4, 5, 6, 7, 20, 2], strict=True))
    for layer in range(LAYERS):
        for b in range(BLOCKS):
            if b in restored:
                assert torch.equal(dst[layer][b], src[layer][restored[b]]), (layer, b)
            else:
                assert not dst[layer][b].any(), (layer, b)  # nothing else written


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hybrid_cache_round_trips_each_group_through_its_own_blocks(backend: str, held: bool) -> None:
    """vLLM's hybrid allocator: two layers in a full-attention group, one in a sliding-window
    group with blocks of its own, backed by the same tensor as the first (vLLM shares a tensor
    between one layer of each group; the worker registers each group's layers together); a
    load fills the window group only where vLLM allocated blocks (in the window), and
    nothing else of it; a held load (layer by layer) as a streamed one."""
    full0, full2 = flash_nhd(), flash_nhd()
    src = [full0, full2, full0]  # the window layer shares the first layer's tensor, as vLLM lays it out
    groups = [0, 0, 1]
    saver = make_copy(backend, src, groups=groups)
    size = saver.chunk_bytes
    assert size == LAYERS * PER_CHUNK * HEADS * TOKENS * HEAD2 * 4
    chunks = [[[1, 2, 3, 4], [5, 6, 7, 8]], [[9, 10, 11, 12], [13, 14, 15, 16]]]  # per chunk: full, window
    shm = Shm(2 * size)
    save = saver.open_save(chunks, 0)
    assert save is not None
    save.close()
    for c in range(2):
        save.stage(c, shm.mapping, shm.span(c * size, size))
    save.flush(shm.mapping).synchronize()
    save.release()
    for c, blocks in enumerate(chunks):  # [layer][block][page], each layer through its group's blocks
        expected = b"".join(
            stored_block(backend, src[layer], b) for layer in range(LAYERS) for b in blocks[groups[layer]]
        )
        assert bytes(shm.span(c * size, size)) == expected

    dst0, dst2 = torch.zeros_like(full0), torch.zeros_like(full2)
    dst = [dst0, dst2, dst0]
    loader = make_copy(backend, dst, load_batch_bytes=2 * size, groups=groups)
    loader.begin_loads()
    # Chunk 0 is out of the window: the window group restores nothing from it.
    loader.stage_load(shm.mapping, shm.span(0, size), [ChunkPart(0, [21, 22, 23, 24]), ChunkPart(4, [])])
    loader.stage_load(shm.mapping, shm.span(size, size), [ChunkPart(0, [25, 26, 27, 28]), ChunkPart(2, [31, 32])])
    if held:
        loader.hold_load()
        loader.flush_held(shm.mapping).synchronize()
    else:
        loader.flush_load(shm.mapping).synchronize()
    loader.wait_loads()
    full = dict(zip(range(21, 29), [1, 2, 3, 4, 9, 10, 11, 12], strict=True))
    window = {31: 15, 32: 16}
    for b in range(BLOCKS):
        if b in full:
            assert torch.equal(dst0[b], full0[full[b]]) and torch.equal(dst2[b], full2[full[b]]), b
        elif b in window:  # the window layer's pages, in the first layer's tensor
            assert torch.equal(dst0[b], full0[window[b]]) and not dst2[b].any(), b
        else:
            assert not dst0[b].any() and not dst2[b].any(), b  # nothing else written
    with pytest.raises(ValueError, match="1 group part"):
        loader.stage_load(shm.mapping, shm.span(0, size), [ChunkPart(0, [21])])


def test_both_backends_store_the_same_bytes_for_contiguous_caches() -> None:
    """The host stores logical order, the device memory order: for a contiguous cache
    (vLLM's CPU backend) those are the same bytes."""
    src = layers(lambda: torch.randn(BLOCKS, HEADS, TOKENS, HEAD2))
    stored = []
    for backend in BACKENDS:
        copy = make_copy(backend, src)
        shm = Shm(copy.chunk_bytes)
        save_chunks(copy, [[3, 1, 4, 15]], shm, [0])
        stored.append(bytes(shm.buffer))
    assert stored[0] == stored[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_a_save_reads_after_the_step(backend: str) -> None:
    """A device save holds a snapshot once closed (the step's blocks may be reused, the saver
    thread copies later); a host save reads the blocks when staged, so the step waits for it."""
    src = layers()
    copy = make_copy(backend, src)
    before = b"".join(stored_block(backend, src[layer], b) for layer in range(LAYERS) for b in (1, 2, 3, 4))
    save = copy.open_save([[[1, 2, 3, 4]]], 0)
    assert save is not None
    save.close()
    for t in src:
        t[1:5] = 0  # the next step reuses the blocks
    shm = Shm(copy.chunk_bytes)
    save.stage(0, shm.mapping, shm.span(0, copy.chunk_bytes))
    save.flush(shm.mapping).synchronize()
    save.release()
    assert copy.snapshots_saves == (backend == "device")
    assert (bytes(shm.buffer) == before) == copy.snapshots_saves


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_snapshot_holds_the_chunks_the_step_had_within_the_save_staging(backend: str) -> None:
    """A host save whose step cannot wait for the saver copies the chunks to be staged out of
    their blocks (`StepSave.snapshot`): staged after the blocks were reused, they are still the
    step's. Only the leading chunks that fit the staging are kept, with no wait; its room
    comes back with the save. A device save holds its snapshot already: it keeps them all."""
    src = layers()
    copy = make_copy(backend, src)
    size = copy.chunk_bytes
    if isinstance(copy, HostCopy):
        copy.save_staging_bytes_max = 2 * size
    chunks = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    before = [b"".join(stored_block(backend, src[layer], b) for layer in range(LAYERS) for b in c) for c in chunks]
    save = copy.open_save([[c] for c in chunks], 0)
    assert save is not None
    save.close()
    assert save.snapshot([2, 0, 1]) == (2 if backend == "host" else 3)  # The host's staging holds two.
    for t in src:
        t[1:13] = 0  # the next step reuses the blocks
    shm = Shm(2 * size)
    for at, chunk in enumerate((2, 0)):
        save.stage(chunk, shm.mapping, shm.span(at * size, size))
    save.flush(shm.mapping).synchronize()
    assert bytes(shm.buffer) == before[2] + before[0]
    if isinstance(copy, HostCopy):
        with pytest.raises(ValueError, match="not a whole chunk of the snapshot"):
            save.stage(1, shm.mapping, shm.span(0, size))  # Not kept.
        assert copy.staging_bytes == 2 * size
        other = copy.open_save([[chunks[0]]], 0)
        assert other is not None and other.snapshot([0]) == 0  # Full: none kept, no wait.
        other.release()
        save.release()
        assert copy.staging_bytes == 0  # Given back with the save.
    else:
        save.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_sizes_and_blocks_past_a_chunk_are_refused(backend: str) -> None:
    copy = make_copy(backend, layers())
    shm = Shm(2 * copy.chunk_bytes)
    with pytest.raises(ValueError, match="where"):
        copy.stage_load(shm.mapping, shm.span(0, copy.chunk_bytes - 1), [ChunkPart(0, [1])])
    with pytest.raises(ValueError, match=r"blocks 3 \.\. 5"):
        copy.stage_load(shm.mapping, shm.span(0, copy.chunk_bytes), [ChunkPart(3, [1, 2])])
    save = copy.open_save([[[1, 2, 3, 4]]], 0)
    assert save is not None
    save.close()
    with pytest.raises(ValueError, match="not a whole chunk"):
        save.stage(0, shm.mapping, shm.span(0, copy.chunk_bytes // 2))
    save.release()


# -- the device backend ----------------------------------------------------------------


def test_device_save_staging_is_bounded() -> None:
    copy = DeviceCopy(layers(), BLOCKS, PER_CHUNK, 1, 1, None, loads_in_flight_max=2, layered_row_bytes=0)
    size = copy.chunk_bytes
    assert copy.save_staging_bytes_max == size  # at least one chunk
    first = copy.open_save([[[1, 2, 3, 4]], [[5, 6, 7, 8]]], 5.0)
    assert first is not None and first.chunks == 1  # the rest does not fit
    assert copy.open_save([[[9, 10, 11, 12]]], 0) is None  # full: skipped, no wait
    first.release()
    first.release()  # once only
    again = copy.open_save([[[9, 10, 11, 12]]], 0)
    assert again is not None and copy.staging_bytes == size
    again.release()


def test_a_device_save_without_room_for_all_its_chunks_keeps_the_leading_ones_that_fit() -> None:
    copy = DeviceCopy(layers(), BLOCKS, PER_CHUNK, 1, 1, None, loads_in_flight_max=2, layered_row_bytes=0)
    copy.save_staging_bytes_max = 2 * copy.chunk_bytes
    held = copy.open_save([[[1, 2, 3, 4]]], 0)
    assert held is not None
    # Without a wait (engine.save_staging_wait_ms 0), what the room left takes.
    partial = copy.open_save([[[5, 6, 7, 8]], [[9, 10, 11, 12]]], 0)
    assert partial is not None and partial.chunks == 1
    assert copy.open_save([[[13, 14, 15, 16]]], 0) is None
    held.release()
    partial.release()
    assert copy.staging_bytes == 0


# -- pinning, timing --------------------------------------------------------------------


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
    assert calls == [("register", base, 1 << 16)] and pin.registered
    assert pin.offset(view[4096:8192]) == 4096
    with pytest.raises(ValueError, match="outside this 65536 B mapping"):
        pin.offset(memoryview(bytearray(16)))
    pin.tensor[4096] = 7
    assert shm[4096] == 7
    pin.close()
    pin.close()
    assert calls[1:] == [("unregister", base, 0)] and not pin.registered
    view.release()  # the mapping left no export behind: the owner can unmap


def test_step_timer_on_cpu() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin()
    torch.randn(64, 64) @ torch.randn(64, 64)
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

    def __init__(
        self,
        values: dict[bytes, bytes],
        events: list[str],
        fail_get: int | None = None,
        ring_bytes: int = 1 << 30,
        in_ring: bool = False,
    ) -> None:
        """``in_ring``: values are served through the ring (from a tier outside shared memory)."""
        self.values = values
        self.events = events
        self.fail_get = fail_get
        self.gets = 0
        self.segment = None
        self.ring_bytes = ring_bytes
        self.in_ring = in_ring
        self.held: set[int] = set()
        self.held_most = 0
        self.refuse_release: int | None = None
        self.error: Exception = GatewayUnavailable("a get failed (the test's fault)")
        """What the ``fail_get``-th get raises."""

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
        self.held.add(self.gets)
        self.held_most = max(self.held_most, len(self.held))
        return GetBatch(self.gets, views, sum(v.nbytes for v in views) if self.in_ring else 0)

    def release(self, batch: GetBatch) -> None:
        if batch.batch == self.refuse_release:
            self.events.append(f"refused{batch.batch}")
            raise GatewayRefused(ErrorCode.BUSY, "busy")
        self.held.remove(batch.batch)
        self.events.append(f"release{batch.batch}")

    def close(self) -> None:
        pass


class Copies:
    """Records the streamed load's copies: flush n waits as ``wait<n>``; holds, the held flush
    (``held`` once its wait ran) and drops by name."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.flushes = 0

    def flush(self) -> Callable[[], None]:
        self.flushes += 1
        n = self.flushes
        return lambda: self.events.append(f"wait{n}")

    def hold(self) -> None:
        self.events.append("hold")

    def flush_held(self) -> Callable[[], None]:
        self.events.append("flush_held")
        return lambda: self.events.append("held")

    def drop_held(self) -> None:
        self.events.append("drop_held")


def streamed(
    client: FakeClient,
    keys: list[bytes],
    per_get: int,
    proceed: Callable[[int], bool] | None = None,
    in_flight_max: int = 2,
    hold_from: int | None = None,
) -> tuple[int, list[int], CacheLink]:
    link = CacheLink(Config(), "test", connect=lambda c, n: client, switch=RankSwitch())  # type: ignore[arg-type,return-value]
    sunk: list[int] = []

    def answered(staged: int) -> None:
        client.events.append(f"answered{staged}")

    done = link.load_streamed(
        b"f" * 16,
        keys,
        per_get,
        lambda i, v: sunk.append(i),
        Copies(client.events),
        proceed,
        in_flight_max,
        hold_from,
        answered,
    )
    return done, sunk, link


KEYS = [bytes([i]) * 16 for i in range(7)]


def test_load_streamed_overlaps_and_releases_after_the_wait() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events)
    done, sunk, link = streamed(client, KEYS, 3)
    assert done == 7 and sunk == list(range(7))
    # Request n+1 is asked for before request n's copies are waited for and its room given back.
    # The engine is told what was answered before the last copies are waited for.
    assert events == [
        "get1",
        "get2",
        "wait1",
        "release1",
        "get3",
        "answered7",
        "wait2",
        "release2",
        "wait3",
        "release3",
    ]
    assert link.counters.loaded_chunks == 7


def test_load_streamed_queues_up_to_in_flight_max_requests_and_gives_them_back_oldest_first() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events)
    done, sunk, _ = streamed(client, KEYS, 2, in_flight_max=3)
    assert done == 7 and sunk == list(range(7)) and client.held_most == 3 and not client.held
    # Three requests are under way before the first one's copies are waited for.
    assert events[:5] == ["get1", "get2", "get3", "wait1", "release1"]
    assert events[5:] == ["get4", "answered7", "wait2", "release2", "wait3", "release3", "wait4", "release4"]
    events.clear()
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events)
    streamed(client, KEYS, 2, in_flight_max=1)
    assert client.held_most == 1 and events[:4] == ["get1", "wait1", "release1", "get2"]


def test_load_streamed_holds_at_most_half_the_ring_with_values_copied_into_it() -> None:
    # Values of 8 bytes, two per request: a request takes 16 bytes of the ring.
    events: list[str] = []
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events, ring_bytes=64, in_ring=True)
    done, _, _ = streamed(client, KEYS, 2, in_flight_max=8)
    assert done == 7 and client.held_most == 2  # 2 x 16 bytes: the ring's half, 32 bytes.
    events.clear()
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events, ring_bytes=64)  # Served in place.
    streamed(client, KEYS, 2, in_flight_max=8)
    assert client.held_most == 4  # Every request of the load at once: the ring is not used.


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
    client.error = GatewayRefused(ErrorCode.BUSY, "busy")
    done, _, link = streamed(client, KEYS, 3)
    assert done == 3 and events == ["get1", "wait1", "release1"] and not link.is_off


def test_load_streamed_waits_for_every_copy_under_way_when_a_release_is_refused() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS}, events)
    client.refuse_release = 2
    done, _, link = streamed(client, KEYS, 2, in_flight_max=3)
    # Request 2's room was not given back: neither it nor what follows counts, and the copies
    # of requests 3 and 4, under way, finish before the load returns.
    assert done == 2 and not link.is_off
    loaded = ["wait1", "release1", "get4", "answered7"]
    refused = ["wait2", "refused2", "wait2", "refused2"]  # Given back once more as the load ends.
    in_flight = ["wait2", "wait3", "wait4"]  # Waits are idempotent: request 2's copies were done.
    assert events[3:] == loaded + refused + in_flight


def test_load_streamed_after_a_lost_gateway_counts_nothing_in_flight() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS}, events, fail_get=3)
    client.error = GatewayUnavailable("gone")
    done, _, link = streamed(client, KEYS, 3)
    # Request 2's copies were waited for, but its memory may have been reused: not counted.
    assert done == 3 and events == ["get1", "get2", "wait1", "release1", "wait2"] and link.is_off


def test_load_streamed_holds_its_last_requests_for_one_copy_after_the_answer() -> None:
    """Requests from ``hold_from`` on are held uncopied; once the last is answered the engine
    is told, then the held ones are copied together and given back after that copy."""
    events: list[str] = []
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events)
    done, sunk, link = streamed(client, KEYS, 2, hold_from=4)
    assert done == 7 and sunk == list(range(7)) and not client.held
    assert events == [
        *["get1", "get2", "wait1", "release1"],  # Streamed: two under way at once.
        *["get3", "hold", "get4", "hold"],  # Held: no copy yet, not given back.
        *["answered7", "flush_held", "wait2", "release2", "held", "release3", "release4"],
    ]
    assert link.counters.loaded_chunks == 7


def test_load_streamed_streams_a_held_request_whose_values_came_through_the_ring() -> None:
    """Only values served in place are held: ring room must be given back as the load goes."""
    events: list[str] = []
    client = FakeClient({k: b"x" * 8 for k in KEYS}, events, in_ring=True)
    done, _, _ = streamed(client, KEYS, 2, hold_from=0)
    assert done == 7 and "hold" not in events and "flush_held" not in events
    assert events[:4] == ["get1", "get2", "wait1", "release1"]


def test_load_streamed_drops_what_it_held_when_a_later_request_fails() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS}, events, fail_get=3)
    client.error = GatewayRefused(ErrorCode.BUSY, "busy")
    done, _, link = streamed(client, KEYS, 2, hold_from=2)
    # Request 2 was held, never copied: dropped and given back, not counted; request 1 was.
    assert done == 2 and not link.is_off and not client.held
    assert events == ["get1", "get2", "hold", "drop_held", "wait1", "release1", "release2"]


def test_load_streamed_counts_no_held_request_whose_room_was_not_given_back() -> None:
    events: list[str] = []
    client = FakeClient({k: b"x" for k in KEYS}, events)
    client.refuse_release = 3
    done, _, link = streamed(client, KEYS, 2, hold_from=2)
    # Requests 2 and 4 were given back after the held copy; 3 was refused twice (at the end
    # and once more as the load gave up): it and what follows are not counted.
    assert done == 4 and not link.is_off
    assert events[-6:] == ["held", "release2", "refused3", "held", "refused3", "held"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_held_flush_releases_each_layer_to_the_engine_once_its_pages_are_in(backend: str) -> None:
    """`wait_layer` blocks while a step holds loads, and returns for a layer only once that
    layer's pages of every held chunk are in (on CPU tensors a copy is done when queued)."""
    src = layers()
    saver = make_copy(backend, src)
    size = saver.chunk_bytes
    chunks = [[1, 9, 3, 30], [4, 5, 6, 7], [20, 2, 11, 12]]
    shm = Shm(4 * size)
    offsets = [3 * size, 0, size]  # chunks 1 and 2 back to back: one run of rows per layer
    save_chunks(saver, chunks, shm, offsets)

    dst = [torch.zeros_like(t) for t in src]
    loader = make_copy(backend, dst, load_batch_bytes=2 * size)
    assert loader.held_chunks_max == 2 * LAYERS
    targets = [[21, 22, 23], [24, 25, 26, 27], [28, 29]]
    sources = [[9, 3, 30], [4, 5, 6, 7], [20, 2]]
    loader.begin_loads()
    loader.stage_load(shm.mapping, shm.span(offsets[0], size), [ChunkPart(1, targets[0])])
    loader.stage_load(shm.mapping, shm.span(offsets[1], size), [ChunkPart(0, targets[1])])
    loader.hold_load()
    loader.stage_load(shm.mapping, shm.span(offsets[2], size), [ChunkPart(0, targets[2])])
    loader.hold_load()
    assert not any(t.any() for t in dst)  # held: nothing copied yet

    def layer_in(layer: int) -> bool:
        return all(
            torch.equal(dst[layer][t], src[layer][s])
            for ts, ss in zip(targets, sources, strict=True)
            for t, s in zip(ts, ss, strict=True)
        )

    seen: dict[int, bool] = {}

    def engine(layer: int) -> None:
        loader.wait_layer(layer)
        seen[layer] = layer_in(layer)

    waiting = [threading.Thread(target=engine, args=(layer,)) for layer in range(LAYERS)]
    for thread in waiting:
        thread.start()
    waiting[0].join(0.05)
    assert all(thread.is_alive() for thread in waiting)  # the held copies are not queued yet
    loader.flush_held(shm.mapping).synchronize()
    for thread in waiting:
        thread.join(30)
    assert seen == dict.fromkeys(range(LAYERS), True)
    loader.wait_loads()
    restored = {t for ts in targets for t in ts}
    assert all(not dst[layer][b].any() for layer in range(LAYERS) for b in range(BLOCKS) if b not in restored)
    loader.wait_layer(LAYERS - 1)  # nothing held: no wait
    for _ in range(LAYERS):  # a staging slot's worth of every layer: the most a step may hold
        for _ in range(loader.chunks_per_load):
            loader.stage_load(shm.mapping, shm.span(0, size), [ChunkPart(0, [1])])
        loader.hold_load()
    loader.stage_load(shm.mapping, shm.span(0, size), [ChunkPart(0, [1])])
    with pytest.raises(RuntimeError, match=f"{2 * LAYERS + 1} chunks held, at most {2 * LAYERS}"):
        loader.hold_load()
    loader.drop_held()


@pytest.mark.parametrize(("row_layers", "released"), [(0, [0, 1, 2]), (2, [1, 2]), (99, [2])])
def test_a_device_held_flush_copies_layers_together_in_rows_of_the_least_size(
    row_layers: int, released: list[int]
) -> None:
    """``engine.load_layered_row_mb``: consecutive layers of each held chunk cross together
    (rows of at least that size, a staging slot's worth at most), and are released together."""
    src = layers()
    saver = make_copy("device", src)
    size = saver.chunk_bytes
    shm = Shm(3 * size)
    chunks = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    save_chunks(saver, chunks, shm, [0, size, 2 * size])
    dst = [torch.zeros_like(t) for t in src]
    layer_bytes = size // LAYERS
    loader = DeviceCopy(dst, BLOCKS, PER_CHUNK, 3 * size, 1 << 30, None, 2, row_layers * layer_bytes)
    queued: list[int] = []
    real_queued = loader._held.queued
    loader._held.queued = lambda layer: queued.append(layer) or real_queued(layer)  # type: ignore[method-assign,func-returns-value]
    loader.begin_loads()
    for c in range(3):
        loader.stage_load(shm.mapping, shm.span(c * size, size), [ChunkPart(0, [20 + 4 * c + b for b in range(4)])])
    loader.hold_load()
    loader.flush_held(shm.mapping).synchronize()
    loader.wait_loads()
    assert queued == released
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][20:32], src[layer][1:13])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_held_loads_release_the_engine_uncopied(backend: str) -> None:
    dst = layers(lambda: torch.zeros(BLOCKS, HEADS, TOKENS, HEAD2))
    loader = make_copy(backend, dst, load_batch_bytes=1)
    shm = Shm(loader.chunk_bytes)
    shm.buffer[:] = b"\x01" * len(shm.buffer)
    loader.begin_loads()
    loader.stage_load(shm.mapping, shm.span(0, loader.chunk_bytes), [ChunkPart(0, [5, 6, 7, 8])])
    loader.hold_load()
    waiting = threading.Thread(target=loader.wait_layer, args=(1,))
    waiting.start()
    waiting.join(0.05)
    assert waiting.is_alive()
    loader.drop_held()
    waiting.join(30)
    assert not waiting.is_alive()
    assert loader.flush_held(shm.mapping) is not None and not any(t.any() for t in dst)  # nothing left to copy


# -- the data path against a real gateway (CPU tensors) ------------------------------


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
            "storage": {
                "tiers": [{"name": "ram", "type": "ram", "capacity_gb": 0.25}],
                "probe": False,
                "fallback_path": None,
            },
        },
    )
    yield config
    for path in SHM_DIR.glob(f"{name}.*"):
        path.unlink(missing_ok=True)


def data_path(
    config: Any,
    copy: PageCopy,
    register: Any = None,
    links: tuple[CacheLink, CacheLink] | None = None,
    engine: EngineSection | None = None,
) -> tuple[DataPath, dict[str, float]]:
    switch = RankSwitch()
    counts: dict[str, float] = {}

    def count(**deltas: float) -> None:
        for k, v in deltas.items():
            counts[k] = counts.get(k, 0) + v

    load, save = links or (CacheLink(config, "load", switch=switch), CacheLink(config, "save", switch=switch))
    path = DataPath(copy, NAMES, load, save, 0, b"F" * 16, count, engine or EngineSection(), register=register)
    return path, counts


def stored(saver: DataPath, keys: list[bytes], blocks: list[int]) -> int:
    """``keys`` saved from ``blocks`` in one step of ``saver`` and stored through its link, as
    the saver thread stores them; how many the gateway stored."""
    meta = KVHarborMetadata(saves=[ChunkTransfer("r", [keys], block_ids=[blocks])])
    saver.begin_step(meta)
    parts = saver.end_step(meta)
    assert parts is not None
    try:
        items = [(k, saver.copy.chunk_bytes) for k in keys]
        return saver._save_link.store(saver.fingerprint, items, parts.fill, parts.settle)
    finally:
        parts.done()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_save_names_its_requests_and_tells_whether_it_reads_the_blocks(gateway_config: Any, backend: str) -> None:
    """What the worker decides a step's wait by: a step that answers a request waits for that
    request's saves to land (``engine.saves_land_before_answer``), and a save whose fill
    reads the blocks (the host's) lands them within the step or snapshots them first."""
    path, _ = data_path(gateway_config, make_copy(backend, layers()))
    try:
        assert path.map()
        keys = [bytes([8, i]) * 8 for i in range(3)]
        one = ChunkTransfer("a", [keys[:1]], block_ids=[[1, 2, 3, 4]])
        two = ChunkTransfer("b", [keys[1:]], block_ids=[[5, 6, 7, 8, 9, 10, 11, 12]])
        named = []
        for saves in ([one], [one, two]):
            meta = KVHarborMetadata(saves=saves)
            path.begin_step(meta)
            for name in NAMES:
                path.save_layer(name)
            parts = path.end_step(meta)
            assert parts is not None
            assert parts.reads_blocks == (backend == "host")
            named.append(parts.requests)
            parts.done()
    finally:
        path.close()
    assert named == [{"a"}, {"a", "b"}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_data_path_saves_and_restores_through_the_gateway(gateway_config: Any, backend: str) -> None:
    src = layers()
    saver, _ = data_path(gateway_config, make_copy(backend, src))
    try:
        assert saver.map() and len(saver.mappings) == 2
        keys = [bytes([9, i]) * 8 for i in range(3)]
        save = ChunkTransfer("r", [keys], block_ids=[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
        meta = KVHarborMetadata(saves=[save])
        saver.begin_step(meta)
        for name in NAMES:
            saver.save_layer(name)
        parts = saver.end_step(meta)
        assert parts is not None and parts.keys == keys
        # Host pages are read from the blocks; device ones from staging.
        assert parts.reads_blocks == (backend == "host") and parts.requests == {"r"}
        items = [(k, saver.copy.chunk_bytes) for k in keys]
        stored = saver._save_link.store(saver.fingerprint, items, parts.fill, parts.settle)
        parts.done()
        assert stored == 3

        dst = [torch.zeros_like(t) for t in src]
        loader, counts = data_path(gateway_config, make_copy(backend, dst))
        assert loader.map()
        load = ChunkTransfer("r", [keys], block_ids=[[30, 31, 32, 33, 34, 35, 36, 37, 38]], skip_blocks=2)
        loader.begin_loads()
        loader.begin_step(KVHarborMetadata(loads=[load]))
        # Chunk 0 from its third block (two blocks were a local hit) + chunk 1 + 3 blocks of chunk 2,
        # one chunk per gateway request (load_batch_bytes=1).
        asked: list[int] = []

        def proceed(done: int) -> bool:
            asked.append(done)
            return True

        assert loader.load(load, proceed) == 9
        loader.wait_layer(NAMES[1])
        loader.end_step(KVHarborMetadata())
        assert asked == [1, 2]  # the policy is asked before each further request
        sources = [3, 4, 5, 6, 7, 8, 9, 10, 11]
        for layer in range(LAYERS):
            for target, source in zip(load.block_ids[0], sources, strict=True):
                assert torch.equal(dst[layer][target], src[layer][source])
        assert counts["loaded_chunks"] == 3
        # A policy that stops the load after the first request: only chunk 0's blocks are restored.
        again = ChunkTransfer("r", [keys], block_ids=[list(range(20, 32))])
        loader.begin_loads()
        assert loader.load(again, proceed=lambda done: False) == PER_CHUNK
        loader.close()
    finally:
        saver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_load_told_when_answered_copies_its_last_requests_layer_by_layer(gateway_config: Any, backend: str) -> None:
    """As the loader thread restores (`DataPath.load` with ``answered``): the last
    ``engine.load_layered_mb`` of requests are held, the engine is told what the gateway
    answered, then they are copied in layer by layer; the rest streams as before."""
    src = layers()
    saver, _ = data_path(gateway_config, make_copy(backend, src))
    dst = [torch.zeros_like(t) for t in src]
    # One chunk per request; layered: the last two requests (a chunk is 96 KiB, the setting 0.2 MiB).
    loader, counts = data_path(gateway_config, make_copy(backend, dst), engine=EngineSection(load_layered_mb=0))
    loader._layered_bytes = 2 * loader.copy.chunk_bytes + 1  # Whole requests only: two of them.
    try:
        assert saver.map() and loader.map()
        keys = [bytes([10, i]) * 8 for i in range(4)]
        assert stored(saver, keys, list(range(1, 17))) == 4

        order: list[str] = []
        copy = loader.copy
        real_flush, real_held = copy.flush_load, copy.flush_held

        def flush_load(mapping: PinnedMapping) -> Wait:
            order.append("flush")
            return real_flush(mapping)

        def flush_held(mapping: PinnedMapping) -> Wait:
            order.append("flush_held")
            return real_held(mapping)

        copy.flush_load = flush_load  # type: ignore[method-assign]
        copy.flush_held = flush_held  # type: ignore[method-assign]
        load = ChunkTransfer("r", [keys], block_ids=[list(range(20, 35))], skip_blocks=1)
        loader.begin_loads()
        assert loader.load(load, answered=lambda b: order.append(f"answered{b}")) == 15
        loader.end_step(KVHarborMetadata())
        assert order == ["flush", "flush", "answered15", "flush_held"]
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][20:35], src[layer][2:17])
        assert counts["loaded_chunks"] == 4
    finally:
        loader.close()
        saver.close()


class Copying:
    """A flush's copies as a GPU's copy engine runs them: still running until ``finished`` is
    set (no copy engine here; the bytes were copied by the real flush underneath)."""

    def __init__(self, real: Any, finished: threading.Event) -> None:
        self.real, self.finished = real, finished

    def query(self) -> bool:
        return self.finished.is_set()

    def synchronize(self) -> None:
        assert self.finished.wait(60)
        self.real.synchronize()


@pytest.mark.parametrize("keeps_up", [False, True])
def test_a_load_is_ahead_once_as_many_requests_as_may_be_are_still_being_copied(
    gateway_config: Any, keeps_up: bool
) -> None:
    """`DataPath.load` tells ``ahead`` (the engine's thread then stops waiting for the loader:
    `WorkerSide.prepare_load`) when the loader is about to wait for copies still running with
    ``loads_queued_max`` requests under way (three here), not when it queued them: copies
    that finish meanwhile leave room for more. Copies done by the time their flush returned
    (they keep up with the loader, as a CPU's) are as far ahead as they get at once."""
    src = layers()
    saver, _ = data_path(gateway_config, make_copy("device", src))
    dst = [torch.zeros_like(t) for t in src]
    loader, counts = data_path(gateway_config, make_copy("device", dst), engine=EngineSection(load_layered_mb=0))
    keys = [bytes([12, i]) * 8 for i in range(6)]
    try:
        assert saver.map() and loader.map()
        assert stored(saver, keys, list(range(24))) == 6

        copy, real_flush = loader.copy, loader.copy.flush_load
        assert copy.loads_queued_max == 3
        finished, ahead = threading.Event(), threading.Event()
        if keeps_up:
            finished.set()
        flushes: list[int] = []

        def flush_load(mapping: Any) -> Copying:
            flushes.append(len(flushes) + 1)
            return Copying(real_flush(mapping), finished)

        def told() -> None:
            if not ahead.is_set():
                flushes.append(0)  # Where in the flushes the first word came.
                ahead.set()

        copy.flush_load = flush_load  # type: ignore[method-assign]
        load = ChunkTransfer("r", [keys], block_ids=[list(range(16, 40))])
        loader.begin_loads()
        restored: list[int] = []
        thread = threading.Thread(target=lambda: restored.append(loader.load(load, ahead=told)))
        thread.start()
        assert ahead.wait(60)
        first = flushes.index(0)
        finished.set()
        thread.join(60)
        loader.end_step(KVHarborMetadata())
        # One chunk per request: ahead after the first flush whose copies were done, else once
        # the loader has three under way and waits for the first, still running.
        assert first == (1 if keeps_up else 3)
        assert restored == [24] and counts["loaded_chunks"] == 6
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][16:40], src[layer][0:24])
    finally:
        loader.close()
        saver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_stores_none_of_the_chunks_of_a_dropped_request(backend: str) -> None:
    """A request whose restore fell short after the forward pass had started (`WorkerSide._settle`)
    has its chunks of the step left out of what is stored; the others keep their pages."""
    src = layers()
    copy = make_copy(backend, src)
    path, _ = data_path(Config(), copy)
    shm = [Shm(4 * copy.chunk_bytes), Shm(4 * copy.chunk_bytes)]
    path.mappings = [shm[0].mapping, shm[1].mapping]
    a, b = (
        ChunkTransfer("a", [[b"a" * 16, b"A" * 16]], block_ids=[list(range(1, 9))]),
        ChunkTransfer("b", [[b"b" * 16]], block_ids=[[9, 10, 11, 12]]),
    )
    meta = KVHarborMetadata(saves=[a, b])
    path.begin_step(meta)
    for name in NAMES:
        path.save_layer(name)
    parts = path.end_step(meta, dropped={"a"})
    assert parts is not None and parts.keys == [b"b" * 16]
    parts.fill(0, shm[1].span(0, copy.chunk_bytes))
    parts.settle()
    parts.done()
    stored = bytes(shm[1].span(0, copy.chunk_bytes))
    assert stored == b"".join(
        stored_block(backend, src[layer], blk) for layer in range(LAYERS) for blk in (9, 10, 11, 12)
    )


def test_the_data_path_turns_the_cache_off_when_pinning_fails(
    gateway_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(address: int, nbytes: int) -> None:
        raise PinError("cudaHostRegister(64 MiB) failed with CUDA error 2 cudaErrorMemoryAllocation")

    path, _ = data_path(gateway_config, make_copy("device", layers()), register=refuse)
    try:
        assert not path.map()
        assert path.mappings == [] and path._load_link.is_off and path._save_link.is_off
        assert "cannot be page-locked" in caplog.text and "keeps serving" in caplog.text
        load = ChunkTransfer("r", [[b"k" * 16]], block_ids=[[1, 2, 3, 4]])
        assert path.load(load) == 0  # every planned block is a load error: recomputed
        meta = KVHarborMetadata(saves=[load])
        path.begin_step(meta)
        path.save_layer(NAMES[0])
        assert path.end_step(meta) is None  # nothing staged, nothing stored
    finally:
        path.close()


def test_the_load_staging_is_reserved_at_start_and_a_device_without_room_turns_the_cache_off(
    gateway_config: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = data_path(gateway_config, make_copy("device", layers()))
    try:
        assert path.map()
        copy = path.copy
        assert isinstance(copy, DeviceCopy)
        slots = list(copy._slots)
        assert len(slots) == 2 and all(s.numel() == copy.chunks_per_load * copy.chunk_bytes for s in slots)
    finally:
        path.close()
    # A GPU without room for the two slots (CPU tensors cannot run out: the allocator is made to).
    real_empty = torch.empty
    slot_bytes = copy.chunks_per_load * copy.chunk_bytes

    def empty(*size: Any, **kwargs: Any) -> Any:
        if size == (slot_bytes,) and kwargs.get("dtype") is torch.uint8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    path, _ = data_path(gateway_config, make_copy("device", layers()))
    try:
        assert not path.map()
        assert path.mappings == [] and path._load_link.is_off
        assert "load staging slots" in caplog.text and "engine.load_batch_mb" in caplog.text
        assert "keeps serving" in caplog.text
        assert path.load(ChunkTransfer("r", [[b"k" * 16]], block_ids=[[1, 2, 3, 4]])) == 0  # recomputed
    finally:
        path.close()


def test_a_step_that_waited_for_staging_is_not_a_prefill_sample() -> None:
    switch = RankSwitch()
    links = (
        CacheLink(Config(), "load", connect=lambda c, n: None, switch=switch),  # type: ignore[arg-type,return-value]
        CacheLink(Config(), "save", connect=lambda c, n: None, switch=switch),  # type: ignore[arg-type,return-value]
    )
    copy = DeviceCopy(layers(), BLOCKS, PER_CHUNK, 1, 1, None, loads_in_flight_max=2, layered_row_bytes=0)
    path, _ = data_path(Config(), copy, links=links, engine=EngineSection(save_staging_wait_ms=60_000))
    path.mappings = [Shm(copy.chunk_bytes).mapping, Shm(copy.chunk_bytes).mapping]
    meta = KVHarborMetadata(saves=[ChunkTransfer("r", [[b"k" * 16]], block_ids=[[1, 2, 3, 4]])])
    path.begin_step(meta)
    path.save_layer(NAMES[0])
    assert not path.stalled
    parts = path.end_step(meta)
    assert parts is not None  # holds the only chunk of staging until done()
    path.begin_step(meta)
    threading.Timer(0.05, parts.done).start()
    path.save_layer(NAMES[0])  # waits for the staging the previous step still holds
    assert path.stalled
    later = path.end_step(meta)
    assert later is not None
    later.done()


def test_device_loads_are_ordered_after_the_engine_or_refused() -> None:
    """A scatter must follow the engine's work queued before the step's loads, recorded on
    the engine's thread (`DeviceCopy.begin_loads`): a flush without it is a bug, refused."""
    src = layers()
    copy = make_copy("device", src, load_batch_bytes=1)
    shm = Shm(copy.chunk_bytes)
    copy.stage_load(shm.mapping, shm.span(0, copy.chunk_bytes), [ChunkPart(0, [1, 2, 3, 4])])
    with pytest.raises(RuntimeError, match="flush_load before begin_loads"):
        copy.flush_load(shm.mapping)
    copy.begin_loads()
    copy.stage_load(shm.mapping, shm.span(0, copy.chunk_bytes), [ChunkPart(0, [1, 2, 3, 4])])
    copy.flush_load(shm.mapping).synchronize()
    copy.wait_loads()  # The step's end: the next step's loads need their own begin_loads.
    copy.stage_load(shm.mapping, shm.span(0, copy.chunk_bytes), [ChunkPart(0, [1, 2, 3, 4])])
    with pytest.raises(RuntimeError, match="flush_load before begin_loads"):
        copy.flush_load(shm.mapping)
