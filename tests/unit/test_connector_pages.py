"""`PageCopier` on tensors shaped like vLLM's CPU KV cache: (num_blocks, kv_heads, block_size, 2 x head_dim)."""

from __future__ import annotations

import pytest
import torch

from kvharbor.connector.vllm.layout import ConnectorRefusal
from kvharbor.connector.vllm.pages import PageCopier

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 12, 2, 16, 8, 3


def cpu_cache(seed: int | None) -> list[torch.Tensor]:
    """vLLM's CPU layout: every layer a view into one storage, block dimension first."""
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    storage = torch.zeros(LAYERS, *shape)
    if seed is not None:
        storage.copy_(torch.randn(LAYERS, *shape, generator=torch.Generator().manual_seed(seed)))
    return list(storage.unbind(0))


def chunk(copier: PageCopier, blocks: list[int]) -> memoryview:
    buffer = memoryview(bytearray(copier.chunk_bytes(len(blocks))))
    copier.gather(blocks, buffer)
    return buffer


def test_a_chunk_is_every_layers_pages_in_block_order() -> None:
    source = cpu_cache(seed=1)
    copier = PageCopier(source, NUM_BLOCKS)
    assert copier.page_bytes == HEADS * BLOCK * 2 * HEAD_DIM * 4
    buffer = chunk(copier, [7, 3])
    as_tensor = torch.frombuffer(buffer, dtype=torch.float32).view(LAYERS, 2, HEADS, BLOCK, 2 * HEAD_DIM)
    expected = torch.stack([layer[torch.tensor([7, 3])] for layer in source])
    assert torch.equal(as_tensor, expected)


def test_gather_then_scatter_restores_the_pages_into_other_blocks() -> None:
    source, target = cpu_cache(seed=2), cpu_cache(seed=None)
    buffer = chunk(PageCopier(source, NUM_BLOCKS), [4, 5])
    PageCopier(target, NUM_BLOCKS).scatter(buffer, 2, 0, [9, 1])
    for before, after in zip(source, target, strict=True):
        assert torch.equal(after[9], before[4]) and torch.equal(after[1], before[5])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (9, 1)]
        assert not after[untouched].any()


def test_a_partial_first_chunk_skips_the_blocks_already_held() -> None:
    source, target = cpu_cache(seed=3), cpu_cache(seed=None)
    buffer = chunk(PageCopier(source, NUM_BLOCKS), [2, 3, 6, 8])
    PageCopier(target, NUM_BLOCKS).scatter(buffer, 4, 1, [10, 11, 5])  # The first block is held already.
    for before, after in zip(source, target, strict=True):
        assert torch.equal(after[torch.tensor([10, 11, 5])], before[torch.tensor([3, 6, 8])])
        assert not after[2].any() and not after[0].any()


def test_a_partial_last_chunk_stops_short() -> None:
    source, target = cpu_cache(seed=4), cpu_cache(seed=None)
    buffer = chunk(PageCopier(source, NUM_BLOCKS), [2, 3])
    PageCopier(target, NUM_BLOCKS).scatter(buffer, 2, 0, [7])  # Only the chunk's first block.
    for before, after in zip(source, target, strict=True):
        assert torch.equal(after[7], before[2])
        assert not after[3].any() and int(after.count_nonzero()) == int(after[7].count_nonzero())


def test_a_scatter_past_the_chunk_is_refused() -> None:
    copier = PageCopier(cpu_cache(seed=5), NUM_BLOCKS)
    with pytest.raises(AssertionError):
        copier.scatter(chunk(copier, [1, 2]), 2, 1, [3, 4])


def test_tensors_without_a_block_dimension_are_refused() -> None:
    with pytest.raises(ConnectorRefusal, match="no block dimension of size 99"):
        PageCopier(cpu_cache(seed=None), 99)


def test_layers_of_different_page_shapes_are_refused() -> None:
    tensors = [*cpu_cache(seed=None), torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)]
    with pytest.raises(ConnectorRefusal, match="differ in page shape"):
        PageCopier(tensors, NUM_BLOCKS)
