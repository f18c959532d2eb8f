"""Who may connect to a gateway: ``gateway.access``, applied to files and checked per client.

Two gates, both from the one setting:

1. **Files.** The socket (connecting needs write permission on it), the
   shared-memory segment (clients map it read-write), and the files the
   gateway and embedded mode keep beside the socket (locks, the child's
   config) are owner-only (0600) by default. ``group`` adds the group's
   read-write bits (the file's group is set to it); ``users`` add POSIX ACL
   entries, one per uid, so exactly those users are granted and nobody else.
   A directory the gateway creates for its socket gets search rights the same
   way (0700 by default).
2. **Credentials.** The gateway reads each connecting process's uid and groups
   from the kernel (``SO_PEERCRED``, ``SO_PEERGROUPS``) before it reads a
   byte, and refuses a process whose user is not admitted with
   ``ACCESS_DENIED``, naming the setting. This is the authoritative check:
   file modes do not bind root, and a directory's ACLs may be wider than ours.

A client that the kernel stops first (EACCES on connect or on opening the
segment) turns that into a reason naming the same setting (`denied_hint`).
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from kvharbor.config import AccessSection

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""Linux >= 4.13; Python's socket module does not name it."""
PEER_GROUPS_MAX = 256
"""Groups read per peer: Python's getsockopt buffer holds at most 1024 bytes. A peer in
more groups is judged by its primary group alone (it may then be refused, never wrongly admitted)."""
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# The binary form of a POSIX access ACL, as the kernel reads it from the
# ``system.posix_acl_access`` attribute (linux/posix_acl_xattr.h).
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permissions, id
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_NO_ID = 0xFFFFFFFF
_READ_WRITE = 0o6
_SEARCH = 0o1


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel vouches for it."""

    pid: int
    uid: int
    gids: frozenset[int]
    """Its primary and supplementary groups."""

    def describe(self) -> str:
        return f"pid {self.pid}, {user_name(self.uid)}, groups {sorted(self.gids)}"


def peer_of(sock: socket.socket) -> Peer:
    """The credentials of ``sock``'s peer, taken when it connected."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, PEER_GROUPS_MAX * 4)
    except OSError:  # An older kernel, or more groups than fit: the primary group only.
        raw = b""
    groups = struct.unpack(f"{len(raw) // 4}I", raw)
    return Peer(pid, uid, frozenset((gid, *groups)))


def user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class AccessPolicy:
    """``gateway.access`` as the gateway applies it; its owner is the gateway's user."""

    def __init__(self, section: AccessSection) -> None:
        self.section = section
        self.owner_uid = os.geteuid()
        self.gid = section.gid
        self.uids = section.uids

    def admits(self, peer: Peer) -> bool:
        return peer.uid == self.owner_uid or peer.uid in self.uids or (self.gid is not None and self.gid in peer.gids)

    def describe(self) -> str:
        """What the setting admits, in its own terms."""
        if not self.section.widened:
            return f"gateway.access is owner-only: only {user_name(self.owner_uid)}"
        admitted = [user_name(self.owner_uid)]
        if self.section.group is not None:
            admitted.append(f"gateway.access.group {self.section.group!r}")
        if self.section.users:
            admitted.append(f"gateway.access.users {list(self.section.users)}")
        return "gateway.access admits " + ", ".join(admitted)

    def refusal(self, peer: Peer, socket_path: Path) -> str:
        return (
            f"the gateway at {socket_path} (pid {os.getpid()}) refuses {peer.describe()}: {self.describe()}. "
            "To admit it, add its user to gateway.access.users or one of its groups as gateway.access.group "
            "in the gateway's config, and restart the gateway"
        )

    # -- files -------------------------------------------------------------

    def apply(self, path: Path, directory: bool = False) -> None:
        """Give ``path`` (ours) exactly the access of the setting: 0600 plus the group's
        and users' grants (search rights only, for a directory). Raises `OSError`
        (the caller names the path and the setting) when the group cannot be set or
        the filesystem has no ACLs for ``users``."""
        rights = _SEARCH if directory else _READ_WRITE
        owner = 0o7 if directory else _READ_WRITE
        group_rights = rights if self.gid is not None else 0
        if self.gid is not None:
            try:
                os.chown(path, -1, self.gid, follow_symlinks=False)
            except PermissionError:
                raise OSError(
                    errno.EPERM, f"the gateway's user is not a member of gateway.access.group {self.section.group!r}"
                ) from None
        if not self.uids:
            # No ACL but the mode: one left by an earlier setting, or inherited from the
            # directory's default ACL, would grant more than this setting says.
            try:
                os.removexattr(path, _ACL_XATTR, follow_symlinks=False)
            except OSError as err:
                if err.errno not in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
        os.chmod(path, owner << 6 | group_rights << 3)
        if self.uids:
            entries = [(_ACL_USER_OBJ, owner, _ACL_NO_ID)]
            entries += [(_ACL_USER, rights, uid) for uid in sorted(self.uids)]
            # The mask bounds every named entry and the group; both get exactly `rights`.
            entries += [(_ACL_GROUP_OBJ, group_rights, _ACL_NO_ID), (_ACL_MASK, rights, _ACL_NO_ID)]
            entries += [(_ACL_OTHER, 0, _ACL_NO_ID)]
            acl = _ACL_VERSION.pack(2) + b"".join(_ACL_ENTRY.pack(*entry) for entry in entries)
            try:
                os.setxattr(path, _ACL_XATTR, acl, follow_symlinks=False)
            except OSError as err:
                if err.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise OSError(
                        err.errno, "the filesystem has no POSIX ACLs, which gateway.access.users needs "
                        "(use gateway.access.group instead)", str(path),
                    ) from None  # fmt: skip
                raise

    def open_file(self, path: Path) -> int:
        """Open ``path`` read-write (created if missing) and give it this access if it is
        ours (a file of another user's stays as that user made it); returns the fd."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                self.apply(path)
        except OSError:
            os.close(fd)
            raise
        return fd

    def make_directory(self, path: Path) -> None:
        """Create the socket's directory (and its parents) if missing; a new one gets this
        access. An existing directory is the user's and is left as it is."""
        if path.is_dir():
            return
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.apply(path, directory=True)


def denied_hint(what: str, path: Path | str) -> str:
    """The reason a client gives when the kernel refuses it ``path`` (EACCES)."""
    return (
        f"permission denied on {what} {path} for this process ({user_name(os.geteuid())}, groups "
        f"{sorted({os.getegid(), *os.getgroups()})}): the gateway's gateway.access setting does not admit this "
        "user; add it to gateway.access.users or one of its groups as gateway.access.group in the gateway's config "
        "(every directory above the socket must be searchable by it too)"
    )
