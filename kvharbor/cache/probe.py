"""The device probe: write, read back and delete one small object through the real object format.

Run when a tier opens (`kvharbor.cache.assembly`) and as a background trial of a
tier whose breaker is due one (`kvharbor.cache.tier.Tier.probe`): asking the
medium itself, not a table in memory, is what tells a disk or a card target that
answers from one that does not.
"""

from __future__ import annotations

import os

from kvharbor.cache.format import HEADER_BYTES, Codec, CorruptObject, decode, encode
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.hal.base import Device, DeviceError

PROBE_BYTES = 4096
_PROBE_FINGERPRINT = LayoutFingerprint(model_id="kvharbor-startup-probe", chunk_size=1).digest()


class ProbeFailed(Exception):
    """Which step of the probe broke; ``error`` is the device's own error, where there was one."""

    def __init__(self, message: str, error: DeviceError | None = None) -> None:
        super().__init__(message)
        self.error = error


def probe_device(device: Device, codec: Codec) -> None:
    """Write, read back and delete one object; raise `ProbeFailed` saying which step broke."""
    key = ChunkKey(os.urandom(16))
    payload = os.urandom(PROBE_BYTES)
    step = "write"
    try:
        for part in encode(key, _PROBE_FINGERPRINT, payload, codec, device.max_value_bytes):
            part.put_on(device)
        step = "read back"

        def read(device_key: ChunkKey) -> memoryview | None:
            buffer = memoryview(bytearray(PROBE_BYTES * 2 + HEADER_BYTES))
            got = device.get(device_key, buffer)
            return None if got is None else buffer[:got]

        value = decode(key, _PROBE_FINGERPRINT, read)
        if value is None or bytes(value) != payload:
            raise ProbeFailed("read back: the probe object came back different or not at all")
        step = "delete"
        if not device.delete(key):
            raise ProbeFailed("delete: the probe object was not there to delete")
    except (DeviceError, CorruptObject, OSError) as err:
        raise ProbeFailed(f"{step}: {err}", err if isinstance(err, DeviceError) else None) from None
