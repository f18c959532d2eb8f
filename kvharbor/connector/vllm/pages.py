"""vLLM's paged KV cache tensors seen as pages: one row per block, every layer alike.

A stored chunk is, for each registered layer in registration order, the pages
of the chunk's blocks in block order: ``[layer][block][page bytes]``, each layer's
blocks those of its KV cache group (vLLM's hybrid allocator gives each group
blocks of its own, and may back layers of different groups with one tensor).
The layers of a group lie together, groups in vLLM's order (the worker registers
them so), so a load that needs some groups of a chunk copies only their bytes. A page
is opaque here (its inner layout is the attention backend's business and is
part of the layout fingerprint); only the block dimension is interpreted.

How a page's elements are ordered is the one thing the two copy backends
store differently, and stored objects depend on it, so each keeps its own:

- the CPU backend stores a page in its **logical** order (`block_first`);
- the CUDA backend stores a page **as it lies in memory** (`block_major`),
  so a permuted layout (flash-attn's NHD stride order) costs no transposition.

For a contiguous cache (vLLM's CPU backend) both orders are the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

import torch

from kvharbor.connector.vllm.layout import ConnectorRefusal

PageView = Callable[[torch.Tensor, int], torch.Tensor]
"""(cache tensor, num_blocks) -> a view of shape (num_blocks, *page shape)."""


def find_block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: the first of size ``num_blocks``, among the
    first two (backends put it first, or second after a K/V dimension of 2)."""
    for dim in range(min(2, tensor.dim())):
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ConnectorRefusal(
        f"no block dimension of size {num_blocks} in a KV cache tensor of shape {tuple(tensor.shape)}"
    )


def block_first(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of ``tensor`` indexed by block first, each block's elements in logical order."""
    return tensor.movedim(find_block_dim(tensor, num_blocks), 0)


def block_major(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of ``tensor`` indexed by block first, each block's elements in memory order.

    The dims after the block dim are sorted by stride and merged where dense,
    so flash-attn's ``(blocks, heads, tokens, 2*head)`` with an NHD stride order
    becomes ``(blocks, page)``: a gathered page is a plain copy of the block's
    memory, with no transposition.
    """
    dim = find_block_dim(tensor, num_blocks)
    others = sorted((d for d in range(tensor.dim()) if d != dim), key=lambda d: -tensor.stride()[d])
    view = tensor.permute(dim, *others)
    shape: list[int] = []
    strides: list[int] = []
    for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True):
        if size == 1:
            continue
        if shape and strides[-1] == stride * size:
            shape[-1] *= size
            strides[-1] = stride
        else:
            shape.append(size)
            strides.append(stride)
    if not shape:
        shape, strides = [1], [1]
    return view.as_strided((num_blocks, *shape), (view.stride(0), *strides))


KVCache = torch.Tensor | Sequence[torch.Tensor]
"""What vLLM registers for a layer: one tensor, or (a Mamba-type layer on vLLM 0.26's GPU
runner) one tensor per part of its state."""


def state_view(cache: KVCache, num_blocks: int) -> torch.Tensor:
    """A Mamba-type layer's cache as one tensor indexed by block first. vLLM's CPU build
    registers one int8 tensor ``(num_blocks, ..., state bytes)``, returned as it is; its GPU
    runner (0.26) one tensor per state part over the same pages (the conv state, then the SSM
    state, back to back in each block's page), seen here as ``(num_blocks, state bytes)``
    bytes. `ConnectorRefusal` where the parts do not lie so."""
    if isinstance(cache, torch.Tensor):
        return cache
    parts = list(cache)
    first = parts[0]
    page_bytes = first.stride(0) * first.element_size()
    start = end = first.storage_offset() * first.element_size()
    for part in parts:
        laid_out = (
            part.dim() >= 1
            and part.shape[0] == num_blocks
            and part.stride(0) * part.element_size() == page_bytes
            and part.storage_offset() * part.element_size() == end
            and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and part[0].is_contiguous()
        )
        if not laid_out:
            raise ConnectorRefusal(
                f"a Mamba-type layer's state parts {[tuple(p.shape) for p in parts]} do not lie back to back in "
                f"pages of {page_bytes} B (tell us the model and this line)"
            )
        end += part[0].numel() * part.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=first.device)
    return view.set_(first.untyped_storage(), start, (num_blocks, end - start), (page_bytes, 1))


@dataclass(frozen=True, slots=True)
class PageLayers:
    """The cache's layers as ``(num_blocks, *page_shape)`` views, all of one page shape and dtype."""

    layers: tuple[torch.Tensor, ...]
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    groups: tuple[int, ...]
    """The KV cache group of each layer (whose block ids address it)."""
    group_count: int

    @classmethod
    def of(
        cls, tensors: Sequence[torch.Tensor], num_blocks: int, view: PageView, groups: Sequence[int] | None = None
    ) -> PageLayers:
        """``groups``: each tensor's KV cache group, of ``0 .. max``; None: one group.
        Raises `ConnectorRefusal` when a tensor has no block dimension or the layers differ."""
        if not tensors:
            raise ConnectorRefusal("vLLM registered no KV cache tensors")
        layer_groups = tuple(groups) if groups is not None else (0,) * len(tensors)
        if len(layer_groups) != len(tensors) or min(layer_groups) < 0:
            raise ValueError(f"{len(layer_groups)} group indices for {len(tensors)} KV cache tensors")
        group_count = max(layer_groups) + 1
        if list(layer_groups) != sorted(layer_groups) or set(layer_groups) != set(range(group_count)):
            raise ValueError(f"KV cache groups {layer_groups}: each group's layers together, groups 0 .. n in order")
        layers = tuple(view(t, num_blocks) for t in tensors)
        first = layers[0]
        page_shape, dtype = tuple(first.shape[1:]), first.dtype
        for layer in layers:
            if tuple(layer.shape[1:]) != page_shape or layer.dtype != dtype:
                raise ConnectorRefusal(
                    f"KV cache tensors differ in page shape or dtype ({tuple(layer.shape[1:])} {layer.dtype} vs "
                    f"{page_shape} {dtype}); the connector exchanges uniform layers only"
                )
        return cls(layers, page_shape, dtype, first.device, layer_groups, group_count)

    @property
    def page_elems(self) -> int:
        return prod(self.page_shape)

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.dtype.itemsize

    def chunk_bytes(self, blocks: int) -> int:
        """Bytes of a stored chunk of ``blocks`` blocks: every layer's pages."""
        return len(self.layers) * blocks * self.page_bytes

    def group_bytes(self, group: int, blocks: int) -> tuple[int, int]:
        """Where ``group``'s pages lie in a stored chunk of ``blocks`` blocks: (start, end) bytes."""
        first = self.groups.index(group)
        end = first + self.groups.count(group)
        return first * blocks * self.page_bytes, end * blocks * self.page_bytes
