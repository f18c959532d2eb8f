"""File tier reads: pipelined chunks consumed in order, O_DIRECT for cold files where it is
asked for, and a clean fallback where the filesystem refuses O_DIRECT.

This kernel's tmpfs and ext4 both take O_DIRECT, so a refusal is injected where the kernel
would answer it: EINVAL from ``open`` or from an aligned ``preadv`` of the direct descriptor."""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.manifest import open_manifest
from kvharbor.cache.tier import Tier
from kvharbor.config import validate_config
from kvharbor.hal.base import DeviceUnavailable
from kvharbor.hal.block.direct import address
from kvharbor.hal.file import FileDevice, open_file_device

KEY = bytes.fromhex("abcd" + "11" * 14)
VALUE_BYTES = 3 * (1 << 20) + 123  # Several chunks, the last a partial block.
SLICE_BYTES = 100_000
FINGERPRINT = LayoutFingerprint(model_id="test/file-reads", chunk_size=16).digest()


def aligned(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))


def value() -> bytes:
    return os.urandom(VALUE_BYTES)


def object_path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[0:2] / name[2:4] / name


def drop_cached(path: Path) -> None:
    """Drop ``path``'s (clean: fsynced) pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class DirectOpens:
    """Watches ``os.open`` for O_DIRECT (optionally answering it EINVAL, as a filesystem that
    refuses it does), and ``os.preadv`` of those descriptors (optionally EINVAL too).

    ``cold``: a ``RWF_NOWAIT`` read (the tier's "is it cached?") is answered EAGAIN, as the
    kernel answers it for a file not in the page cache. The tests drop the file's pages
    for real too, but this VM's kernel was seen keeping them through ``DONTNEED`` now and
    then, and the probe itself starts a readahead that caches them again."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, refuse_open: bool = False, refuse_read: bool = False, cold: bool = False
    ) -> None:
        self.opened = 0
        self.direct_fds: set[int] = set()
        self.direct_reads = 0
        real_open, real_preadv = os.open, os.preadv

        def watched_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_DIRECT:
                self.opened += 1
                if refuse_open:
                    raise OSError(errno.EINVAL, "Invalid argument")
                fd = real_open(path, flags, *args, **kwargs)
                self.direct_fds.add(fd)
                return fd
            return real_open(path, flags, *args, **kwargs)

        def watched_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            if cold and flags and flags[0] & os.RWF_NOWAIT:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            if fd in self.direct_fds:
                self.direct_reads += 1
                if refuse_read:
                    raise OSError(errno.EINVAL, "Invalid argument")
            return real_preadv(fd, buffers, offset, *flags)

        monkeypatch.setattr(os, "open", watched_open)
        monkeypatch.setattr(os, "preadv", watched_preadv)


@pytest.fixture
def device(tmp_path: Path) -> Iterator[FileDevice]:
    made = FileDevice("local", str(tmp_path / "tier"), 1 << 23, cold_reads_direct=True)
    yield made
    made.close()


def stored_cold(device: FileDevice, data: bytes) -> None:
    device.put(KEY, [data])
    drop_cached(object_path(Path(device.root), KEY))


class Pieces:
    """A `PieceConsumer` that records what it is given, and by which thread."""

    piece_base = HEADER_BYTES
    piece_bytes = 1 << 20

    def __init__(self) -> None:
        self.taken: dict[int, bytes] = {}
        self.takers: dict[int, int] = {}
        """The thread that took each piece, by its offset."""

    def __call__(self, data: memoryview) -> None:
        raise AssertionError("a consumer of pieces was handed an in-order slice")

    def take_digest(self, offset: int, nbytes: int, digest: int) -> None:
        raise AssertionError("the file driver hashes nothing itself: it hands pieces")

    def take(self, offset: int, data: memoryview) -> None:
        assert offset not in self.taken, f"piece {offset} taken twice"
        self.taken[offset] = bytes(data)
        self.takers[offset] = threading.get_ident()

    def joined(self, nbytes: int) -> bytes:
        """The pieces' bytes, after checking they are exactly the pieces of ``nbytes``."""
        bounds = [0, *range(self.piece_base, nbytes, self.piece_bytes), nbytes]
        assert sorted(self.taken) == bounds[:-1]
        assert [len(self.taken[lo]) for lo in bounds[:-1]] == [hi - lo for lo, hi in itertools.pairwise(bounds)]
        return b"".join(self.taken[lo] for lo in bounds[:-1])


class Reads:
    """Records, while active, which thread read each range of a file (``os.preadv``)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int]] = []
        self._real = os.preadv

    def __enter__(self) -> Reads:
        def recorded(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            n = self._real(fd, buffers, offset, *flags)
            self.ranges.append((offset, offset + n, threading.get_ident()))
            return n

        os.preadv = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv = self._real

    def reader(self, offset: int) -> int | None:
        """The thread that last read the byte at ``offset``."""
        return next((thread for lo, hi, thread in reversed(self.ranges) if lo <= offset < hi), None)


@pytest.fixture(params=["slices", "pieces"])
def handout(request: pytest.FixtureRequest) -> str:
    """How a read hands its bytes out: in order in bounded slices, or in a consumer's pieces."""
    return str(request.param)


def streamed(device: FileDevice, into: memoryview, handout: str) -> bytes:
    """The value read by ``get_streamed``, after checking how it was handed out."""
    if handout == "pieces":
        pieces = Pieces()
        with Reads() as reads:
            assert device.get_streamed(KEY, into, pieces, SLICE_BYTES) == VALUE_BYTES
        for offset, taker in pieces.takers.items():
            assert reads.reader(offset) == taker, f"piece {offset} taken by the thread that read it"
        return pieces.joined(VALUE_BYTES)
    slices: list[bytes] = []
    assert device.get_streamed(KEY, into, lambda piece: slices.append(bytes(piece)), SLICE_BYTES) == VALUE_BYTES
    assert max(map(len, slices)) <= SLICE_BYTES and len(slices) > VALUE_BYTES // SLICE_BYTES
    return b"".join(slices)


def test_a_streamed_read_hands_out_every_byte_once(device: FileDevice, handout: str) -> None:
    device.cold_reads_direct = False
    data = value()
    device.put(KEY, [data])
    into = aligned(VALUE_BYTES)
    assert streamed(device, into, handout) == data and bytes(into) == data


def test_a_read_error_is_raised_once_every_read_of_the_value_has_ended(
    device: FileDevice, monkeypatch: pytest.MonkeyPatch, handout: str
) -> None:
    """EIO on the chunk in the middle of a value: the get raises it, naming the tier and the
    path, and only once no thread reads into the caller's buffer any more."""
    device.cold_reads_direct = False
    device.put(KEY, [value()])
    middle = VALUE_BYTES // 2
    lock = threading.Lock()
    reading = 0
    failed = threading.Event()
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        nonlocal reading
        with lock:
            reading += 1
        try:
            if offset <= middle < offset + sum(memoryview(b).nbytes for b in buffers) and not failed.is_set():
                failed.set()
                raise OSError(errno.EIO, "Input/output error")
            return real_preadv(fd, buffers, offset, *flags)
        finally:
            with lock:
                reading -= 1

    monkeypatch.setattr(os, "preadv", preadv)
    consume: Any = Pieces() if handout == "pieces" else (lambda piece: None)
    with pytest.raises(DeviceUnavailable, match=r"get .*Input/output error") as raised:
        device.get_streamed(KEY, aligned(VALUE_BYTES), consume, SLICE_BYTES)
    assert failed.is_set() and raised.value.device == "local"
    with lock:
        assert reading == 0, "a read still ran into the buffer after the get returned"


@pytest.mark.parametrize("nbytes", [0, 100, HEADER_BYTES, HEADER_BYTES + 1, HEADER_BYTES + (1 << 20)])
def test_a_small_value_read_in_one_go_is_handed_out_in_its_pieces(device: FileDevice, nbytes: int) -> None:
    data = os.urandom(nbytes)
    device.put(KEY, [data])
    pieces = Pieces()
    assert device.get_streamed(KEY, aligned(max(nbytes, 1)), pieces) == nbytes
    if nbytes:
        assert pieces.joined(nbytes) == data
    else:
        assert pieces.taken == {}


def test_a_cold_file_is_read_with_o_direct(device: FileDevice, monkeypatch: pytest.MonkeyPatch, handout: str) -> None:
    data = value()
    stored_cold(device, data)
    opens = DirectOpens(monkeypatch, cold=True)
    assert streamed(device, aligned(VALUE_BYTES), handout) == data
    assert opens.opened == 1 and opens.direct_reads >= 1
    drop_cached(object_path(Path(device.root), KEY))
    whole = aligned(VALUE_BYTES)
    assert device.get(KEY, whole) == VALUE_BYTES and bytes(whole) == data  # A plain get too.
    assert opens.opened == 2


def test_a_warm_file_is_read_through_the_page_cache(
    device: FileDevice, monkeypatch: pytest.MonkeyPatch, handout: str
) -> None:
    data = value()
    device.put(KEY, [data])  # Just written: its pages are cached.
    opens = DirectOpens(monkeypatch)
    assert streamed(device, aligned(VALUE_BYTES), handout) == data
    assert opens.opened == 0


def test_a_buffer_off_a_page_edge_is_read_buffered(
    device: FileDevice, monkeypatch: pytest.MonkeyPatch, handout: str
) -> None:
    data = value()
    stored_cold(device, data)
    opens = DirectOpens(monkeypatch, cold=True)
    into = aligned(VALUE_BYTES + 1)[1:]  # O_DIRECT cannot read to this address.
    assert streamed(device, into, handout) == data
    assert opens.opened == 0 and device.cold_reads_direct, "no judgement of the filesystem"


@pytest.mark.parametrize("where", ["open", "read"])
def test_a_filesystem_refusing_o_direct_gets_buffered_reads_said_once(
    device: FileDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str, handout: str
) -> None:
    data = value()
    stored_cold(device, data)
    opens = DirectOpens(monkeypatch, refuse_open=where == "open", refuse_read=where == "read", cold=True)
    with caplog.at_level(logging.WARNING):
        assert streamed(device, aligned(VALUE_BYTES), handout) == data, "every byte once, as if nothing happened"
        assert not device.cold_reads_direct
        drop_cached(object_path(Path(device.root), KEY))
        assert streamed(device, aligned(VALUE_BYTES), handout) == data
    assert opens.opened == 1, "not asked again"
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"kvharbor: tier 'local': the filesystem of {device.root} refuses O_DIRECT; cold reads are buffered"
    ]


def test_the_setting_reaches_the_device(tmp_path: Path) -> None:
    config = validate_config(
        {
            "storage": {
                "tiers": [
                    {
                        "name": "local",
                        "type": "file",
                        "path": str(tmp_path),
                        "capacity_gb": 1,
                        "cold_reads_direct": True,
                    }
                ]
            }
        }
    )
    made = open_file_device(config.storage.tiers[0], 1 << 20)  # type: ignore[arg-type]
    try:
        assert made.cold_reads_direct
    finally:
        made.close()


# -- writes -------------------------------------------------------------------


class DirectWrites:
    """Counts writes made while the descriptor has O_DIRECT set (optionally answering them
    EINVAL, as a filesystem that refuses O_DIRECT does)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse: bool = False) -> None:
        self.direct = 0
        real_pwritev = os.pwritev

        def watched_pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                self.direct += 1
                if refuse:
                    raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwritev(fd, buffers, offset, *flags)

        monkeypatch.setattr(os, "pwritev", watched_pwritev)


def header_and_payload() -> tuple[bytes, memoryview]:
    """An object's parts as a tier writes them: a page of header, the payload page-aligned."""
    payload = aligned(VALUE_BYTES)
    payload[:] = value()
    return os.urandom(4096), payload


def test_a_direct_write_stores_every_byte(device: FileDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    device.direct_writes = True
    head, payload = header_and_payload()
    writes = DirectWrites(monkeypatch)
    device.put(KEY, [head, payload])
    assert writes.direct >= 2  # The header's page and the payload's whole blocks.
    stored = object_path(Path(device.root), KEY).read_bytes()
    assert stored == head + bytes(payload)
    # One byte past a page edge whatever the allocator returns: written buffered.
    unaligned = aligned(len(payload) + 1)[1:]
    unaligned[:] = payload
    writes.direct = 0
    device.put(KEY, [head, unaligned])
    assert writes.direct == 0 and object_path(Path(device.root), KEY).read_bytes() == stored


def test_a_filesystem_refusing_direct_writes_gets_buffered_ones_said_once(
    device: FileDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device.direct_writes = True
    head, payload = header_and_payload()
    writes = DirectWrites(monkeypatch, refuse=True)
    with caplog.at_level(logging.WARNING):
        device.put(KEY, [head, payload])
        device.put(KEY, [head, payload])
    assert object_path(Path(device.root), KEY).read_bytes() == head + bytes(payload)
    assert writes.direct == 1 and not device.direct_writes, "not asked again"
    assert [r.getMessage() for r in caplog.records] == [
        f"kvharbor: tier 'local': the filesystem of {device.root} refuses O_DIRECT; writes are buffered"
    ]


def test_a_value_read_into_page_aligned_memory_lies_page_aligned(tmp_path: Path) -> None:
    """What format 2 is for: the payload a page into the object, so the engine's copy (and
    O_DIRECT) find it on a page edge in the gateway's segment."""
    made = FileDevice("local", str(tmp_path / "tier"), 1 << 23)
    tier = Tier("local", made, open_manifest(made, "local"), 1 << 26, CircuitBreaker(BreakerSettings()))
    try:
        data = value()
        assert tier.write(KEY, FINGERPRINT, data)
        landing = aligned(VALUE_BYTES + HEADER_BYTES)
        got = tier.read(KEY, FINGERPRINT, lambda nbytes: landing[:nbytes])
        assert got is not None and bytes(got) == data
        assert address(got) % mmap.PAGESIZE == 0
        fresh = tier.read(KEY, FINGERPRINT)  # Into the tier's own buffer: aligned as well.
        assert fresh is not None and address(fresh) % mmap.PAGESIZE == 0
    finally:
        tier.close()
