"""Rows of equal length out of the shared memory into one contiguous buffer: one layer's
pages of many stored chunks (`DeviceCopy.flush_held`).

A chunk stores its layers one after another, so one layer's pages of chunks that lie
back to back in shared memory are rows ``chunk_bytes`` apart. Into a GPU buffer such a
run crosses PCIe as one two-dimensional copy (``cudaMemcpy2DAsync`` on the current
stream): torch copies a strided host tensor to the device through a contiguous host
temporary, which would double the bytes moved and block the calling thread. Elsewhere
(CPU tensors: CI's run of the device pipeline) each row is one ``copy_``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

_HOST_TO_DEVICE = 1
"""``cudaMemcpyHostToDevice``."""


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (its path from this process's mappings), with
    ``cudaMemcpy2DAsync`` declared; None where none is loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libcudart.so" in line}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        copy = lib.cudaMemcpy2DAsync
        copy.restype = ctypes.c_int
        copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        return lib
    return None


def gpu_row_copies() -> str:
    """How `copy_rows` moves rows into a GPU buffer in this process (said at start)."""
    if _cudart() is not None:
        return "one two-dimensional copy per run of chunks (cudaMemcpy2DAsync)"
    return "one copy per row (no CUDA runtime library mapped in this process)"


def copy_rows(target: torch.Tensor, source: torch.Tensor, runs: Sequence[tuple[int, int]], row_bytes: int,
              pitch_bytes: int) -> None:  # fmt: skip
    """Copy rows of ``row_bytes`` from the byte tensor ``source`` into ``target`` (contiguous
    bytes), back to back: each run ``(offset, count)`` is ``count`` rows ``pitch_bytes``
    apart from ``offset`` on. On a GPU ``target`` is written on the current stream and
    ``source`` must be page-locked host memory; the copies are asynchronous."""
    if row_bytes <= 0 or pitch_bytes < row_bytes:
        raise ValueError(f"rows of {row_bytes} B every {pitch_bytes} B")
    total = sum(count for _, count in runs) * row_bytes
    if total > target.numel() * target.element_size():
        raise ValueError(f"{total} B of rows into a buffer of {target.numel() * target.element_size()} B")
    for offset, count in runs:
        if offset < 0 or offset + (count - 1) * pitch_bytes + row_bytes > source.numel():
            raise ValueError(f"{count} rows from {offset} lie outside a {source.numel()} B source")
    flat = target.view(-1).view(torch.uint8)
    cudart = _cudart() if target.is_cuda and not source.is_cuda else None
    at = 0
    for offset, count in runs:
        if cudart is not None:
            stream = torch.cuda.current_stream(target.device).cuda_stream
            error = cudart.cudaMemcpy2DAsync(flat.data_ptr() + at, row_bytes, source.data_ptr() + offset, pitch_bytes,
                                             row_bytes, count, _HOST_TO_DEVICE, stream)  # fmt: skip
            if error != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync of {count} rows of {row_bytes} B failed with CUDA error {error}")
        else:
            for k in range(count):
                start = offset + k * pitch_bytes
                flat[at + k * row_bytes : at + (k + 1) * row_bytes].copy_(
                    source[start : start + row_bytes], non_blocking=True
                )
        at += count * row_bytes
