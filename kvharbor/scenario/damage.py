"""Damage stored objects on disk, as a failing disk or a stray write would."""

from __future__ import annotations

from pathlib import Path

from kvharbor.hal.file import FileDevice


def damage_file_objects(root: Path, count: int | None = None, only: frozenset[bytes] | None = None) -> int:
    """Flip the last byte of stored objects of the file tier at ``root`` (the first ``count``
    in key order, or those under the keys ``only``, or every one), through the file device
    itself (real files, rewritten): the header stays intact, so only a full read finds the
    damage. Returns how many were damaged."""
    device = FileDevice("damage", str(root), 64 << 20)
    damaged = 0
    for key, size in sorted(device.scan()):
        if (only is not None and key not in only) or (count is not None and damaged >= count):
            continue
        value = bytearray(size)
        if device.get(key, memoryview(value)) != size:
            continue  # Gone meanwhile (evicted): nothing to damage.
        value[-1] ^= 0xFF
        device.put(key, [value])
        damaged += 1
    return damaged
