"""Chunk arithmetic: which blocks of which chunk go where, written once.

A transfer (`metadata.ChunkTransfer`) lists its chunks' blocks in order,
``blocks_per_chunk`` to a chunk, except that a load may start inside its first
chunk (``skip_blocks`` already held by vLLM's own prefix cache) and stop
inside its last (one token short of the prompt). Saves are whole chunks.

A sliding-window request's block table starts with `NULL_BLOCK` where its blocks fell out
of the window (vLLM frees them; a restore allocates none there): a load restores nothing
into those, and a chunk whose blocks are all null is not read at all (vLLM's own
offloading connector likewise loads a sliding-window group's chunks in the window only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Importable without vLLM (bench/gpu.py's data-path part needs none).
    from kvharbor.connector.vllm.metadata import ChunkTransfer


NULL_BLOCK = 0
"""The id of vLLM's null block: its block pool takes block 0 off the free queue for it
(``BlockPool.null_block``). It stands in a block table for blocks a request does not hold
(outside a sliding window); it is never KV of anything, and nothing may write it."""


def blocks_before(chunk: int, per_chunk: int, skip_blocks: int) -> int:
    """Blocks a load restores before its chunk ``chunk`` (the first chunk may be partial)."""
    return 0 if chunk == 0 else chunk * per_chunk - skip_blocks


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """Where a stored chunk's blocks go: its blocks ``first .. first + len(targets)``
    into the engine's blocks ``targets`` (empty when the load ends before it)."""

    first: int
    targets: Sequence[int]
    blocks: int
    """The load's blocks this chunk restores, its null ones included (they need nothing)."""


def chunk_load(chunk: int, per_chunk: int, skip_blocks: int, block_ids: Sequence[int]) -> ChunkLoad:
    """The blocks of stored chunk ``chunk`` that a load of ``block_ids`` restores (its null
    blocks, which lead, left out)."""
    first = skip_blocks if chunk == 0 else 0
    start = blocks_before(chunk, per_chunk, skip_blocks)
    targets = block_ids[start : start + per_chunk - first]
    nulls = leading_nulls(targets)
    return ChunkLoad(first + nulls, targets[nulls:], len(targets))


def leading_nulls(block_ids: Sequence[int]) -> int:
    """How many of ``block_ids`` lead with `NULL_BLOCK` (out of a sliding window)."""
    count = 0
    while count < len(block_ids) and block_ids[count] == NULL_BLOCK:
        count += 1
    return count


def unread_chunks(per_chunk: int, skip_blocks: int, block_ids: Sequence[int]) -> int:
    """How many leading chunks of a load restore nothing (all their blocks null): they are
    not read, and count as restored (vLLM holds no block for them). Chunk 0 holds the load's
    first ``per_chunk - skip_blocks`` blocks, so the first n chunks are null when the nulls
    and the skipped blocks fill n whole chunks."""
    return (leading_nulls(block_ids) + skip_blocks) // per_chunk


@dataclass(frozen=True, slots=True)
class SavePlan:
    """A step's saves, flattened: chunk i is stored under ``keys[i]`` from ``blocks[i]``."""

    keys: list[bytes]
    blocks: list[Sequence[int]]


def plan_saves(saves: Sequence[ChunkTransfer], rank: int, per_chunk: int) -> SavePlan:
    """Every chunk of every save transfer, in order, with its rank's key."""
    keys: list[bytes] = []
    blocks: list[Sequence[int]] = []
    for transfer in saves:
        for i, key in enumerate(transfer.keys[rank]):
            keys.append(key)
            blocks.append(transfer.block_ids[i * per_chunk : (i + 1) * per_chunk])
    return SavePlan(keys, blocks)


def contiguous_runs(offsets: Sequence[int], size: int) -> Iterator[tuple[int, int, int]]:
    """(first index, count, first offset) of each run of values that lie back to back."""
    start = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + size:
            yield start, i - start, offsets[start]
            start = i
