"""A directory of files: the local-disk and NFS tier. One value per file.

Layout: ``<root>/ab/cd/abcd…`` — the 32-hex key, under ``fanout_levels``
directories named by its first hex pairs, so no directory grows past 256
subdirectories and a million values spread over 65 536 leaves. Fan-out
directories are made on first use and never removed, so a put never races a
cleaner that deletes the directory it is writing into.

A put is atomic and crash-safe: the value goes to a temp file beside its final
name, is fsynced, renamed over the final name, and the directory is fsynced so
the rename itself survives a power cut. A reader therefore sees the old value,
the new one, or a miss — never a prefix. Files are never changed in place, so
a file that shrinks while it is read was damaged from outside. A read, whole
or streamed in slices (`get_streamed`), goes through one descriptor: it reads
one version even while a put renames a new one over it. Reads use ``preadv``,
not ``mmap``: a mapped file truncated from outside, or gone stale on NFS,
kills the reader with SIGBUS, where ``preadv`` reports the damage. A read is
done by I/O threads in chunks while the caller hashes the chunks before, and
a cold file may be read with O_DIRECT (``cold_reads_direct``): see
`kvharbor.hal.file_reads`; a value may be written with O_DIRECT from where it
lies (``direct_writes``): see `kvharbor.hal.file_writes`.

Temp files left by crashed writers are removed when the device is opened
(see `kvharbor.hal.tempfiles` for how a dead writer is told from a live one);
that walks every fan-out directory once, listing names only.

`usage` describes the filesystem, not this tier: one ``statvfs``, correct
whatever other processes do. The tier's own bytes and keys are counted by its
manifest (`kvharbor.cache.manifest`), which every process sharing the
directory updates in one transaction.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvharbor.config import FileTierSection
from kvharbor.hal.base import (
    STREAM_SLICE_BYTES,
    Buffer,
    BufferTooSmall,
    Device,
    DeviceCorrupt,
    DeviceError,
    DeviceUnavailable,
    Health,
    HealthState,
    PersistentDevice,
    SliceConsumer,
    Usage,
)
from kvharbor.hal.file_reads import READ_THREADS, ReadPlan, read_file
from kvharbor.hal.file_writes import write_parts
from kvharbor.hal.posix import device_error, fsync_dir, read_into
from kvharbor.hal.tempfiles import TEMP_SUFFIX, abandoned, temp_name, this_machine
from kvharbor.telemetry.log import PREFIX, OnceLog, get_logger

_log = get_logger("kvharbor.hal.file")

KEY_BYTES = 16
"""Devices store values under 16-byte keys (`kvharbor.hal.base`)."""
TEMP_STALE_AFTER_S = 3600.0
"""A temp file this old is abandoned whoever wrote it: no put takes an hour."""
FREE_RATIO_DEGRADED = 0.05
"""Below this share of the filesystem free, `health` says DEGRADED (the default of a file
tier's ``degraded_below_free_pct``, 5 %)."""

# One formatter per fan-out depth: ~4x faster than a generic join, and paths
# are built for every key of every batched call.
_PATHS: dict[int, Callable[[str, str], str]] = {
    0: lambda root, name: f"{root}/{name}",
    1: lambda root, name: f"{root}/{name[0:2]}/{name}",
    2: lambda root, name: f"{root}/{name[0:2]}/{name[2:4]}/{name}",
    3: lambda root, name: f"{root}/{name[0:2]}/{name[2:4]}/{name[4:6]}/{name}",
}
_FANOUT_NAME = re.compile(r"[0-9a-f]{2}")
_KEY_NAME = re.compile(r"[0-9a-f]{32}")
_FILE_MODE = 0o644
_DIR_MODE = 0o755
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC


class FileDevice(Device, PersistentDevice):
    def __init__(
        self,
        name: str,
        root: str,
        max_value_bytes: int,
        *,
        fanout_levels: int = 2,
        fsync: bool = True,
        cold_reads_direct: bool = False,
        direct_writes: bool = False,
        temp_stale_after_s: float = TEMP_STALE_AFTER_S,
        free_ratio_degraded: float = FREE_RATIO_DEGRADED,
    ) -> None:
        """Open (creating if needed) the directory ``root``.

        ``cold_reads_direct``: read a file not in the page cache with O_DIRECT (see
        `kvharbor.hal.file_reads`); ``direct_writes``: write values with O_DIRECT from where
        they lie (see `kvharbor.hal.file_writes`); either buffered, said once, where the
        filesystem refuses O_DIRECT.
        Raises `DeviceUnavailable` naming the path when it cannot be created, is
        not a directory, or does not take a new file.
        """
        super().__init__(name, max_value_bytes)
        assert fanout_levels in _PATHS, fanout_levels
        assert temp_stale_after_s > 0 and 0 <= free_ratio_degraded < 1
        self.root = os.path.abspath(root)
        self.fanout_levels = fanout_levels
        self.fsync = fsync
        self.temp_stale_after_s = temp_stale_after_s
        self.free_ratio_degraded = free_ratio_degraded
        self.cold_reads_direct = cold_reads_direct
        """Still asked for: cleared when the filesystem refuses O_DIRECT."""
        self.direct_writes = direct_writes
        """Still asked for: cleared when the filesystem refuses O_DIRECT."""
        self._once = OnceLog(_log)
        self._machine = this_machine()
        self.interrupted_keys: list[bytes] = []
        """Keys whose temp files `__init__` removed: writes whose writer died (see
        `kvharbor.cache.assembly.open_index`, which drops their index entries)."""
        self._open_root()
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"kvharbor-file-{name}")
        try:
            removed = self._remove_abandoned_temps()
        except OSError as err:
            raise self._error(err, f"sweep temp files in {self.root}") from err
        if removed:
            _log.info(
                "%stier '%s': removed %d temp files left by interrupted writes in %s",
                PREFIX,
                name,
                removed,
                self.root,
            )

    @property
    def state_dir(self) -> str:
        return self.root

    def close(self) -> None:
        self._reads.shutdown(wait=True)

    # -- values ------------------------------------------------------------

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        views = [memoryview(part).cast("B") for part in parts]
        path = self._path(key)
        directory = os.path.dirname(path)
        temp = os.path.join(directory, temp_name(os.path.basename(path), self._machine))
        try:
            fd, new_entries = self._create(temp, directory)
            try:
                result = write_parts(fd, views, self.direct_writes)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if result.refused:
                self.direct_writes = False
                self._say_direct_refused("writes")
            assert result.nbytes == total, (result.nbytes, total)
            os.rename(temp, path)
            if self.fsync:
                # The rename, then the entries of the fan-out directories this
                # put made. Flushed here rather than after each mkdir: as durable
                # (all before put returns), and on a journaling filesystem the
                # file's fsync has already committed the mkdirs, so those flushes
                # usually find nothing left to write.
                for changed in (directory, *new_entries):
                    fsync_dir(changed)
        except BaseException as err:
            _remove_quietly(temp)
            if isinstance(err, OSError):
                raise self._error(err, f"put {path}") from err
            raise

    def get(self, key: bytes, into: memoryview) -> int | None:
        return self._read(key, into, None, 0)

    def get_streamed(
        self,
        key: bytes,
        into: memoryview,
        consume: SliceConsumer,
        slice_bytes: int = STREAM_SLICE_BYTES,
    ) -> int | None:
        """One descriptor for the whole value (one version of it), read a slice at a time."""
        assert slice_bytes > 0, slice_bytes
        return self._read(key, into, consume, slice_bytes)

    def peek(self, key: bytes, into: memoryview) -> int | None:
        path = self._path(key)
        fd = self._open_or_miss(path, "peek")
        if fd is None:
            return None
        try:
            return read_into(fd, _bytes_view(into))
        except OSError as err:
            raise self._error(err, f"peek {path}") from err
        finally:
            os.close(fd)

    def size(self, key: bytes) -> int | None:
        path = self._path(key)
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            self._check_root()
            return None
        except OSError as err:
            raise self._error(err, f"size {path}") from err

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        flags = []
        for key in keys:
            path = self._path(key)
            try:
                os.stat(path)
            except FileNotFoundError:
                flags.append(False)
            except OSError as err:
                raise self._error(err, f"exists {path}") from err
            else:
                flags.append(True)
        if not all(flags):
            self._check_root()  # Once per batch: misses from a vanished root are a fault.
        assert len(flags) == len(keys)
        return flags

    def delete(self, key: bytes) -> bool:
        # No directory fsync: a delete undone by a power cut leaves a valid
        # object that recovery finds again; durability costs a flush per delete.
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            self._check_root()
            return False
        except OSError as err:
            raise self._error(err, f"delete {path}") from err
        return True

    def scan(self) -> Iterator[tuple[bytes, int]]:
        try:
            yield from self._scan(self.root, 0, "")
        except OSError as err:
            raise self._error(err, f"scan {self.root}") from err

    # -- state -------------------------------------------------------------

    def usage(self) -> Usage:
        """The filesystem's figures: bytes and inodes in use by anyone, and its size."""
        try:
            vfs = os.statvfs(self.root)
        except OSError as err:
            raise self._error(err, f"statvfs {self.root}") from err
        block = vfs.f_frsize or vfs.f_bsize
        used = (vfs.f_blocks - vfs.f_bfree) * block
        return Usage(used, used + vfs.f_bavail * block, vfs.f_files - vfs.f_ffree)

    def health(self) -> Health:
        try:
            if not stat.S_ISDIR(os.stat(self.root).st_mode):
                return Health(HealthState.FAILED, f"{self.root} is not a directory")
            vfs = os.statvfs(self.root)
        except OSError as err:
            return Health(HealthState.FAILED, f"{self.root}: {err.strerror or err}")
        if vfs.f_flag & os.ST_RDONLY or not os.access(self.root, os.W_OK | os.X_OK):
            return Health(HealthState.FAILED, f"{self.root} is not writable")
        free = vfs.f_bavail / vfs.f_blocks if vfs.f_blocks else 0.0
        if free < self.free_ratio_degraded:
            return Health(HealthState.DEGRADED, f"{self.root}: {free:.1%} of the filesystem free")
        return Health(HealthState.OK)

    # -- internals ---------------------------------------------------------

    def _path(self, key: bytes) -> str:
        assert len(key) == KEY_BYTES, len(key)
        return _PATHS[self.fanout_levels](self.root, key.hex())

    def _open_root(self) -> None:
        try:
            os.makedirs(self.root, mode=_DIR_MODE, exist_ok=True)
        except FileExistsError:
            pass  # Something that is not a directory; said just below.
        except OSError as err:
            raise DeviceUnavailable(self.name, f"path {self.root} cannot be created ({err.strerror})") from err
        if not os.path.isdir(self.root):
            raise DeviceUnavailable(self.name, f"path {self.root} is not a directory")
        # os.access misjudges NFS root squash and ACLs; only a real create is proof.
        probe = os.path.join(self.root, temp_name("probe", self._machine))
        try:
            os.close(os.open(probe, _CREATE_FLAGS, _FILE_MODE))
            os.unlink(probe)
        except OSError as err:
            raise DeviceUnavailable(self.name, f"path {self.root} is not writable ({err.strerror})") from err

    def _read(self, key: bytes, into: memoryview, consume: SliceConsumer | None, slice_bytes: int) -> int | None:
        """Read the value into ``into`` through one descriptor: whole (``slice_bytes``
        0), or a slice at a time, each handed to ``consume`` as soon as it is filled."""
        path = self._path(key)
        fd = self._open_or_miss(path, "get")
        if fd is None:
            return None
        view = _bytes_view(into)
        try:
            size = os.fstat(fd).st_size
            if size > view.nbytes:
                raise BufferTooSmall(self.name, size, view.nbytes)
            plan = ReadPlan(size, self.cold_reads_direct, slice_bytes or size or 1)
            result = read_file(self._reads, fd, view, plan, consume)
        except OSError as err:
            raise self._error(err, f"get {path}") from err
        finally:
            os.close(fd)
        if result.refused:
            self.cold_reads_direct = False
            self._say_direct_refused("cold reads")
        if result.nbytes != size:
            raise DeviceCorrupt(self.name, f"{path} shrank from {size} to {result.nbytes} bytes while being read")
        return size

    def _say_direct_refused(self, what: str) -> None:
        """The filesystem refused O_DIRECT for ``what`` (reads or writes), which the caller
        stops asking for: said once, as it holds for the filesystem's life."""
        self._once.say(
            f"direct {what}:{self.name}",
            f"tier '{self.name}': the filesystem of {self.root} refuses O_DIRECT; {what} are buffered",
        )

    def _create(self, temp: str, directory: str) -> tuple[int, list[str]]:
        """Create ``temp``; also returns the directories that gained a fan-out
        subdirectory on the way, deepest first (their entries are not yet durable)."""
        try:
            return os.open(temp, _CREATE_FLAGS, _FILE_MODE), []
        except FileNotFoundError:
            if directory == self.root:
                raise  # The root itself is gone; see `_make_fanout`.
            new_entries = self._make_fanout(directory)
            return os.open(temp, _CREATE_FLAGS, _FILE_MODE), new_entries

    def _make_fanout(self, directory: str) -> list[str]:
        """Make the fan-out directories down to ``directory``, never the root itself;
        returns the directories that gained an entry, deepest first.

        Recreating a vanished root would write under an empty mount point, onto
        the wrong disk; an absent root stays an error (ENOENT, unavailable).
        """
        relative = os.path.relpath(directory, self.root)
        assert relative != os.curdir and not relative.startswith(os.pardir), directory
        parent = self.root
        changed = []
        for name in relative.split(os.sep):
            path = os.path.join(parent, name)
            try:
                os.mkdir(path, _DIR_MODE)
            except FileExistsError:
                pass
            else:
                changed.append(parent)
            parent = path
        return changed[::-1]

    def _open_or_miss(self, path: str, action: str) -> int | None:
        try:
            return os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            self._check_root()
            return None
        except OSError as err:
            raise self._error(err, f"{action} {path}") from err

    def _check_root(self) -> None:
        """A miss is a miss only while the root is there; else the device is gone."""
        if not os.path.isdir(self.root):
            raise DeviceUnavailable(self.name, f"path {self.root} is gone (unmounted or removed)")

    def _error(self, err: OSError, action: str) -> DeviceError:
        if isinstance(err, FileNotFoundError) and not os.path.isdir(self.root):
            return DeviceUnavailable(self.name, f"path {self.root} is gone (unmounted or removed)")
        return device_error(self.name, err, action)

    def _scan(self, directory: str, depth: int, prefix: str) -> Iterator[tuple[bytes, int]]:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            if depth == 0:
                raise
            return  # Not ours to vanish, but nothing to list either.
        for entry in entries:
            name = entry.name
            if depth < self.fanout_levels:
                if _FANOUT_NAME.fullmatch(name) and entry.is_dir(follow_symlinks=False):
                    yield from self._scan(entry.path, depth + 1, prefix + name)
                continue
            # Only final names in the directory their key belongs to: temp files,
            # the manifest and strays are not values.
            if not (_KEY_NAME.fullmatch(name) and name.startswith(prefix)):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # Deleted since the listing.
            if stat.S_ISREG(info.st_mode):
                yield bytes.fromhex(name), info.st_size

    def _remove_abandoned_temps(self) -> int:
        removed = 0
        now = time.time()
        for directory in self._all_directories():
            for entry in _list_quietly(directory):
                if not entry.name.endswith(TEMP_SUFFIX):
                    continue
                try:
                    age_s = now - entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue  # Its writer finished.
                if abandoned(entry.name, age_s, self._machine, self.temp_stale_after_s):
                    removed += _remove_quietly(entry.path)
                    stem = entry.name.split(".", 1)[0]
                    if _KEY_NAME.fullmatch(stem):
                        self.interrupted_keys.append(bytes.fromhex(stem))
        return removed

    def _all_directories(self) -> Iterator[str]:
        level = [self.root]
        for _ in range(self.fanout_levels + 1):
            yield from level
            level = [
                entry.path
                for directory in level
                for entry in _list_quietly(directory)
                if _FANOUT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
            ]


def _bytes_view(into: memoryview) -> memoryview:
    assert into.contiguous and not into.readonly, "get needs a writable contiguous buffer"
    return into if into.format == "B" else into.cast("B")


def _list_quietly(directory: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(directory))
    except FileNotFoundError:
        return []


def _remove_quietly(path: str) -> bool:
    """Remove a temp file; failing to is harmless (the next open sweeps it)."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def open_file_device(section: FileTierSection, max_value_bytes: int) -> FileDevice:
    """The driver for a ``type: file`` tier section."""
    return FileDevice(
        section.name,
        os.path.expanduser(section.path),
        max_value_bytes,
        fanout_levels=section.fanout_levels,
        fsync=section.fsync,
        cold_reads_direct=section.cold_reads_direct,
        direct_writes=section.direct_writes,
        free_ratio_degraded=section.degraded_below_free_pct / 100,
    )
