"""The NFS and ONTAP tiers: the file tier's driver, opened only on the filesystem the config names.

A file tier writes wherever its path leads. On a network filesystem that is a
hazard: an export that failed to mount leaves an empty directory on the local
disk, and a tier writing there fills the wrong disk and shares nothing. So these
tiers first check the mount table (`kvharbor.hal.mounts`):

- ``type: nfs``: ``path`` must be the mount point of an NFS filesystem;
- ``type: ontap``: ``mount`` must be, and ``path`` (a directory on it) holds the
  files. ``protocol: pnfs_rdma`` asks for NFSv4.1 or later, a pNFS layout and the
  RDMA transport; a mount without them still works as plain NFS, which is said
  once, unless ``strict_protocol``, which makes the tier unavailable instead.

A check that fails raises ValueError naming the tier and the key, and the store
skips the tier (``tier <name> unavailable: ...``). Past the checks the tier *is*
a file tier (`kvharbor.hal.file.FileDevice`): the same atomic puts, reads and
crash cleanup, since NFS (close-to-open consistency, atomic rename within a
directory) gives what that driver relies on.
"""

from __future__ import annotations

import os

from kvharbor.config import NfsTierSection, OntapTierSection
from kvharbor.hal.file import FileDevice, open_file_device
from kvharbor.hal.mounts import Mount, MountTable
from kvharbor.telemetry.log import PREFIX, get_logger

_log = get_logger("kvharbor.hal.nfs")

PNFS_VERSION_MIN = (4, 1)
"""pNFS is part of NFSv4.1 (RFC 5661); 4.0 and 3 have none."""


def open_nfs_device(section: NfsTierSection, max_value_bytes: int, mounts: MountTable | None = None) -> FileDevice:
    """The driver of a ``type: nfs`` tier; ``mounts``: the mount table (read from /proc by default)."""
    nfs_mount(section.name, "nfs", "path", section.path, mounts or MountTable.read())
    return open_file_device(section, max_value_bytes)


def open_ontap_device(section: OntapTierSection, max_value_bytes: int, mounts: MountTable | None = None) -> FileDevice:
    """The driver of a ``type: ontap`` tier; ``mounts`` as for `open_nfs_device`."""
    table = mounts or MountTable.read()
    mount = nfs_mount(section.name, "ontap", "mount", section.mount, table)
    if section.protocol == "pnfs_rdma":
        lacking = pnfs_rdma_lacks(mount, table)
        if lacking:
            why = "; ".join(lacking)
            if section.strict_protocol:
                raise ValueError(
                    f"ontap tier '{section.name}': protocol=pnfs_rdma requested but mount {mount.mount_point} is "
                    f"not pNFS-capable ({why}); strict_protocol: true refuses plain NFS"
                )
            _log.warning(
                "%sontap tier '%s': protocol=pnfs_rdma requested but mount %s is not pNFS-capable (%s); "
                "continuing with plain NFS file I/O (strict_protocol: true makes this fatal)",
                PREFIX,
                section.name,
                mount.mount_point,
                why,
            )
    return open_file_device(section, max_value_bytes)


def nfs_mount(tier: str, kind: str, key: str, path: str, mounts: MountTable) -> Mount:
    """The NFS mount at ``path``; ValueError naming the tier and ``key`` where there is none."""
    mount = mounts.at(os.path.expanduser(path))
    if mount is None:
        raise ValueError(
            f"{kind} tier '{tier}': {key} {path} is not a mount point (not in {mounts.source}); "
            "mount the export before starting"
        )
    if not mount.is_nfs:
        raise ValueError(f"{kind} tier '{tier}': {key} {path} is a {mount.fs_type} mount, not NFS")
    return mount


def pnfs_rdma_lacks(mount: Mount, mounts: MountTable) -> list[str]:
    """What ``mount`` lacks for pNFS over RDMA, each said as the mount shows it; [] when nothing."""
    lacking = []
    version = mount.nfs_version
    if version < PNFS_VERSION_MIN:
        lacking.append(f"vers={mount.super_options.get('vers', '?')}, pNFS needs 4.1 or later")
    layout = mounts.pnfs_layouts.get(mount.mount_point)
    if layout is None:
        lacking.append("no pNFS layout in /proc/self/mountstats")
    elif not layout.startswith("LAYOUT_"):
        lacking.append(f"pnfs={layout}")
    proto = mount.super_options.get("proto", "?")
    if proto not in ("rdma", "rdma6"):
        lacking.append(f"proto={proto}, not rdma")
    return lacking
