"""Damage stored objects on disk, as a failing disk or a stray write would (`kvharbor.scenario.damage`)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from kvharbor.scenario.damage import damage_file_objects as _damage


def damage_file_objects(root: Path, only: Collection[bytes] | None = None) -> int:
    return _damage(root, only=None if only is None else frozenset(bytes(k) for k in only))
