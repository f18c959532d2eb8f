"""A bounded in-memory device: the RAM tier inside one process (the gateway).

Values live in one dict of bytearrays; the bound is a hard byte limit, not a
policy — the tier above evicts before it is reached, and a put past it raises
`DeviceFull` rather than growing the process without limit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvharbor.hal.base import (
    STREAM_SLICE_BYTES,
    Buffer,
    BufferTooSmall,
    Device,
    DeviceFull,
    Health,
    HealthState,
    SliceConsumer,
    Usage,
    copy_streamed,
)


class RamDevice(Device):
    def __init__(self, name: str, capacity_bytes: int, max_value_bytes: int | None = None) -> None:
        assert capacity_bytes > 0, capacity_bytes
        super().__init__(name, max_value_bytes or capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._values: dict[bytes, bytearray] = {}
        self._used_bytes = 0
        # The gateway serves clients from several threads; dict updates and the
        # byte count must move together.
        self._lock = threading.Lock()

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        # One allocation and one copy per part. Not bytearray(total) plus slice
        # assignment: that zero-fills first, and assigning a memoryview into a
        # bytearray slice copies it into a temporary bytearray on the way.
        value = bytearray().join(memoryview(part).cast("B") for part in parts)
        assert len(value) == total, (len(value), total)
        with self._lock:
            old = self._values.get(key)
            used = self._used_bytes - (len(old) if old is not None else 0) + total
            if used > self.capacity_bytes:
                raise DeviceFull(
                    self.name,
                    f"{total} bytes do not fit ({self._used_bytes} of {self.capacity_bytes} used)",
                )
            self._values[bytes(key)] = value
            self._used_bytes = used
        assert 0 <= self._used_bytes <= self.capacity_bytes

    def get(self, key: bytes, into: memoryview) -> int | None:
        with self._lock:
            value = self._values.get(key)
        if value is None:
            return None
        if into.nbytes < len(value):
            raise BufferTooSmall(self.name, len(value), into.nbytes)
        into[: len(value)] = value
        return len(value)

    def get_streamed(
        self, key: bytes, into: memoryview, consume: SliceConsumer, slice_bytes: int = STREAM_SLICE_BYTES
    ) -> int | None:
        with self._lock:
            value = self._values.get(key)
        if value is None:
            return None
        if into.nbytes < len(value):
            raise BufferTooSmall(self.name, len(value), into.nbytes)
        return copy_streamed(memoryview(value), into, consume, slice_bytes)

    def size(self, key: bytes) -> int | None:
        value = self._values.get(key)
        return None if value is None else len(value)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        values = self._values
        return [k in values for k in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            value = self._values.pop(key, None)
            if value is None:
                return False
            self._used_bytes -= len(value)
        return True

    def scan(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            items = [(k, len(v)) for k, v in self._values.items()]
        yield from items

    def usage(self) -> Usage:
        return Usage(self._used_bytes, self.capacity_bytes, len(self._values))

    def health(self) -> Health:
        return Health(HealthState.OK)

    def close(self) -> None:
        with self._lock:
            self._values.clear()
            self._used_bytes = 0
