"""The page-copy interface the one data path (`datapath.DataPath`) drives.

Four moves for each direction: **plan** (`chunks`), **stage** (name a stored
chunk and its blocks), **flush** (start the copies of what was staged) and
**wait** (the flush's returned `Wait`: the shared memory has been read or
written). Two implementations: `host_copy.HostCopy` for a cache in host
memory (vLLM's CPU backend) and `device_copy.DeviceCopy` for one on a GPU.
Each keeps the page order its stored objects have always had (`pages`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvharbor.connector.vllm.chunks import ChunkPart, GroupBlocks
from kvharbor.connector.vllm.pages import PageLayers
from kvharbor.connector.vllm.pinning import PinnedMapping

MIB = 1 << 20

Wait = Callable[[], None]
"""Blocks until a flush's copies have read (loads) or written (saves) the shared memory."""


def no_wait() -> None:
    pass


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
    of the gateway's: `CacheLink.load_streamed`): a restore is fully under way once this many
    were flushed."""
    snapshots_saves: bool
    """True: `StepSave.close` leaves the step's pages copied into staging of the save's own,
    so the saver thread may fill shared memory later. False: the pages are read from the
    blocks when the save is staged, so the step must wait for that before its blocks are reused."""
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

    def wait_layer(self, layer: int) -> None:
        """Make the engine wait for the loads into one layer."""

    def wait_loads(self) -> None:
        """Make the engine wait for every load so far (end of a step)."""

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


def load_request_chunks(load_batch_bytes: int, chunk_bytes: int) -> int:
    """Whole chunks per gateway request of at most ``load_batch_bytes`` (at least one)."""
    return max(1, load_batch_bytes // chunk_bytes)
