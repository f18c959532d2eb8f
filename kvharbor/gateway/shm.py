"""The shared-memory segment the gateway and its clients exchange KV bytes through.

One file in /dev/shm per gateway, named ``<shm_name>.<gateway pid>`` so that a
new gateway never reuses the memory an old one's clients may still map, and
so that a segment whose gateway is dead is recognisable as stale.

Engine and gateway must share the host's IPC namespace and /dev/shm: a client
that cannot open the segment says so, with the settings that fix it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvharbor.config import MIB
from kvharbor.gateway.access import denied_hint
from kvharbor.hal.extents import PAGE_BYTES
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway.shm")
_libc = ctypes.CDLL(None, use_errno=True)
MADV_REMOVE = 9
"""madvise(2): free the range and its backing store (tmpfs pages)."""

SHM_DIR = Path("/dev/shm")
SHARE_HINT = (
    "the engine and the gateway must share the host's IPC namespace and /dev/shm: "
    "docker run --ipc=host, Kubernetes hostIPC: true, and no volume mounted over /dev/shm"
)


class ShmTooSmall(Exception):
    pass


class ShmUnavailable(Exception):
    pass


class ShmDenied(ShmUnavailable):
    """The segment exists but this process's user may not open it (``gateway.access``)."""


@dataclass(frozen=True, slots=True)
class RingPlan:
    requested_bytes: int
    granted_bytes: int
    free_bytes: int
    total_bytes: int
    reserve_bytes: int = 0

    @property
    def shrunk(self) -> bool:
        return self.granted_bytes < self.requested_bytes

    def warning(self, directory: Path) -> str:
        """The start-up warning for a shrunk ring: the sizes, and how to make room."""
        return (
            f"the gateway ring of {self.requested_bytes // MIB} MiB (gateway.ring_mb) does not fit in "
            f"{directory} ({self.free_bytes // MIB} MiB free of {self.total_bytes // MIB} MiB, "
            f"{self.reserve_bytes // MIB} MiB kept free by gateway.shm_reserve_mb); using "
            f"{self.granted_bytes // MIB} MiB. {enlarge_hint(self.requested_bytes + self.reserve_bytes)}"
        )


def plan_ring(
    requested_bytes: int,
    min_bytes: int,
    free_bytes: int,
    total_bytes: int,
    reserve_bytes: int = 0,
    where: Path = SHM_DIR,
) -> RingPlan:
    """Fit the ring into what /dev/shm has free, less ``reserve_bytes`` left for others
    (NCCL and the engine use /dev/shm too): shrink to whole MiB that fit, refuse below
    the minimum."""
    assert requested_bytes > 0 and min_bytes > 0 and reserve_bytes >= 0
    assert free_bytes >= 0 and total_bytes >= free_bytes
    fits = (max(0, free_bytes - reserve_bytes) // MIB) * MIB
    granted = min(requested_bytes, fits)
    if granted < min_bytes:
        raise ShmTooSmall(
            f"the gateway ring needs at least {min_bytes // MIB} MiB (gateway.ring_mb_min) but "
            f"{where} has {free_bytes // MIB} MiB free of {total_bytes // MIB} MiB"
            + (f", {reserve_bytes // MIB} MiB of it kept free (gateway.shm_reserve_mb)" if reserve_bytes else "")
            + f"; {enlarge_hint(requested_bytes + reserve_bytes)}"
        )
    assert min_bytes <= granted <= requested_bytes, (min_bytes, granted, requested_bytes)
    return RingPlan(requested_bytes, granted, free_bytes, total_bytes, reserve_bytes)


def enlarge_hint(requested_bytes: int) -> str:
    gib = max(1, -(-requested_bytes // (1 << 30)) + 1)
    # Not "mount a volume over /dev/shm": engine and gateway would then see different ones.
    return (
        f"To enlarge it: docker run --shm-size={gib}g, or --ipc=host to use the host's /dev/shm "
        f"(Kubernetes: hostIPC: true); on the host, mount -o remount,size={gib}G /dev/shm; "
        "or lower gateway.ring_mb."
    )


def shm_space(directory: Path = SHM_DIR) -> tuple[int, int]:
    """(free bytes, total bytes) of the filesystem holding ``directory``."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize


def segment_path(directory: Path, shm_name: str, pid: int) -> Path:
    return directory / f"{shm_name}.{pid}"


def address_of(view: memoryview) -> int:
    """Address of a writable buffer's first byte (the view itself is left unexported)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class Segment:
    """A mapped shared-memory file; ``view`` is the whole of it as bytes.

    A client's mapping is read-only from ``read_only_from`` on (the RAM tiers),
    except for the spans it has been lent to write values in place, each for
    the time between the gateway lending it and the client committing it.
    """

    def __init__(self, path: Path, fd: int, size: int, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        self.read_only_from = size
        try:
            # Populated at map time: otherwise every first touch of a page (each
            # restore after a restart) pays a page fault in the middle of a copy.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, path: Path, size: int) -> Segment:
        """Create and fully back ``size`` bytes, so a full /dev/shm fails here, not
        later as a SIGBUS in the middle of a copy."""
        assert size > 0 and size % PAGE_BYTES == 0, size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ShmTooSmall(f"cannot reserve {size // MIB} MiB in {path.parent}: {err.strerror}") from None
        return cls(path, fd, size, owner=True)

    @classmethod
    def attach(cls, path: Path, size: int, writable_bytes: int | None = None) -> Segment:
        """Map a gateway's segment; bytes past ``writable_bytes`` (the RAM tiers)
        are made read-only, so a client bug cannot damage stored values."""
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            raise ShmDenied(denied_hint("the gateway's shared memory", path)) from None
        except OSError as err:
            raise ShmUnavailable(
                f"cannot open the gateway's shared memory {path} ({err.strerror}); {SHARE_HINT}"
            ) from None
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise ShmUnavailable(f"shared memory {path} is {actual} bytes, the gateway announced {size}; {SHARE_HINT}")
        segment = cls(path, fd, size, owner=False)
        if writable_bytes is not None and writable_bytes < size:
            assert writable_bytes % PAGE_BYTES == 0, writable_bytes
            segment.read_only_from = writable_bytes
            segment.set_writable([(writable_bytes, size - writable_bytes)], False)
        return segment

    def make_writable(self) -> None:
        """Make the whole mapping writable for good: for a GPU that writes values in
        place by DMA. CUDA pins pages for writing only in a writable mapping, and
        the CPU's page protection would not stop a DMA anyway, so keeping it (and
        opening and closing each lent span) would only cost time."""
        if self.read_only_from < self.size:
            self.set_writable([(self.read_only_from, self.size - self.read_only_from)], True)
            self.read_only_from = self.size

    def set_writable(self, spans: Sequence[tuple[int, int]], writable: bool) -> None:
        """Make the pages under ``spans`` ((offset, length) pairs) writable or read-only
        in this mapping; overlapping and adjacent pages change in one system call.
        Raises `ShmUnavailable` with the kernel's reason (e.g. too many mappings)."""
        pages = sorted(
            (offset // PAGE_BYTES * PAGE_BYTES, -(-(offset + length) // PAGE_BYTES) * PAGE_BYTES)
            for offset, length in spans
        )
        runs: list[list[int]] = []
        for start, end in pages:
            assert 0 <= start < end <= self.size, (start, end, self.size)
            if runs and start <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], end)
            else:
                runs.append([start, end])
        base = address_of(self.view)
        protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        for start, end in runs:
            if _libc.mprotect(ctypes.c_void_p(base + start), ctypes.c_size_t(end - start), protection) != 0:
                errno = ctypes.get_errno()
                state = "writable" if writable else "read-only"
                raise ShmUnavailable(f"cannot make {end - start} bytes of {self.path} {state}: {os.strerror(errno)}")

    def close(self) -> None:
        base = address_of(self.view)
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            # A view of it is still referenced (by objects of a stopped gateway that only
            # the garbage collector will free): the mapping stays until then. The owner
            # gives its pages back now, so that a process that stops gateways and goes
            # on (a test run) does not hold their memory: MADV_REMOVE punches them out
            # of the file, and a stray read sees zeros, never another segment's bytes.
            # A client must not: the pages are the gateway's, shared with every client.
            if self.owner:
                _libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(self.size), MADV_REMOVE)
        if self.owner:
            self.path.unlink(missing_ok=True)


# -- stale segments ----------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mapped_by(path: Path) -> list[int]:
    """Pids of the processes that map ``path`` (read from /proc/*/maps)."""
    # /proc/*/maps names the file by its resolved path.
    target = str(path.resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            with open(entry / "maps") as maps:
                if any(line.rstrip().endswith(target) for line in maps):
                    pids.append(int(entry.name))
        except OSError:
            continue  # Gone, or not ours to read.
    return pids


def _segments(directory: Path, shm_name: str) -> Iterator[tuple[Path, int]]:
    pattern = re.compile(rf"^{re.escape(shm_name)}\.(\d+)$")
    for path in directory.iterdir():
        match = pattern.match(path.name)
        if match:
            yield path, int(match.group(1))


def remove_stale_segments(directory: Path, shm_name: str) -> list[Path]:
    """Unlink segments of dead gateways that no process maps any more.

    A segment still mapped by a live engine is left alone (its memory is in
    use); it goes when that engine exits and a later gateway starts.
    """
    removed = []
    for path, pid in _segments(directory, shm_name):
        if pid == os.getpid() or _pid_alive(pid):
            continue
        users = mapped_by(path)
        if users:
            _log.warning(
                "kvharbor: shared memory %s of dead gateway pid %d is still mapped by pid %s; left in place",
                path, pid, ", ".join(map(str, users)),
            )  # fmt: skip
            continue
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        removed.append(path)
        _log.warning("kvharbor: removed stale shared memory %s (%d MiB) left by gateway pid %d", path, size // MIB, pid)
    return removed
