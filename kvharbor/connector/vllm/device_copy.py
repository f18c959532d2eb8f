"""Page copies for a cache on a GPU, through page-locked shared memory (`pinning`).

A chunk's blocks are scattered over the cache, so they are gathered on the GPU
(``index_select`` per layer) into a contiguous staging buffer and cross PCIe
in one device-to-host copy per run of chunks that lie next to each other in
shared memory; loads cross in one host-to-device copy per run into one of two
staging slots and are scattered into their blocks, a layer at a time (`_Scatter`).
Device-to-device traffic is ~4 TB/s, so the gather and the scatter cost a few
percent of the PCIe time they save.

Host-to-device copies, scatters, gathers and device-to-host copies each run on
a stream of their own, ordered by events: a load's copy of request n+1
overlaps the scatter of request n; a held load (`flush_held`) crosses one layer
at a time, each layer's pages of every held chunk in one two-dimensional copy
per run of chunks (`rows`), so the engine's forward pass computes a layer while
the next ones cross; a save's gathers run layer by layer during
the forward pass and its device-to-host copy behind the engine, on the saver
thread. The engine's stream waits for a layer's loads only where that layer
needs them and for a step's gathers only at the end of the step (the blocks
may be reused after it). Pages are stored as they lie in memory
(`pages.block_major`), as they always were. On CPU tensors the streams are
no-ops (`streams`), which is how CI tests this logic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvharbor.connector.vllm.chunks import ChunkPart, GroupBlocks, contiguous_runs
from kvharbor.connector.vllm.copier import (
    COPIED,
    HeldLoads,
    Holding,
    LoadStage,
    StagedChunk,
    StagingUnavailable,
    StepSave,
    Wait,
    load_request_chunks,
)
from kvharbor.connector.vllm.pages import PageLayers, block_major
from kvharbor.connector.vllm.pinning import PinnedMapping
from kvharbor.connector.vllm.rows import copy_rows
from kvharbor.connector.vllm.streams import Event, engine_stream, new_stream, synchronize

if TYPE_CHECKING:
    from kvharbor.config import EngineSection

LOAD_SLOTS = 2
"""Device staging slots of loads: one is copied in while the other is scattered (the copy
stream waits for a slot's scatter before its next copy, so any number of requests may be
queued over two)."""


class DeviceCopy(Holding):
    snapshots_saves = True

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        load_batch_bytes: int,
        save_staging_bytes_max: int,
        groups: Sequence[int] | None,
        loads_in_flight_max: int,
        layered_row_bytes: int,
    ) -> None:
        """``load_batch_bytes``: bytes asked of the gateway per load request, and the size of each
        of the two device staging slots loads pass through (`LOAD_SLOTS`).
        ``save_staging_bytes_max``: device memory that saves still waiting for their
        device-to-host copy may hold (at least one chunk). ``groups``: each tensor's KV cache
        group (None: one group). ``loads_in_flight_max``: load requests whose copies may be
        queued at once (``engine.loads_in_flight_max``). ``layered_row_bytes``: the least bytes of a
        chunk a held flush copies at once (``engine.load_layered_row_mb``: `_layers_per_row`)."""
        if blocks_per_chunk <= 0 or loads_in_flight_max <= 0:
            raise ValueError(
                f"blocks_per_chunk {blocks_per_chunk} and loads_in_flight_max {loads_in_flight_max} must be positive"
            )
        self.loads_queued_max = loads_in_flight_max
        self._layered_row_bytes = layered_row_bytes
        self.pages = PageLayers.of(tensors, num_blocks, block_major, groups)
        self.blocks_per_chunk = blocks_per_chunk
        self.chunks_per_load = load_request_chunks(load_batch_bytes, self.chunk_bytes)
        self.save_staging_bytes_max = max(save_staging_bytes_max, self.chunk_bytes)
        self.device = self.pages.device
        self._h2d = new_stream(self.device)
        self._scatter = new_stream(self.device)
        self.gathers = new_stream(self.device)
        self.d2h = new_stream(self.device)
        self._slots: list[torch.Tensor] = []
        self._slot_free: list[Event | None] = [None] * LOAD_SLOTS
        self._next_slot = 0
        self._stage = LoadStage(self)
        self._held = HeldLoads(self._stage, self.chunks_per_load * len(self.pages.layers))
        """A layer of at most this many chunks fills one staging slot."""
        self._layer_ready: list[Event] = []
        """Per layer, the event after its latest scatter."""
        self._engine_before_loads: Event | None = None
        """The engine's work queued before the step's loads (`begin_loads`): scatters wait for it."""
        self._staging_bytes = 0
        self._staging = threading.Condition()
        self.staging_waited_s = 0.0

    @classmethod
    def for_engine(
        cls,
        tensors: Sequence[torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        engine: EngineSection,
        groups: Sequence[int] | None = None,
    ) -> DeviceCopy:
        """The copy an engine of these settings runs with."""
        return cls(
            tensors,
            num_blocks,
            blocks_per_chunk,
            engine.load_batch_bytes,
            engine.save_staging_bytes_max,
            groups,
            engine.loads_in_flight_max,
            engine.load_layered_row_bytes,
        )

    @property
    def chunk_bytes(self) -> int:
        return self.pages.chunk_bytes(self.blocks_per_chunk)

    def index(self, *rows: Sequence[int]) -> torch.Tensor:
        """``rows`` of equal length as one ``(len(rows), n)`` index tensor on the device, in one
        copy. From pageable memory: page-locking a few KiB per load request cost more than it
        saved (H200, 2026-12-01: restores at 44.9 GB/s instead of 54.0)."""
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    # -- loads: shared memory -> staging slot -> blocks ---------------------------------

    def reserve_loads(self) -> None:
        """The two staging slots, allocated once (they stay for the engine's life)."""
        if self._slots:
            return
        nbytes = self.chunks_per_load * self.chunk_bytes
        try:
            slots = range(LOAD_SLOTS)
            self._slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in slots]
        except torch.OutOfMemoryError:
            self._slots = []
            raise StagingUnavailable(
                f"the two load staging slots of {nbytes >> 20} MiB (engine.load_batch_mb) do not fit "
                f"in the free memory of {self.device}"
            ) from None

    def begin_loads(self) -> None:
        self.wait_loads()  # An earlier step's, should any be left: its events are not this step's.
        # Recorded here, on the engine's thread: on the loader thread the current stream is another.
        self._engine_before_loads = engine_stream(self.device).record()

    def stage_load(self, mapping: PinnedMapping, view: memoryview, parts: Sequence[ChunkPart]) -> None:
        self._stage.add(mapping, view, parts)

    def flush_load(self, mapping: PinnedMapping) -> Wait:
        """Copy the staged chunks in and scatter them; the returned wait blocks until
        their shared memory has been read (and may be given back)."""
        staged = self._stage.take()
        if not staged:
            return COPIED
        engine = self._engine_event("flush_load")
        slot_index, slot = self._take_slot()
        size = self.chunk_bytes
        with self._h2d.on():
            self._h2d.wait(self._slot_free[slot_index])
            for at, count, offset in contiguous_runs([chunk.offset for chunk in staged], size):
                run = staged[at : at + count]
                if all(part.targets for chunk in run for part in chunk.parts):
                    source = mapping.tensor[offset : offset + count * size]
                    slot[at * size : (at + count) * size].copy_(source, non_blocking=True)
                    continue
                # Some group restores nothing from some chunk (out of its window): its bytes stay.
                for k, chunk in enumerate(run):
                    for group, part in enumerate(chunk.parts):
                        if part.targets:
                            start, end = self.pages.group_bytes(group, self.blocks_per_chunk)
                            source = mapping.tensor[offset + k * size + start : offset + k * size + end]
                            slot[(at + k) * size + start : (at + k) * size + end].copy_(source, non_blocking=True)
            copied = self._h2d.record()
        layers, elems, shape = self.pages.layers, self.pages.page_elems, self.pages.page_shape
        with self._scatter.on():
            self._scatter.wait(engine)
            self._scatter.wait(copied)
            pages = slot[: len(staged) * size].view(self.pages.dtype).view(len(staged), len(layers), -1, elems)
            scatters = [self._scatter_index(staged, group) for group in range(self.pages.group_count)]
            ready = []
            for layer_index, (layer, group) in enumerate(zip(layers, self.pages.groups, strict=True)):
                scatter = scatters[group]
                if scatter is not None:
                    scatter.into(layer, pages[:, layer_index], shape)
                ready.append(self._scatter.record())
            self._slot_free[slot_index] = ready[-1]
            self._layer_ready = ready
        return copied

    def flush_held(self, mapping: PinnedMapping) -> Wait:
        """Each layer in turn: its pages of every held chunk that restores its group cross
        into a staging slot (a two-dimensional copy per run of chunks back to back in shared
        memory) and are scattered into its blocks; `wait_layer` is released for it then."""
        held = self._held.take()
        try:
            return self._flush_layers(mapping, held) if held else COPIED
        finally:
            self._held.release()

    def _flush_layers(self, mapping: PinnedMapping, held: Sequence[StagedChunk]) -> Wait:
        engine = self._engine_event("flush_held")
        pages, size = self.pages, self.chunk_bytes
        layer_bytes = size // len(pages.layers)
        ready = list(self._layer_ready) or [self._scatter.record()] * len(pages.layers)
        self._layer_ready = ready
        self._scatter.wait(engine)
        copied = None
        for group in range(pages.group_count):
            first = pages.groups.index(group)
            end = first + pages.groups.count(group)
            chunks = [chunk for chunk in held if chunk.parts[group].targets]
            if not chunks:  # Out of this group's window: nothing of it to restore.
                self._held.queued(end - 1)
                continue
            runs = [(at, n) for _, n, at in contiguous_runs([c.offset for c in chunks], size)]
            with self._scatter.on():  # The index copy goes on the stream of the scatters that read it.
                scatter = self._scatter_index(chunks, group)
            if scatter is None:
                raise RuntimeError(f"held chunks restore blocks of group {group} and its scatter has none")
            step = self._layers_per_row(len(chunks), end - first, layer_bytes)
            for start in range(first, end, step):
                stop = min(start + step, end)
                slot_index, slot = self._take_slot()
                with self._h2d.on():
                    self._h2d.wait(self._slot_free[slot_index])
                    layer_runs = [(offset + start * layer_bytes, n) for offset, n in runs]
                    copy_rows(slot, mapping.tensor, layer_runs, (stop - start) * layer_bytes, size)
                    copied = self._h2d.record()
                with self._scatter.on():
                    self._scatter.wait(copied)
                    rows = slot[: len(chunks) * (stop - start) * layer_bytes].view(pages.dtype)
                    rows = rows.view(len(chunks), stop - start, -1, pages.page_elems)
                    for j in range(start, stop):
                        scatter.into(pages.layers[j], rows[:, j - start], pages.page_shape)
                    event = self._slot_free[slot_index] = self._scatter.record()
                ready[start:stop] = [event] * (stop - start)
                self._held.queued(stop - 1)
        return copied if copied is not None else COPIED

    def _layers_per_row(self, chunks: int, layers: int, layer_bytes: int) -> int:
        """Consecutive layers of ``chunks`` held chunks copied at once: rows of at least
        ``engine.load_layered_row_mb``, as many as a staging slot holds for all of them."""
        slot_layers = self.chunks_per_load * self.chunk_bytes // (chunks * layer_bytes)
        wanted = -(-self._layered_row_bytes // layer_bytes)
        return max(1, min(layers, slot_layers, wanted))

    def _engine_event(self, flush: str) -> Event:
        """The engine's work a flush's scatters must follow (`begin_loads`), the slots reserved."""
        engine = self._engine_before_loads
        if engine is None:  # A scatter not ordered after the engine could overwrite blocks it still reads.
            raise RuntimeError(f"{flush} before begin_loads: the loads are not ordered after the engine's work")
        self.reserve_loads()  # Done at start when the data path maps its memory.
        return engine

    def _take_slot(self) -> tuple[int, torch.Tensor]:
        """The next staging slot, in turn (its copy waits for its last scatter: `_slot_free`)."""
        index = self._next_slot
        self._next_slot = (index + 1) % len(self._slots)
        return index, self._slots[index]

    def _scatter_index(self, staged: Sequence[StagedChunk], group: int) -> _Scatter | None:
        """One group's scatter of ``staged``, its index on the device; None when the group
        restores nothing from these chunks (out of its window)."""
        parts = [chunk.parts[group] for chunk in staged]
        targets = [block for part in parts for block in part.targets]
        if not targets:
            return None
        per = self.blocks_per_chunk
        if all(part.first == 0 and len(part.targets) == per for part in parts):
            # Whole chunks: the chunk and block of each row are implied, only the targets cross.
            return _Scatter(self.index(targets)[0].view(len(staged), per), None)
        chunk_index = [c for c, part in enumerate(parts) for _ in part.targets]
        block_index = [part.first + k for part in parts for k in range(len(part.targets))]
        rows = self.index(chunk_index, block_index, targets)
        return _Scatter(rows[2], (rows[0], rows[1]))

    def wait_layer(self, layer: int) -> None:
        self._held.wait(layer)
        if self._layer_ready:
            engine_stream(self.device).wait(self._layer_ready[layer])

    def wait_loads(self) -> None:
        self._held.wait()  # A layer the forward pass did not wait for may still be being queued.
        if self._layer_ready:
            engine_stream(self.device).wait(self._layer_ready[-1])
            self._layer_ready = []
        self._engine_before_loads = None

    # -- saves: blocks -> staging (during the forward) -> shared memory (behind it) ------

    def open_save(self, block_ids: Sequence[GroupBlocks], wait_s: float) -> StepSave | None:
        """Staging for the chunks that fit in ``save_staging_bytes_max``: all of them, once
        earlier saves have given back enough (at most ``wait_s`` later), or the leading ones
        the room then left takes."""
        wanted = min(len(block_ids), self.save_staging_bytes_max // self.chunk_bytes)
        if wanted <= 0:
            return None
        with self._staging:

            def room() -> int:
                return (self.save_staging_bytes_max - self._staging_bytes) // self.chunk_bytes

            # Only the wait itself counts as a stall, not the time this thread took to get
            # here: a loaded machine must not turn every step into a stalled one.
            self.staging_waited_s = 0.0
            if room() < wanted and wait_s > 0:
                started = time.perf_counter()
                self._staging.wait_for(lambda: room() >= wanted, timeout=wait_s)
                self.staging_waited_s = time.perf_counter() - started
            chunks = min(wanted, room())
            if chunks <= 0:
                return None
            nbytes = chunks * self.chunk_bytes
            self._staging_bytes += nbytes
        per_group = [[b for blocks in block_ids[:chunks] for b in blocks[g]] for g in range(self.pages.group_count)]
        if any(len(flat) != chunks * self.blocks_per_chunk for flat in per_group):
            self.give_back(nbytes)
            raise ValueError(
                f"{[len(flat) for flat in per_group]} blocks per group for {chunks} whole chunks of "
                f"{self.blocks_per_chunk} blocks"
            )
        try:
            with self.gathers.on():
                ids = self.index(*per_group)
                staging = torch.empty(
                    (chunks, len(self.pages.layers), self.blocks_per_chunk, self.pages.page_elems),
                    dtype=self.pages.dtype,
                    device=self.device,
                )
        except torch.OutOfMemoryError:
            self.give_back(nbytes)
            return None
        return _DeviceSave(self, chunks, ids, staging, nbytes)

    def give_back(self, nbytes: int) -> None:
        with self._staging:
            self._staging_bytes -= nbytes
            if self._staging_bytes < 0:
                raise RuntimeError(f"save staging given back twice ({self._staging_bytes} B held)")
            self._staging.notify_all()

    @property
    def staging_bytes(self) -> int:
        return self._staging_bytes

    def close(self) -> None:
        synchronize(self.device)
        self._slots = []
        self._layer_ready = []


@dataclass(frozen=True, slots=True)
class _Scatter:
    """One cache group's scatter of staged chunks into their blocks, its index on the device."""

    targets: torch.Tensor
    """The engine's blocks the rows go to: ``(chunks, blocks_per_chunk)`` when every staged chunk
    restores all its blocks (`rows` is None), else one per row."""
    rows: tuple[torch.Tensor, torch.Tensor] | None
    """(chunk, block in chunk) of each row, where some chunk restores only some of its blocks."""

    def into(self, layer: torch.Tensor, pages: torch.Tensor, page_shape: Sequence[int]) -> None:
        """Scatter ``pages`` (``(chunks, blocks_per_chunk, page elements)``: one layer of the
        staged chunks) into ``layer`` (``(num_blocks, *page_shape)``). Whole chunks are scattered
        from the staging itself (a 2-D index, no gather): one kernel and a few Python calls per
        layer, which the loader thread pays for every layer of every load request."""
        if self.rows is None:
            layer.index_put_((self.targets,), pages.view(*pages.shape[:2], *page_shape))
            return
        chunk, block = self.rows
        layer.index_copy_(0, self.targets, pages[chunk, block].view(len(self.targets), *page_shape))


class _DeviceSave:
    """One step's saves: the chunks' pages, gathered layer by layer into staging of their own."""

    def __init__(self, copy: DeviceCopy, chunks: int, ids: torch.Tensor, staging: torch.Tensor, nbytes: int) -> None:
        self.copy = copy
        self.chunks = chunks
        self.ids = ids
        """``(groups, chunks x blocks_per_chunk)``: each group's block ids, on the device."""
        self.staging = staging
        """``(chunks, layers, blocks_per_chunk, page)``: chunk c is the bytes it is stored as."""
        self.nbytes = nbytes
        """Staging bytes held (0 once released)."""
        self.gathered = [False] * len(copy.pages.layers)
        self.ready: Event | None = None
        """Every layer gathered."""
        self.copies: list[tuple[int, int]] = []
        """(chunk, offset in shared memory) of the device-to-host copies to make."""

    def gather_layer(self, layer: int) -> None:
        if self.gathered[layer]:
            return
        copy = self.copy
        written = engine_stream(copy.device).record()
        with copy.gathers.on():
            copy.gathers.wait(written)
            pages = copy.pages.layers[layer].index_select(0, self.ids[copy.pages.groups[layer]])
            self.staging[:, layer].copy_(pages.view(self.chunks, copy.blocks_per_chunk, copy.pages.page_elems))
        self.gathered[layer] = True

    def close(self) -> None:
        for layer, done in enumerate(self.gathered):
            if not done:
                self.gather_layer(layer)
        self.ready = self.copy.gathers.record()
        engine_stream(self.copy.device).wait(self.ready)

    def snapshot(self, chunks: Sequence[int]) -> int:
        return len(chunks)  # Gathered into staging of its own by `close`.

    def stage(self, chunk: int, mapping: PinnedMapping, view: memoryview) -> None:
        if view.nbytes != self.copy.chunk_bytes or not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk {chunk} of {self.chunks} into {view.nbytes} B, not a whole chunk")
        self.copies.append((chunk, mapping.offset(view)))

    def flush(self, mapping: PinnedMapping) -> Wait:
        """Start copying the staged chunks to shared memory (on the saver thread, not the
        engine's); the returned wait blocks until they are there."""
        copies, self.copies = self.copies, []
        if not copies:
            return COPIED
        d2h, size = self.copy.d2h, self.copy.chunk_bytes
        staged = self.staging.view(torch.uint8).view(self.chunks, size)
        with d2h.on():
            d2h.wait(self.ready)
            order = sorted(copies, key=lambda c: c[1])
            chunks = [c for c, _ in order]
            for at, count, offset in contiguous_runs([o for _, o in order], size):
                first = chunks[at]
                if chunks[at : at + count] == list(range(first, first + count)):
                    mapping.tensor[offset : offset + count * size].copy_(
                        staged[first : first + count].view(-1), non_blocking=True
                    )
                else:
                    for k in range(count):
                        target = mapping.tensor[offset + k * size : offset + (k + 1) * size]
                        target.copy_(staged[chunks[at + k]], non_blocking=True)
            return d2h.record()

    def release(self) -> None:
        if self.nbytes:
            if self.ready is not None:
                self.ready.synchronize()
            nbytes, self.nbytes = self.nbytes, 0
            self.staging = self.ids = torch.empty(0, device=self.copy.device)
            self.copy.give_back(nbytes)
