"""The page-copy interface the one data path (`datapath.DataPath`) drives.

Four moves for each direction: **plan** (`chunks`), **stage** (name a stored
chunk and its blocks), **flush** (start the copies of what was staged) and
**wait** (the flush's returned `Wait`: the shared memory has been read or
written). A load's last requests may instead be **held** and flushed together
layer by layer (`PageCopy.flush_held`), so that the engine computes a layer
while later ones are copied in (`HeldLoads`). Two implementations: `host_copy.HostCopy` for a cache in host
memory (vLLM's CPU backend) and `device_copy.DeviceCopy` for one on a GPU.
Each keeps the page order its stored objects have always had (`pages`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from kvharbor.connector.vllm.chunks import ChunkPart, GroupBlocks
from kvharbor.connector.vllm.pages import PageLayers
from kvharbor.connector.vllm.pinning import PinnedMapping
from kvharbor.connector.vllm.streams import HostEvent

MIB = 1 << 20


class Wait(Protocol):
    """A flush's copies (the `streams.Event` after them): once `synchronize` returns they have
    read (loads) or written (saves) the shared memory."""

    def synchronize(self) -> None:
        """Block the calling thread until then."""

    def query(self) -> bool:
        """Whether they have by now (never blocks)."""


COPIED: Final[Wait] = HostEvent()
"""The wait of copies made by the time their flush returned (or of none)."""


class StagingUnavailable(Exception):
    """The device has no room for the staging loads pass through."""


class StepSave(Protocol):
    """One step's saves of ``chunks`` chunks: gathered during the step, copied out behind it."""

    @property
    def chunks(self) -> int: ...

    def gather_layer(self, layer: int) -> None:
        """The forward pass has written ``layer``: copy its pages of the step's chunks, behind it."""

    def close(self) -> None:
        """End of the step: gather what the forward pass did not report; once the engine's
        stream has passed this point the step's blocks may be reused."""

    def snapshot(self, chunks: Sequence[int]) -> int:
        """After `close`, on the engine's thread: make the save of ``chunks`` (the ones that
        will be staged, in order) independent of the step's blocks, a copy of their pages of
        its own within the copy's save staging, so that they may be staged after the step
        returns; returns how many of the leading ones it keeps (the rest are not saved). A
        copy that `PageCopy.snapshots_saves` keeps them all."""

    def stage(self, chunk: int, mapping: PinnedMapping, view: memoryview) -> None:
        """Chunk ``chunk`` is to be stored in ``view`` (lent by the gateway)."""

    def flush(self, mapping: PinnedMapping) -> Wait:
        """Start the staged chunks' copies into shared memory."""

    def release(self) -> None:
        """Give the save's resources back (after its copies, or when they are abandoned)."""


class PageCopy(Protocol):
    """Whole chunks between the paged cache and shared memory; see the module docstring."""

    pages: PageLayers
    blocks_per_chunk: int
    chunks_per_load: int
    """Chunks asked of the gateway per load request (flush after at most this many)."""
    loads_queued_max: int
    """Load requests whose copies can be under way at once (the loader holds at most this many
    of the gateway's: `CacheLink.load_streamed`): a restore's copies are as far ahead of their
    copy engine as they get once this many are still being copied."""
    snapshots_saves: bool
    """True: `StepSave.close` leaves the step's pages copied into staging of the save's own,
    so the saver thread may fill shared memory later. False: the pages are read from the
    blocks when the save is staged, so the step must wait for that before its blocks are
    reused, unless it takes a `StepSave.snapshot` first."""
    staging_waited_s: float
    """How long the latest `open_save` waited for staging room: 0.0 when it had room at once
    (a step that waited is no prefill sample)."""

    @property
    def chunk_bytes(self) -> int: ...

    def reserve_loads(self) -> None:
        """Allocate what loads pass through, before the first one (at start): the first
        restore pays no allocation. Raises `StagingUnavailable` when it does not fit."""

    def begin_loads(self) -> None:
        """On the engine's thread, before a step's first `stage_load`: the step's loads write
        their blocks only after the engine's work queued so far (which may still use them as
        another request's). The loads themselves may then run on another thread."""

    def stage_load(self, mapping: PinnedMapping, view: memoryview, parts: Sequence[ChunkPart]) -> None:
        """Add a stored chunk to the load request in progress: in each cache group (one
        `ChunkPart` per group), its blocks ``first .. first + len(targets)`` go to ``targets``."""

    def flush_load(self, mapping: PinnedMapping) -> Wait:
        """Start copying the staged chunks into their blocks."""

    @property
    def held_chunks_max(self) -> int:
        """The most chunks a step may hold for `flush_held`."""

    def hold_load(self) -> None:
        """Keep the chunks staged since the last flush or hold for `flush_held`, uncopied.
        From the first hold of a step until `flush_held` or `drop_held`, `wait_layer`
        blocks for layers whose held copies are not queued yet."""

    def flush_held(self, mapping: PinnedMapping) -> Wait:
        """Copy every held chunk in, one layer at a time: each layer's pages of all of them,
        then the next layer, each layer released to `wait_layer` as soon as its copies are
        queued. The returned wait blocks until the held chunks' shared memory has been read."""

    def drop_held(self) -> None:
        """Forget the held chunks, uncopied (their load failed), and release every layer."""

    def wait_layer(self, layer: int) -> None:
        """Make the engine wait for the loads into one layer: the calling thread waits until
        that layer's held copies are queued (`hold_load`), the engine's work for their end."""

    def wait_loads(self) -> None:
        """Make the engine wait for every load so far (end of a step), held ones included."""

    def open_save(self, block_ids: Sequence[GroupBlocks], wait_s: float) -> StepSave | None:
        """A save of the given chunks' blocks (``blocks_per_chunk`` each in every group), or of
        as many of the leading ones as fit, after waiting up to ``wait_s`` for room; None: no
        room came."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class StagedChunk:
    """A stored chunk of a load request at ``offset`` in shared memory, and where each cache
    group's blocks of it go."""

    offset: int
    parts: tuple[ChunkPart, ...]


class LoadStage:
    """The chunks of the load request being staged, checked against the copy's chunk."""

    def __init__(self, copy: PageCopy) -> None:
        self._copy = copy
        self.staged: list[StagedChunk] = []

    def add(self, mapping: PinnedMapping, view: memoryview, parts: Sequence[ChunkPart]) -> None:
        copy = self._copy
        if view.nbytes != copy.chunk_bytes:
            raise ValueError(f"a stored chunk of {view.nbytes} B staged where {copy.chunk_bytes} B are expected")
        if len(parts) != copy.pages.group_count:
            raise ValueError(
                f"{len(parts)} group part(s) of a chunk staged for {copy.pages.group_count} cache group(s)"
            )
        for part in parts:
            if part.first < 0 or part.first + len(part.targets) > copy.blocks_per_chunk:
                raise ValueError(
                    f"blocks {part.first} .. {part.first + len(part.targets)} of a {copy.blocks_per_chunk}-block chunk"
                )
        if len(self.staged) >= copy.chunks_per_load:
            raise RuntimeError("flush_load after chunks_per_load chunks")
        self.staged.append(StagedChunk(mapping.offset(view), tuple(ChunkPart(p.first, list(p.targets)) for p in parts)))

    def take(self) -> list[StagedChunk]:
        staged, self.staged = self.staged, []
        return staged


class HeldLoads:
    """The chunks a step holds for a layered flush (`PageCopy.hold_load`), and the gate at
    which the engine's thread waits for a layer the loader thread has not queued yet.

    The gate opens (layers are waited for) at a step's first hold, which comes before the
    engine is told its restores were answered, and releases layer by layer as the flush
    queues them (`queued`), or all of them at once (`release`), whatever ends the flush.
    """

    def __init__(self, stage: LoadStage, chunks_max: int) -> None:
        self._stage = stage
        self.chunks_max = chunks_max
        self.chunks: list[StagedChunk] = []
        self._gate = threading.Condition()
        self._layers_queued: int | None = None
        """Layers released while a held flush is pending; None: none pending (no wait)."""

    def hold(self) -> None:
        staged = self._stage.take()
        if len(self.chunks) + len(staged) > self.chunks_max:
            raise RuntimeError(f"{len(self.chunks) + len(staged)} chunks held, at most {self.chunks_max}")
        with self._gate:
            if self._layers_queued is None:
                self._layers_queued = 0
        self.chunks += staged

    def take(self) -> list[StagedChunk]:
        chunks, self.chunks = self.chunks, []
        return chunks

    def queued(self, layer: int) -> None:
        """Layers up to ``layer`` have their held copies queued: the engine may use them."""
        with self._gate:
            if self._layers_queued is not None:
                self._layers_queued = max(self._layers_queued, layer + 1)
                self._gate.notify_all()

    def release(self) -> None:
        """Every layer may be used: the flush is done, or failed (its blocks are then load errors)."""
        self.chunks = []
        with self._gate:
            self._layers_queued = None
            self._gate.notify_all()

    def wait(self, layer: int | None = None) -> None:
        """On the engine's thread: until ``layer`` is released (None: every layer).

        Unbounded: what releases it runs on the loader thread whatever the load's end (its
        last step, `WorkerSide`'s loader, drops what is held), and nothing between a hold
        and the flush waits for the gateway: the held values are in hand by then."""
        with self._gate:
            self._gate.wait_for(
                lambda: self._layers_queued is None or (layer is not None and self._layers_queued > layer)
            )


def load_request_chunks(load_batch_bytes: int, chunk_bytes: int) -> int:
    """Whole chunks per gateway request of at most ``load_batch_bytes`` (at least one)."""
    return max(1, load_batch_bytes // chunk_bytes)


class Holding:
    """`PageCopy`'s held loads, the same for both backends over their `HeldLoads`."""

    _held: HeldLoads

    @property
    def held_chunks_max(self) -> int:
        return self._held.chunks_max

    def hold_load(self) -> None:
        self._held.hold()

    def drop_held(self) -> None:
        self._held.release()
