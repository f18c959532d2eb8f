"""What the configured file tiers hold on disk, read without a gateway and without changing them.

``kvharbor status`` and ``kvharbor doctor`` fall back on this when no gateway answers:
each file tier's manifest (`kvharbor.cache.manifest.ManifestReader`, read-only) and its
layout registry (`kvharbor.gateway.layouts`), nothing else; no directory is created,
no temp file swept, no manifest rebuilt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import TypeAdapter

from kvharbor.cache.manifest import ManifestReader, ManifestUnreadable
from kvharbor.config import Config, FileTierSection
from kvharbor.gateway.layouts import read_registry_file, registry_path
from kvharbor.gateway.status import RegisteredLayout


@dataclass(frozen=True, slots=True)
class TierOnDisk:
    name: str
    path: str
    objects: int | None
    """What the manifest counts; None when it cannot be read (``problem`` says why)."""
    used_bytes: int | None
    layouts: list[RegisteredLayout] = field(default_factory=list)
    """What the tier's layout registry names."""
    problem: str = ""
    """Why the manifest or the registry could not be read; empty when both were."""


def file_tiers(config: Config) -> list[FileTierSection]:
    return [t for t in config.storage.tiers if isinstance(t, FileTierSection)]


def tier_root(section: FileTierSection) -> str:
    """The directory a file tier keeps its objects, manifest and registry in (as `FileDevice` opens it)."""
    return os.path.abspath(os.path.expanduser(section.path))


def read_tier(section: FileTierSection) -> TierOnDisk:
    root = tier_root(section)
    problems = []
    objects = used = None
    try:
        reader = ManifestReader(root)
        try:
            objects, used = reader.totals()
        finally:
            reader.close()
    except ManifestUnreadable as err:
        problems.append(str(err))
    layouts: list[RegisteredLayout] = []
    try:
        layouts = read_registry_file(registry_path(root))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as err:
        problems.append(f"layout registry: {err}")
    return TierOnDisk(section.name, root, objects, used, layouts, "; ".join(problems))


def read_disk(config: Config) -> list[TierOnDisk]:
    return [read_tier(section) for section in file_tiers(config)]


def locate_on_disk(config: Config, keys: Sequence[bytes]) -> tuple[list[str], list[int], list[str]]:
    """`kvharbor.gateway.protocol.LocateOk.holders` of ``keys`` from the file tiers' manifests:
    (the tiers the bits name, the holders, problems with tiers that could not be read)."""
    names: list[str] = []
    holders = [0] * len(keys)
    problems = []
    for section in file_tiers(config):
        try:
            reader = ManifestReader(tier_root(section))
        except ManifestUnreadable as err:
            problems.append(f"tier {section.name}: {err}")
            continue
        try:
            present = reader.contains(keys)
        except ManifestUnreadable as err:
            problems.append(f"tier {section.name}: {err}")
            continue
        finally:
            reader.close()
        bit = 1 << len(names)
        names.append(section.name)
        for i, here in enumerate(present):
            if here:
                holders[i] |= bit
    return names, holders, problems


@dataclass(frozen=True, slots=True)
class NoGatewayReport:
    """``kvharbor status --json`` when no gateway answers: why, and what the disk holds."""

    socket: str
    absence: str
    """A `kvharbor.gateway.query.Absence` value: ``socket missing``, ``connection refused``, ..."""
    message: str
    on_disk: list[TierOnDisk]

    def to_json(self) -> str:
        return TypeAdapter(NoGatewayReport).dump_json(self, indent=2).decode()
