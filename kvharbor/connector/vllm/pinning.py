"""Page-locking the gateway's shared memory for the GPU (``cudaHostRegister``).

Every copy to or from a registered mapping is a DMA by the copy engines,
never a pageable copy through a driver bounce buffer. On the CPU nothing is
registered: the mapping is only seen as one byte tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

import torch

from kvharbor.gateway.shm import address_of

Register = Callable[[int, int], None]
Unregister = Callable[[int], None]


class PinError(Exception):
    """Shared memory could not be page-locked for the GPU."""


def cuda_host_register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for CUDA; raises `PinError` with CUDA's reason."""
    try:
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    except (RuntimeError, AttributeError, OSError) as err:
        raise PinError(f"cudaHostRegister is not available: {err}") from None
    code = int(getattr(error, "value", error))
    if code != 0:
        name = getattr(error, "name", "")
        raise PinError(f"cudaHostRegister({nbytes >> 20} MiB) failed with CUDA error {code} {name}".rstrip())


def cuda_host_unregister(address: int) -> None:
    with contextlib.suppress(RuntimeError, AttributeError, OSError):
        torch.cuda.cudart().cudaHostUnregister(address)


class PinnedMapping:
    """One mapping of the gateway's segment as a byte tensor, page-locked for the GPU
    while this lives when a ``register`` is given.

    ``tensor`` is the whole mapping as bytes; a value's place in it is
    ``offset(view)``. The tensor does not export the segment's memoryview, so
    the client can unmap it once `close` has run.
    """

    def __init__(
        self,
        view: memoryview,
        register: Register | None = cuda_host_register,
        unregister: Unregister = cuda_host_unregister,
    ) -> None:
        """Register all of ``view`` for reads and writes: the GPU reads hits from the
        RAM tiers in place and writes puts into them in place. It must be writable
        (CUDA pins pages for writing only in a writable mapping)."""
        self.base = address_of(view)
        self.size = view.nbytes
        self._registered: int | None = None
        self._unregister = unregister
        if register is not None:
            register(self.base, self.size)  # Raises PinError.
            self._registered = self.base
        array = (ctypes.c_uint8 * self.size).from_address(self.base)
        self.tensor = torch.frombuffer(array, dtype=torch.uint8)

    @property
    def registered(self) -> bool:
        return self._registered is not None

    def offset(self, view: memoryview) -> int:
        """Where ``view`` (a view of this mapping's segment) starts in ``tensor``."""
        offset = address_of(view) - self.base
        if offset < 0 or offset + view.nbytes > self.size:
            # A view of another mapping: copying through it would read or write the wrong bytes.
            raise ValueError(f"a view of {view.nbytes} B at {offset} lies outside this {self.size} B mapping")
        return offset

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._registered is not None:
            self._unregister(self._registered)
            self._registered = None
