"""What is mounted where: ``/proc/self/mountinfo`` and, for NFS, ``/proc/self/mountstats``.

The NFS and ONTAP tiers (`kvharbor.hal.nfs`) ask this before they write a byte:
is the tier's path a mount point, of which filesystem, with which NFS version,
transport and pNFS layout. Both files are read as the kernel writes them:

- mountinfo (proc(5)): ``ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] -
  FSTYPE SOURCE SUPER_OPTIONS``, with space, tab, newline and backslash in names
  escaped as ``\\040``, ``\\011``, ``\\012``, ``\\134``. An NFS mount's super
  options carry ``vers=4.1``, ``proto=rdma``...;
- mountstats: ``device SOURCE mounted on MOUNT_POINT with fstype nfs4 statvers=1.1``,
  then tab-indented lines; an NFSv4 mount's ``nfsv4:`` line names its pNFS layout
  driver (``pnfs=LAYOUT_NFSV4_1_FILES``), or ``pnfs=not configured``. pNFS is
  negotiated, not a mount option: only this file says whether a mount uses it.

Later lines of mountinfo shadow earlier ones at the same mount point (the
kernel lists mounts in the order they were stacked).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MOUNTINFO_PATH = "/proc/self/mountinfo"
MOUNTSTATS_PATH = "/proc/self/mountstats"
NFS_TYPES = frozenset({"nfs", "nfs4"})
PNFS_NOT_CONFIGURED = "not configured"
"""What the kernel writes after ``pnfs=`` for a mount without a layout driver."""

_ESCAPE = re.compile(r"\\([0-7]{3})")
_DEVICE_LINE = re.compile(r"device (\S+) mounted on (\S+) with fstype (\S+)")


class MountTableError(ValueError):
    """A mount table line that is not in the kernel's form; names the file and the line."""


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    fs_type: str
    source: str
    options: tuple[str, ...]
    """The per-mount options (``rw``, ``relatime``...)."""
    super_options: Mapping[str, str] = field(default_factory=dict)
    """The filesystem's options; a flag without ``=`` maps to ""."""

    @property
    def is_nfs(self) -> bool:
        return self.fs_type in NFS_TYPES

    @property
    def nfs_version(self) -> tuple[int, ...]:
        """``vers=4.1`` as (4, 1); () where the options do not say (not NFS)."""
        try:
            return tuple(int(part) for part in self.super_options.get("vers", "").split("."))
        except ValueError:
            return ()


@dataclass(frozen=True, slots=True)
class MountTable:
    """The mounts of this process's mount namespace, and the pNFS layouts of its NFS mounts."""

    mounts: Sequence[Mount]
    pnfs_layouts: Mapping[str, str] = field(default_factory=dict)
    """Mount point -> its pNFS layout driver, `PNFS_NOT_CONFIGURED` for an NFSv4 mount with none."""
    source: str = MOUNTINFO_PATH
    """The mountinfo file the table was read from (said in messages)."""

    @classmethod
    def read(cls, mountinfo_path: str | None = None, mountstats_path: str | None = None) -> MountTable:
        """Read both files (this process's, `MOUNTINFO_PATH` and `MOUNTSTATS_PATH`, by default);
        raises OSError (mountinfo unreadable) or `MountTableError`. A missing or unreadable
        mountstats only leaves pNFS unknown."""
        mountinfo_path = mountinfo_path or MOUNTINFO_PATH
        mountstats_path = mountstats_path or MOUNTSTATS_PATH
        with open(mountinfo_path, encoding="utf-8", errors="surrogateescape") as file:
            mounts = parse_mountinfo(file.read(), mountinfo_path)
        try:
            with open(mountstats_path, encoding="utf-8", errors="surrogateescape") as file:
                layouts = parse_pnfs_layouts(file.read())
        except OSError:
            layouts = {}
        return cls(mounts, layouts, mountinfo_path)

    def at(self, path: str) -> Mount | None:
        """The mount whose mount point is ``path`` (symlinks resolved), or None: a path
        inside a mount, or not mounted at all."""
        real = os.path.realpath(path)
        found = None
        for mount in self.mounts:
            if mount.mount_point == real:
                found = mount  # The last one stacked there is the one in use.
        return found


def parse_mountinfo(text: str, source: str = MOUNTINFO_PATH) -> list[Mount]:
    mounts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
            fs_type, device, super_options = fields[separator + 1 : separator + 4]
        except ValueError:
            raise MountTableError(f"{source} line {number} is not a mountinfo line: {line!r}") from None
        mounts.append(
            Mount(
                mount_point=_unescape(fields[4]),
                fs_type=fs_type,
                source=_unescape(device),
                options=tuple(fields[5].split(",")),
                super_options=_options(super_options),
            )
        )
    return mounts


def parse_pnfs_layouts(text: str) -> dict[str, str]:
    """Mount point -> the ``pnfs=`` value of its ``nfsv4:`` line, from mountstats."""
    layouts: dict[str, str] = {}
    mount_point = None
    for line in text.splitlines():
        device = _DEVICE_LINE.match(line)
        if device is not None:
            mount_point = _unescape(device.group(2))
            continue
        name, _, value = line.strip().partition(":")
        if name == "nfsv4" and mount_point is not None:
            options = _options(value.strip())
            if "pnfs" in options:
                layouts[mount_point] = options["pnfs"]
    return layouts


def _options(text: str) -> dict[str, str]:
    pairs = (option.partition("=") for option in text.split(",") if option)
    return {name: value for name, _, value in pairs}


def _unescape(name: str) -> str:
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), name)
