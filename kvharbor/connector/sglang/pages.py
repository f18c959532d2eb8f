"""The bytes of SGLang's host KV pool, page by page.

A stored page is the page's K bytes followed by its V bytes, in the order of the
pool's flat data page (``get_data_page(index).flatten()``): for ``layer_first``
the K rows of every layer, then the V rows of every layer; for the page-major
layouts the page's K block, then its V block. The zero-copy methods
(``batch_get_v1``/``batch_set_v1``) copy between the gateway's shared memory and
the pool's spans that `HostPages.spans` finds (from the pool's own
``get_page_buffer_meta``), the legacy ones between it and a flat page tensor: both
store the same bytes, so either interface reads what the other wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvharbor.connector.sglang.keys import BackendRefusal
from kvharbor.hal.checksum import COPY_SLICE_BYTES, ChecksumStream

SUPPORTED_POOLS = frozenset({"MHATokenToKVPoolHost"})
"""Host pools whose ``get_page_buffer_meta`` gives (K, V) span pairs (checked in tests)."""
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
"""``--hicache-mem-layout`` values whose flat data page is all K spans, then all V spans."""

Span = tuple[int, int]
"""(offset in the pool's buffer, bytes)."""


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return _byte_array(tensor).data


def _byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a writable array of bytes (no copy)."""
    array: np.ndarray = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return array


class HostPages:
    """Copies pages between the registered host pool and the gateway's views."""

    def __init__(self, pool: Any) -> None:
        kind = type(pool).__name__
        if kind not in SUPPORTED_POOLS:
            raise BackendRefusal(
                f"SGLang's host KV pool is a {kind}; kvharbor stores the pages of "
                f"{', '.join(sorted(SUPPORTED_POOLS))} only (MHA models)"
            )
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise BackendRefusal(
                f"--hicache-mem-layout {layout!r} is a host-pool layout kvharbor does not know; "
                f"use one of {', '.join(SUPPORTED_LAYOUTS)}"
            )
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise BackendRefusal(f"SGLang's {kind} has no contiguous host buffer (kv_buffer) to copy pages from")
        self._pool = pool
        self._buffer = buffer  # Keeps the memory alive as long as the array.
        self._memory = _byte_array(buffer)
        self._base = buffer.data_ptr()
        self.page_size = int(pool.page_size)
        first = self.spans(torch.arange(self.page_size, dtype=torch.int64))[0]
        self.page_bytes = sum(size for _, size in first)
        flat = pool.get_dummy_flat_data_page()
        if flat.numel() * flat.element_size() != self.page_bytes:
            raise BackendRefusal(
                f"SGLang's {kind} ({layout}) spans {self.page_bytes} bytes per page but its flat page "
                f"holds {flat.numel() * flat.element_size()}; kvharbor cannot store this pool"
            )

    def spans(self, host_indices: torch.Tensor) -> list[tuple[Span, ...]]:
        """Per page of ``host_indices`` (``page_size`` slots each), its spans in stored order.

        Raises ValueError for indices that are not whole pages or spans outside the
        pool's buffer: a wrong span would copy another page's bytes.
        """
        count = len(host_indices)
        if count % self.page_size:
            raise ValueError(f"{count} host indices are not whole pages of {self.page_size}")
        pointers, sizes = self._pool.get_page_buffer_meta(host_indices)
        pages = count // self.page_size
        if len(pointers) != len(sizes) or (pages and len(pointers) % (2 * pages)):
            raise ValueError(f"the host pool gave {len(pointers)} spans for {pages} pages")
        per_page = len(pointers) // pages if pages else 0
        limit = self._memory.nbytes
        result = []
        for page in range(pages):
            pairs = [(pointers[i] - self._base, sizes[i]) for i in range(page * per_page, (page + 1) * per_page)]
            for offset, size in pairs:
                if offset < 0 or size <= 0 or offset + size > limit:
                    raise ValueError(f"a page span {offset}+{size} lies outside the {limit}-byte host pool")
            # (K, V) pairs in the pool's order; stored as every K span, then every V span.
            result.append(tuple(pairs[0::2] + pairs[1::2]))
        return result

    def read(self, spans: Sequence[Span], into: memoryview) -> int:
        """Copy one page out of the pool into ``into`` (`page_bytes` long); returns the
        `kvharbor.hal.checksum.checksum` of the page, hashing each slice just copied while
        it is still in the CPU cache (as `copy_with_checksum` does): one pass over memory.

        Copies and hashes let go of the GIL: pages read on several threads at once
        (`kvharbor.connector.fanout`) run side by side, and SGLang's scheduler thread runs
        during a copy."""
        target = np.frombuffer(into, dtype=np.uint8)
        hasher = ChecksumStream()
        position = 0
        for offset, size in spans:
            for start in range(0, size, COPY_SLICE_BYTES):
                length = min(COPY_SLICE_BYTES, size - start)
                np.copyto(target[position : position + length], self._memory[offset + start : offset + start + length])
                hasher.update(into[position : position + length])
                position += length
        return hasher.intdigest()

    def write(self, spans: Sequence[Span], source: memoryview) -> None:
        """Copy one stored page (`page_bytes` long) into the pool (letting go of the GIL)."""
        stored = np.frombuffer(source, dtype=np.uint8)
        position = 0
        for offset, size in spans:
            np.copyto(self._memory[offset : offset + size], stored[position : position + size])
            position += size

    def flat_page(self, target: torch.Tensor | None) -> tuple[torch.Tensor, memoryview]:
        """A flat page tensor to load into (``target``, else a new one) and its byte view;
        raises ValueError for a target of another size or not on the CPU."""
        page = self._pool.get_dummy_flat_data_page() if target is None else target
        if page.device.type != "cpu" or not page.is_contiguous():
            raise ValueError("a legacy get needs a contiguous CPU tensor as its target")
        view = _byte_view(page)
        if view.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, the target holds {view.nbytes}")
        return page, view

    def tensor_bytes(self, value: torch.Tensor) -> memoryview:
        """The bytes of a flat page handed to a legacy set; ValueError if of another size."""
        view = _byte_view(value.contiguous().cpu())
        if view.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, the value holds {view.nbytes}")
        return view
