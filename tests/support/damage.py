"""Damage stored objects on disk, as a failing disk or a stray write would."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from kvharbor.hal.file import FileDevice


def damage_file_objects(root: Path, only: Collection[bytes] | None = None) -> int:
    """Flip the last byte of every object (or of those under the keys ``only``) of the file
    tier at ``root``, through the file device itself (real files, rewritten): the header
    stays intact, so only a full read finds the damage. Returns how many were damaged."""
    device = FileDevice("damage", str(root), 64 << 20)
    damaged = 0
    for key, size in list(device.scan()):
        if only is not None and key not in only:
            continue
        value = bytearray(size)
        assert device.get(key, memoryview(value)) == size
        value[-1] ^= 0xFF
        device.put(key, [value])
        damaged += 1
    return damaged
