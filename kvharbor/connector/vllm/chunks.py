"""Chunk arithmetic: which blocks of which chunk go where, written once.

A transfer (`metadata.ChunkTransfer`) lists its chunks' blocks in order,
``blocks_per_chunk`` to a chunk, once per KV cache group (`GroupBlocks`),
except that a load may start inside its first chunk (``skip_blocks`` already
held by vLLM's own prefix cache) and stop inside its last (one token short of
the prompt). Saves are whole chunks.

A sliding-window group's block table starts with `NULL_BLOCK` where its blocks fell out
of the window (vLLM frees them; a restore allocates none there): a load restores nothing
into those, and a chunk whose blocks are null in every group is not read at all (vLLM's own
offloading connector likewise loads a sliding-window group's chunks in the window only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Importable without vLLM (bench/gpu.py's data-path part needs none).
    from kvharbor.connector.vllm.metadata import ChunkTransfer


GroupBlocks = Sequence[Sequence[int]]
"""Blocks of one span of a request's tokens in every KV cache group: one list per group, in
vLLM's group order, all of one length (position i holds the same tokens in every group).
One group unless vLLM's hybrid allocator is on (`connector.KVHarborConnector` supports it)."""


def span(block_ids: GroupBlocks, start: int, end: int) -> list[list[int]]:
    """Positions ``start .. end`` of every group's blocks."""
    return [list(ids[start:end]) for ids in block_ids]


NULL_BLOCK = 0
"""The id of vLLM's null block: its block pool takes block 0 off the free queue for it
(``BlockPool.null_block``). It stands in a block table for blocks a request does not hold
(outside a sliding window); it is never KV of anything, and nothing may write it."""


def blocks_before(chunk: int, per_chunk: int, skip_blocks: int) -> int:
    """Blocks a load restores before its chunk ``chunk`` (the first chunk may be partial)."""
    return 0 if chunk == 0 else chunk * per_chunk - skip_blocks


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """One cache group's share of a stored chunk: its blocks ``first .. first + len(targets)``
    go into the engine's blocks ``targets`` (empty: nothing of this group is restored)."""

    first: int
    targets: Sequence[int]


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """Where a stored chunk's blocks go, one `ChunkPart` per cache group."""

    parts: tuple[ChunkPart, ...]
    blocks: int
    """The load's block positions this chunk restores, null ones included (they need nothing)."""

    @property
    def restores(self) -> bool:
        """Some group's blocks are restored from this chunk (none: the load ended before it)."""
        return any(part.targets for part in self.parts)


def chunk_load(chunk: int, per_chunk: int, skip_blocks: int, block_ids: GroupBlocks) -> ChunkLoad:
    """The blocks of stored chunk ``chunk`` that a load of ``block_ids`` restores (null
    blocks, which lead, left out)."""
    first = skip_blocks if chunk == 0 else 0
    start = blocks_before(chunk, per_chunk, skip_blocks)
    parts = []
    for ids in block_ids:
        targets = ids[start : start + per_chunk - first]
        nulls = leading_nulls(targets)
        parts.append(ChunkPart(first + nulls, targets[nulls:]))
    return ChunkLoad(tuple(parts), len(block_ids[0][start : start + per_chunk - first]))


def leading_nulls(block_ids: Sequence[int]) -> int:
    """How many of ``block_ids`` lead with `NULL_BLOCK` (out of a sliding window)."""
    count = 0
    while count < len(block_ids) and block_ids[count] == NULL_BLOCK:
        count += 1
    return count


def unread_chunks(per_chunk: int, skip_blocks: int, block_ids: GroupBlocks) -> int:
    """How many leading chunks of a load restore nothing (their blocks null in every group):
    they are not read, and count as restored (vLLM holds no block for them). Chunk 0 holds
    the load's first ``per_chunk - skip_blocks`` blocks, so the first n chunks are null in a
    group when its nulls and the skipped blocks fill n whole chunks."""
    return min((leading_nulls(ids) + skip_blocks) // per_chunk for ids in block_ids)


@dataclass(frozen=True, slots=True)
class SavePlan:
    """A step's saves, flattened: chunk i of request ``requests[i]`` is stored under
    ``keys[i]`` from ``blocks[i]``."""

    keys: list[bytes]
    blocks: list[GroupBlocks]
    requests: list[str]


def plan_saves(saves: Sequence[ChunkTransfer], rank: int, per_chunk: int) -> SavePlan:
    """Every chunk of every save transfer, in order, with its rank's key."""
    keys: list[bytes] = []
    blocks: list[GroupBlocks] = []
    requests: list[str] = []
    for transfer in saves:
        for i, key in enumerate(transfer.keys[rank]):
            keys.append(key)
            blocks.append(span(transfer.block_ids, i * per_chunk, (i + 1) * per_chunk))
            requests.append(transfer.request_id)
    return SavePlan(keys, blocks, requests)


def contiguous_runs(offsets: Sequence[int], size: int) -> Iterator[tuple[int, int, int]]:
    """(first index, count, first offset) of each run of values that lie back to back."""
    start = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + size:
            yield start, i - start, offsets[start]
            start = i
