"""The cache seen as pages (`pages`) and the chunk arithmetic (`chunks`), on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kvharbor.connector.vllm.chunks import (
    NULL_BLOCK,
    ChunkLoad,
    blocks_before,
    chunk_load,
    contiguous_runs,
    plan_saves,
    unread_chunks,
)
from kvharbor.connector.vllm.layout import ConnectorRefusal
from kvharbor.connector.vllm.metadata import ChunkTransfer
from kvharbor.connector.vllm.pages import PageLayers, block_first, block_major, state_view

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 12, 2, 16, 8, 3


def cpu_cache() -> list[torch.Tensor]:
    """vLLM's CPU layout: every layer a view into one storage, block dimension first."""
    return list(torch.randn(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM).unbind(0))


# -- pages ------------------------------------------------------------------------------


def test_block_first_keeps_the_logical_order_and_block_major_the_memory_order() -> None:
    nhd = torch.randn(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM).permute(0, 2, 1, 3)  # flash-attn's NHD strides
    logical, memory = block_first(nhd, NUM_BLOCKS), block_major(nhd, NUM_BLOCKS)
    assert logical.shape == (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    assert memory.shape == (NUM_BLOCKS, HEADS * BLOCK * 2 * HEAD_DIM) and memory.stride()[1] == 1
    assert torch.equal(memory[7], nhd.permute(0, 2, 1, 3)[7].reshape(-1))  # the block's memory as it lies
    assert not torch.equal(memory[7], logical[7].reshape(-1))  # ... which is not its logical order
    contiguous = torch.randn(NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)  # here both orders are the same bytes
    assert torch.equal(block_major(contiguous, NUM_BLOCKS)[3], block_first(contiguous, NUM_BLOCKS)[3].reshape(-1))


def test_a_kv_dimension_before_the_blocks() -> None:
    t = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)  # K and V apart: a block is two ranges
    assert torch.equal(block_first(t, NUM_BLOCKS)[5], t[:, 5])
    memory = block_major(t, NUM_BLOCKS)
    assert memory.shape == (NUM_BLOCKS, 2, BLOCK * HEADS * HEAD_DIM)
    assert torch.equal(memory[5, 1], t[1, 5].reshape(-1))


def test_page_layers_measure_a_chunk() -> None:
    pages = PageLayers.of(cpu_cache(), NUM_BLOCKS, block_first)
    assert pages.page_shape == (HEADS, BLOCK, 2 * HEAD_DIM) and pages.dtype == torch.float32
    assert pages.page_bytes == HEADS * BLOCK * 2 * HEAD_DIM * 4
    assert pages.chunk_bytes(4) == LAYERS * 4 * pages.page_bytes


@pytest.mark.parametrize("view", [block_first, block_major])
def test_tensors_without_a_block_dimension_are_refused(view: object) -> None:
    with pytest.raises(ConnectorRefusal, match="no block dimension of size 99"):
        PageLayers.of(cpu_cache(), 99, view)  # type: ignore[arg-type]


@pytest.mark.parametrize("view", [block_first, block_major])
def test_layers_of_different_page_shapes_or_dtypes_are_refused(view: object) -> None:
    other_shape = [*cpu_cache(), torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)]
    with pytest.raises(ConnectorRefusal, match="differ in page shape or dtype"):
        PageLayers.of(other_shape, NUM_BLOCKS, view)  # type: ignore[arg-type]
    other_dtype = [*cpu_cache(), torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.float16)]
    with pytest.raises(ConnectorRefusal, match="uniform layers only"):
        PageLayers.of(other_dtype, NUM_BLOCKS, view)  # type: ignore[arg-type]


def test_each_groups_layers_lie_together_and_their_bytes_are_found() -> None:
    layers = PageLayers.of(cpu_cache(), NUM_BLOCKS, block_first, [0, 0, 1])
    page = layers.page_bytes
    assert (layers.group_count, layers.group_bytes(0, 4), layers.group_bytes(1, 4)) == (
        2,
        (0, 8 * page),
        (8 * page, 12 * page),
    )
    with pytest.raises(ValueError, match="each group's layers together"):
        PageLayers.of(cpu_cache(), NUM_BLOCKS, block_first, [0, 1, 0])


# -- chunks -------------------------------------------------------------------------------


def part(load: ChunkLoad, group: int = 0) -> tuple[int, list[int]]:
    return load.parts[group].first, list(load.parts[group].targets)


def test_a_load_that_starts_and_ends_inside_a_chunk() -> None:
    blocks = [[30, 31, 32, 33, 34, 35, 36, 37, 38]]  # 4 blocks a chunk; 2 of chunk 0 held already
    assert [blocks_before(i, 4, 2) for i in range(4)] == [0, 2, 6, 10]
    assert part(chunk_load(0, 4, 2, blocks)) == (2, [30, 31])
    assert part(chunk_load(1, 4, 2, blocks)) == (0, [32, 33, 34, 35])
    last = chunk_load(2, 4, 2, blocks)
    assert part(last) == (0, [36, 37, 38]) and last.blocks == 3  # stops short of the prompt end
    past = chunk_load(3, 4, 2, blocks)
    assert part(past) == (0, []) and not past.restores and past.blocks == 0  # past the load: nothing


def test_a_sliding_window_load_restores_nothing_into_null_blocks_and_skips_whole_null_chunks() -> None:
    """vLLM pads a sliding-window request's blocks out of the window with its null block."""
    blocks = [[NULL_BLOCK] * 5 + [40, 41, 42, 43, 44, 45]]  # 4 blocks a chunk; 1 of chunk 0 held already
    assert unread_chunks(4, 1, blocks) == 1  # Chunk 0 (3 blocks here) is all null; chunk 1 is not.
    partly = chunk_load(1, 4, 1, blocks)
    assert (*part(partly), partly.blocks) == (2, [40, 41], 4)
    whole = chunk_load(2, 4, 1, blocks)
    assert (*part(whole), whole.blocks) == (0, [42, 43, 44, 45], 4)
    assert unread_chunks(4, 0, [[NULL_BLOCK] * 8 + [50]]) == 2
    assert unread_chunks(4, 0, [[50, 51, 52, 53]]) == 0  # Full attention: every chunk is read.


def test_a_hybrid_load_reads_every_chunk_of_the_full_group_and_fills_the_window_group_in_its_window() -> None:
    """vLLM's hybrid allocator: one block list per group, position for position; the window
    group holds null blocks where its blocks fell out of the window."""
    blocks = [list(range(10, 19)), [NULL_BLOCK] * 6 + [60, 61, 62]]  # full, sliding window
    assert unread_chunks(4, 0, blocks) == 0  # The full group needs chunk 0 whatever the window holds.
    first = chunk_load(0, 4, 0, blocks)
    assert part(first, 0) == (0, [10, 11, 12, 13]) and part(first, 1) == (4, []) and first.restores
    second = chunk_load(1, 4, 0, blocks)
    assert part(second, 0) == (0, [14, 15, 16, 17]) and part(second, 1) == (2, [60, 61])
    assert second.blocks == 4
    third = chunk_load(2, 4, 0, blocks)
    assert part(third, 0) == (0, [18]) and part(third, 1) == (0, [62]) and third.blocks == 1


def test_save_planning_flattens_every_transfer_with_the_ranks_keys() -> None:
    a = ChunkTransfer("a", [[b"a0", b"a1"], [b"A0", b"A1"]], block_ids=[[1, 2, 3, 4], [11, 12, 13, 14]])
    b = ChunkTransfer("b", [[b"b0"], [b"B0"]], block_ids=[[9, 8], [19, 18]])
    plan = plan_saves([a, b], rank=1, per_chunk=2)
    assert plan.keys == [b"A0", b"A1", b"B0"]
    assert [[list(ids) for ids in x] for x in plan.blocks] == [
        [[1, 2], [11, 12]],
        [[3, 4], [13, 14]],
        [[9, 8], [19, 18]],
    ]


def test_contiguous_runs() -> None:
    assert list(contiguous_runs([0, 10, 20, 40, 50, 100], 10)) == [(0, 3, 0), (3, 2, 40), (5, 1, 100)]
    assert list(contiguous_runs([], 10)) == []


def test_a_mamba_layers_state_parts_are_seen_as_the_bytes_of_each_blocks_state() -> None:
    """vLLM 0.26's GPU runner registers a Mamba-type layer as one tensor per state part, each
    over the same pages (`_reshape_kv_cache_tensors`): the conv state, then the SSM state."""
    blocks, page = 5, 1024
    raw = torch.arange(blocks * page, dtype=torch.int32).to(torch.uint8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, 3, 16), (page // 2, 16, 1), 0)
    ssm = torch.as_strided(raw.view(torch.float32), (blocks, 2, 8, 8), (page // 4, 64, 8, 1), 3 * 16 * 2 // 4)
    view = state_view([conv, ssm], blocks)
    state = 3 * 16 * 2 + 2 * 8 * 8 * 4
    assert tuple(view.shape) == (blocks, state)
    for block in range(blocks):
        assert torch.equal(view[block], raw[block * page : block * page + state])
    view[2].fill_(7)  # A view, not a copy: a restore writes the cache itself.
    assert torch.all(conv[2].view(torch.uint8) == 7) and torch.all(ssm[2].contiguous().view(torch.uint8) == 7)
    one = raw.view(blocks, page)[:, :state]
    assert state_view(one, blocks) is one  # The CPU build's one tensor is taken as it is.


def test_state_parts_that_do_not_lie_back_to_back_are_refused() -> None:
    raw = torch.zeros(4 * 512, dtype=torch.uint8)
    first = torch.as_strided(raw, (4, 16), (512, 1), 0)
    gap = torch.as_strided(raw, (4, 16), (512, 1), 32)
    with pytest.raises(ConnectorRefusal, match="do not lie back to back in pages of 512 B"):
        state_view([first, gap], 4)
