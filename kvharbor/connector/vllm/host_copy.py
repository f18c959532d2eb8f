"""Page copies for a cache in host memory (vLLM's CPU backend).

Copies go straight between the cache tensors and shared memory
(``index_copy_`` reads a tensor view of it, ``index_select`` writes into one),
with no staging, but for a save whose step cannot wait for the saver (busy with an
earlier save's storage write): it is copied out of its blocks into staging of its
own first (`_HostSave.snapshot`, within ``engine.save_staging_mb_max``). A flush
has done its work when it returns (a held flush releases each layer to the
engine's thread as soon as it is copied, so the engine computes it while the
loader thread copies the next). Pages are stored
in their logical order (`pages.block_first`), as they always were.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvharbor.connector.vllm.chunks import ChunkPart, GroupBlocks
from kvharbor.connector.vllm.copier import (
    COPIED,
    HeldLoads,
    Holding,
    LoadStage,
    StagedChunk,
    StepSave,
    Wait,
    load_request_chunks,
)
from kvharbor.connector.vllm.pages import PageLayers, block_first
from kvharbor.connector.vllm.pinning import PinnedMapping


class HostCopy(Holding):
    snapshots_saves = False
    staging_waited_s = 0.0
    """Saves read the blocks in the step, or are snapshotted without waiting: no staging to wait for."""
    loads_queued_max = 1
    """A load request is copied within its `flush_load`."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        load_batch_bytes: int,
        save_staging_bytes_max: int,
        groups: Sequence[int] | None = None,
    ) -> None:
        """``save_staging_bytes_max``: host memory that snapshotted saves still waiting for
        their copy into shared memory may hold. ``groups``: each tensor's KV cache group
        (None: one group)."""
        self.pages = PageLayers.of(tensors, num_blocks, block_first, groups)
        self.blocks_per_chunk = blocks_per_chunk
        self.chunks_per_load = load_request_chunks(load_batch_bytes, self.chunk_bytes)
        self._stage = LoadStage(self)
        self._held = HeldLoads(self._stage, self.chunks_per_load * len(self.pages.layers))
        """Bounded as a device's are: every held value pins its memory in the gateway."""
        self.save_staging_bytes_max = save_staging_bytes_max
        self._staging_bytes = 0
        self._staging_lock = threading.Lock()

    @property
    def chunk_bytes(self) -> int:
        return self.pages.chunk_bytes(self.blocks_per_chunk)

    @property
    def staging_bytes(self) -> int:
        return self._staging_bytes

    def chunk_pages(self, mapping: PinnedMapping, offset: int) -> list[torch.Tensor]:
        """A stored chunk at ``offset`` as one ``(blocks_per_chunk, *page_shape)`` view per layer."""
        return self.pages_of(mapping.tensor[offset : offset + self.chunk_bytes])

    def pages_of(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """A stored chunk's bytes as one ``(blocks_per_chunk, *page_shape)`` view per layer."""
        pages = self.pages
        flat = chunk.view(pages.dtype)
        return list(flat.view(len(pages.layers), self.blocks_per_chunk, *pages.page_shape).unbind(0))

    def take_staging(self, chunks: int) -> int:
        """Room for the leading ``chunks`` of a snapshot, or as many as fit now (no wait)."""
        with self._staging_lock:
            room = (self.save_staging_bytes_max - self._staging_bytes) // self.chunk_bytes
            taken = max(0, min(chunks, room))
            self._staging_bytes += taken * self.chunk_bytes
            return taken

    def give_back(self, nbytes: int) -> None:
        with self._staging_lock:
            self._staging_bytes -= nbytes
            if self._staging_bytes < 0:
                raise RuntimeError(f"save staging given back twice ({self._staging_bytes} B held)")

    def reserve_loads(self) -> None:
        pass  # Loads copy straight into the cache tensors.

    def begin_loads(self) -> None:
        pass  # The engine's work on the CPU is done when it returns: nothing to order after.

    def stage_load(self, mapping: PinnedMapping, view: memoryview, parts: Sequence[ChunkPart]) -> None:
        self._stage.add(mapping, view, parts)

    def flush_load(self, mapping: PinnedMapping) -> Wait:
        for chunk in self._stage.take():
            source = self._source(mapping, chunk)
            for layer in range(len(self.pages.layers)):
                source.copy_layer(layer)
        return COPIED  # Copied when it returns.

    def flush_held(self, mapping: PinnedMapping) -> Wait:
        try:
            sources = [self._source(mapping, chunk) for chunk in self._held.take()]
            for layer in range(len(self.pages.layers)):
                for source in sources:
                    source.copy_layer(layer)
                self._held.queued(layer)
            return COPIED  # Copied when it returns.
        finally:
            self._held.release()

    def _source(self, mapping: PinnedMapping, chunk: StagedChunk) -> _Source:
        pages = self.pages
        index = [torch.tensor(part.targets, dtype=torch.long, device=pages.device) for part in chunk.parts]
        return _Source(self, chunk, self.chunk_pages(mapping, chunk.offset), index)

    def wait_layer(self, layer: int) -> None:
        self._held.wait(layer)

    def wait_loads(self) -> None:
        self._held.wait()

    def open_save(self, block_ids: Sequence[GroupBlocks], wait_s: float) -> StepSave | None:
        return _HostSave(self, block_ids) if block_ids else None

    def close(self) -> None:
        pass


class _Source:
    """A stored chunk being loaded: its pages per layer, and where each group's go."""

    def __init__(
        self, copy: HostCopy, chunk: StagedChunk, pages: list[torch.Tensor], index: list[torch.Tensor]
    ) -> None:
        self._copy, self._chunk, self._pages, self._index = copy, chunk, pages, index

    def copy_layer(self, layer: int) -> None:
        group = self._copy.pages.groups[layer]
        part = self._chunk.parts[group]
        if part.targets:
            source = self._pages[layer][part.first : part.first + len(part.targets)]
            self._copy.pages.layers[layer].index_copy_(0, self._index[group], source)


class _HostSave:
    """Pages are read from the blocks when a chunk is staged (the step waits for it), or, once
    snapshotted, from a copy of them the save holds."""

    def __init__(self, copy: HostCopy, block_ids: Sequence[GroupBlocks]) -> None:
        self._copy = copy
        self._block_ids = block_ids
        self._rows: dict[int, torch.Tensor] | None = None
        """Once snapshotted: the bytes each chunk kept is stored as, by chunk."""
        self._nbytes = 0
        """Staging bytes held (0 once released)."""

    @property
    def chunks(self) -> int:
        return len(self._block_ids)

    def gather_layer(self, layer: int) -> None:
        pass

    def close(self) -> None:
        pass

    def snapshot(self, chunks: Sequence[int]) -> int:
        """Copy ``chunks`` out of their blocks now (on the engine's thread), so that they may
        be staged after the step returns; the leading ones there was staging room for."""
        copy = self._copy
        kept = copy.take_staging(len(chunks))
        self._nbytes = kept * copy.chunk_bytes
        snapshot = torch.empty((kept, copy.chunk_bytes), dtype=torch.uint8)
        for row, chunk in enumerate(chunks[:kept]):
            self._read(chunk, snapshot[row])
        self._rows = {chunk: snapshot[row] for row, chunk in enumerate(chunks[:kept])}
        return kept

    def stage(self, chunk: int, mapping: PinnedMapping, view: memoryview) -> None:
        target = mapping.tensor[mapping.offset(view) :][: view.nbytes]
        if self._rows is None:
            self._read(chunk, target)
        elif view.nbytes != self._copy.chunk_bytes or chunk not in self._rows:
            raise ValueError(f"chunk {chunk} into {view.nbytes} B: not a whole chunk of the snapshot")
        else:
            target.copy_(self._rows[chunk])

    def _read(self, chunk: int, target: torch.Tensor) -> None:
        """Chunk ``chunk``'s pages from its blocks into ``target`` (its stored bytes)."""
        copy, pages = self._copy, self._copy.pages
        blocks = self._block_ids[chunk]
        whole = len(blocks) == pages.group_count and all(len(ids) == copy.blocks_per_chunk for ids in blocks)
        if target.numel() != copy.chunk_bytes or not whole:
            raise ValueError(
                f"chunk {chunk}: {[len(ids) for ids in blocks]} blocks per group into {target.numel()} B, "
                "not a whole chunk"
            )
        index = [torch.tensor(ids, dtype=torch.long, device=pages.device) for ids in blocks]
        for layer, group, into in zip(pages.layers, pages.groups, copy.pages_of(target), strict=True):
            torch.index_select(layer, 0, index[group], out=into)

    def flush(self, mapping: PinnedMapping) -> Wait:
        return COPIED  # Copied when staged.

    def release(self) -> None:
        nbytes, self._nbytes = self._nbytes, 0
        self._rows = None
        if nbytes:
            self._copy.give_back(nbytes)
