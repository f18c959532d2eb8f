"""Moving KV pages between vLLM's paged cache tensors and a flat byte buffer.

A stored chunk is, for each registered layer in registration order, the pages
of the chunk's blocks in block order: ``[layer][block][page bytes]``. A page
is opaque here (its inner layout is the attention backend's business and is
part of the layout fingerprint); only the block dimension is interpreted.

Copies go straight between the tensors and the caller's buffer (the gateway's
shared memory): `index_select` writes into a tensor view of the buffer, and
`index_copy_` reads from one, with no staging copy in between.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvharbor.connector.vllm.layout import ConnectorRefusal


def find_block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: the first of size ``num_blocks``, among the
    first two (backends put it first, or second after a K/V dimension of 2)."""
    for dim in range(min(2, tensor.dim())):
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ConnectorRefusal(
        f"no block dimension of size {num_blocks} in a KV cache tensor of shape {tuple(tensor.shape)}"
    )


class PageCopier:
    def __init__(self, tensors: Sequence[torch.Tensor], num_blocks: int) -> None:
        assert tensors
        # Block dimension first, as views: index on dim 0 whatever the backend's order.
        self.tensors = [t.movedim(find_block_dim(t, num_blocks), 0) for t in tensors]
        first = self.tensors[0]
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        for t in self.tensors:
            if tuple(t.shape[1:]) != self.page_shape or t.dtype != self.dtype:
                raise ConnectorRefusal(
                    f"KV cache tensors differ in page shape or dtype ({tuple(t.shape[1:])} {t.dtype} vs "
                    f"{self.page_shape} {self.dtype}); the connector exchanges uniform layers only"
                )
        self.page_bytes = first[0].numel() * first.element_size()
        self.device = first.device

    def chunk_bytes(self, blocks: int) -> int:
        return len(self.tensors) * blocks * self.page_bytes

    def _layer_views(self, buffer: memoryview, blocks: int) -> list[torch.Tensor]:
        assert buffer.nbytes == self.chunk_bytes(blocks), (buffer.nbytes, self.chunk_bytes(blocks))
        flat = torch.frombuffer(buffer, dtype=self.dtype)
        return list(flat.view(len(self.tensors), blocks, *self.page_shape).unbind(0))

    def gather(self, block_ids: Sequence[int], out: memoryview) -> None:
        """Copy the pages of ``block_ids`` of every layer into ``out``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for tensor, target in zip(self.tensors, self._layer_views(out, len(block_ids)), strict=True):
            torch.index_select(tensor, 0, index, out=target)

    def scatter(self, chunk: memoryview, chunk_blocks: int, first: int, block_ids: Sequence[int]) -> None:
        """Copy pages ``first .. first + len(block_ids)`` of a stored chunk of
        ``chunk_blocks`` blocks into ``block_ids``."""
        assert first >= 0 and first + len(block_ids) <= chunk_blocks, (first, len(block_ids), chunk_blocks)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for tensor, source in zip(self.tensors, self._layer_views(chunk, chunk_blocks), strict=True):
            tensor.index_copy_(0, index, source[first : first + len(block_ids)])
