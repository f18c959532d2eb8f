"""Reading one file into memory at the page cache's speed or the disk's, consumed as it lands.

A file tier's get copies the file into the caller's buffer and checksums it. Done in one
thread, one after the other, the hash (~16 GB/s here) adds to the kernel's copy (~10 GB/s
from the page cache): a 32 MiB value then reads at ~6 GB/s. Here I/O threads read the file in
chunks (`kvharbor.hal.block.pipeline.chunk_plan`: small first and last chunks, 4 MiB
between) while the caller's thread consumes (hashes) the chunks before: ``preadv`` lets go of
the GIL, and so does xxhash's streaming update, so the two overlap and the read goes at the
copy's speed. The chunks are claimed in file order by whichever thread is free, the caller's
included while it has nothing landed to consume (`_Claims`); the pool's threads bound how
many other threads read at once.

A consumer that takes a value in pieces (`kvharbor.hal.base.PieceConsumer`: the cache's
checksum of 1 MiB segments, `kvharbor.hal.checksum`) is read in its pieces instead, each
taken by the I/O thread that read it while the piece is still in that core's cache: reading
and hashing then run on every I/O thread at once, where the in-order hash of one caller's
thread could only run beside them (measured on two cores: ~0.7x of a bare ``read`` in order,
about 1x in pieces).

Cold reads (`ReadPlan.cold_direct`): a file whose first chunk is not in the page cache (a
``preadv2`` with ``RWF_NOWAIT`` says so without waiting for the disk) is read with O_DIRECT,
from the disk straight into the caller's buffer, skipping the copy through the page cache,
where the buffer's address allows it (the gateway's shared segment is page-aligned) and the
filesystem takes O_DIRECT. Its last partial block is read buffered. The direct descriptor is
opened through ``/proc/self/fd``, so it reads the very file the buffered one has open (one
version of the value, even while a put renames a new one over it). A filesystem that refuses
O_DIRECT, at the open or at the first read (EINVAL: tmpfs on older kernels, some FUSE and
network filesystems), is read buffered instead, seamlessly (a chunk refused is read again
buffered, in the same I/O thread), and `ReadResult.refused` tells the caller, who stops asking
for O_DIRECT and says so once. Whether O_DIRECT is faster depends on the disk: on these VMs
neither wins clearly (bench/store.py measures both), so it is a setting, off by default
(``storage.tiers[].cold_reads_direct``).

Contract: every chunk's read has finished when `read_file` returns or raises, so the caller
may reuse its buffer at once; ``consume`` sees consecutive slices of at most ``slice_bytes``,
in order, covering what was read exactly once, and only bytes that a read has filled; or, a
`PieceConsumer`, each of its pieces that a read filled whole, once, from any thread.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvharbor.hal.base import PieceConsumer, SliceConsumer
from kvharbor.hal.block.direct import address, dio_memory_alignment
from kvharbor.hal.block.layout import BLOCK_BYTES
from kvharbor.hal.block.pipeline import chunk_plan
from kvharbor.hal.posix import read_into

READ_THREADS = 2
"""I/O threads per file device (``pool`` of `read_file`), each reading beside the caller's
thread, which reads too: three reads in flight per get, on two cores one thread's copy or hash
beside another's while the third waits for the GIL or the disk."""


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """How `read_file` reads one file."""

    size_bytes: int
    """The file's size (its ``fstat`` through the descriptor that reads it)."""
    cold_direct: bool
    """Read the file with O_DIRECT when its first chunk is not in the page cache."""
    slice_bytes: int
    """The most ``consume`` is handed at once."""


@dataclass(frozen=True, slots=True)
class ReadResult:
    nbytes: int
    """Bytes read: the size, or less when the file ended early (it shrank: the caller says so)."""
    direct: bool
    """O_DIRECT read the file's whole blocks."""
    refused: bool
    """The filesystem refused O_DIRECT (EINVAL at the open or at a read): read buffered."""


def read_file(
    pool: ThreadPoolExecutor, fd: int, into: memoryview, plan: ReadPlan, consume: SliceConsumer | None
) -> ReadResult:
    """Read the file open as ``fd`` into ``into[:plan.size_bytes]``, handing what lands to
    ``consume`` as soon as it holds its bytes (see the module docstring). OSError as the
    reads raise it."""
    size = plan.size_bytes
    assert into.nbytes >= size and plan.slice_bytes > 0, (into.nbytes, size, plan.slice_bytes)
    whole = size // BLOCK_BYTES * BLOCK_BYTES
    handout = _Handout(into, consume, plan.slice_bytes)
    chunks = handout.chunks(size, whole)
    if len(chunks) <= 1 or (handout.pieces is not None and len(chunks) <= 2):  # Nothing to overlap.
        got = read_into(fd, into[:size])
        for lo, hi in chunks:
            handout.read(lo, min(hi, got))
        handout.landed(0, got)
        return ReadResult(got, False, False)
    # Read whole and in order: the kernel's readahead for a cold file doubles its window.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    head_hi = chunks[0][1]
    if not plan.cold_direct or whole == 0:
        return _pipelined(pool, fd, None, chunks, handout, whole)
    if _cached(fd, into[:head_hi]):
        handout.read(0, head_hi)
        handout.landed(0, head_hi)
        return _pipelined(pool, fd, None, chunks[1:], handout, whole)
    if into.readonly or address(into) % dio_memory_alignment(fd):
        # The buffer's address does not allow O_DIRECT: buffered, quietly (not the filesystem's doing).
        return _pipelined(pool, fd, None, chunks, handout, whole)
    try:
        # Through /proc/self/fd: the very file ``fd`` reads, whatever was renamed over its name since.
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        result = _pipelined(pool, fd, None, chunks, handout, whole)
        return ReadResult(result.nbytes, False, True)
    try:
        return _pipelined(pool, fd, direct, chunks, handout, whole)
    finally:
        os.close(direct)


class _Handout:
    """Where the bytes read go. A `PieceConsumer` takes each piece in the thread that read
    it (`read`), so that the I/O threads also hash what they read, side by side; any other
    consumer is handed slices of at most ``slice_bytes``, in order, in the caller's thread
    (`landed`)."""

    __slots__ = ("consume", "into", "pieces", "slice_bytes")

    def __init__(self, into: memoryview, consume: SliceConsumer | None, slice_bytes: int) -> None:
        self.into = into
        self.consume = consume
        self.slice_bytes = slice_bytes
        self.pieces = consume if isinstance(consume, PieceConsumer) else None

    def chunks(self, size: int, whole: int) -> list[tuple[int, int]]:
        """The chunks the file is read in: the consumer's pieces, or `chunk_plan`'s chunks
        of the file's ``whole`` blocks and the partial block after them."""
        if self.pieces is None:
            return [*chunk_plan(0, whole), *([(whole, size)] if size > whole else [])]
        base, step = self.pieces.piece_base, self.pieces.piece_bytes
        assert base % BLOCK_BYTES == 0 and step % BLOCK_BYTES == 0 and step > 0, (base, step)
        return [(0, min(base, size)), *((lo, min(lo + step, size)) for lo in range(base, size, step))]

    def read(self, lo: int, hi: int) -> None:
        """The chunk ``[lo, hi)`` was read whole (by the calling thread)."""
        if self.pieces is not None and hi > lo:
            self.pieces.take(lo, self.into[lo:hi])

    def landed(self, lo: int, hi: int) -> int:
        """``[lo, hi)`` holds its bytes, every byte before it handed out; returns ``hi``."""
        if self.pieces is None and self.consume is not None:
            for a in range(lo, hi, self.slice_bytes):
                self.consume(self.into[a : min(a + self.slice_bytes, hi)])
        return hi


def _cached(fd: int, head: memoryview) -> bool:
    """Read ``head`` (the file's first chunk) only if the page cache holds it all; whether it
    did. A filesystem without ``RWF_NOWAIT`` for reads says EOPNOTSUPP: taken as cached (read
    buffered)."""
    try:
        return bool(os.preadv(fd, [head], 0, os.RWF_NOWAIT) == head.nbytes)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno == errno.EOPNOTSUPP:
            return True
        raise


def _pipelined(
    pool: ThreadPoolExecutor,
    fd: int,
    direct: int | None,
    chunks: list[tuple[int, int]],
    handout: _Handout,
    whole: int,
) -> ReadResult:
    """Read ``chunks`` of the file, each claimed in order by whichever thread is free (the
    pool's and the caller's: see `_Claims`) and handed out once it landed; the chunks within
    the file's ``whole`` blocks through ``direct`` where it is given (one it refuses, with
    EINVAL, through ``fd``)."""
    refused = threading.Event()
    into = handout.into

    def fill(lo: int, hi: int) -> int:
        if direct is not None and hi <= whole and not refused.is_set():
            try:
                return read_into(direct, into[lo:hi], lo)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                refused.set()  # A buffered read never answers EINVAL for a valid range.
        return read_into(fd, into[lo:hi], lo)

    def read_chunk(index: int) -> int:
        lo, hi = chunks[index]
        n = fill(lo, hi)
        if n == hi - lo:
            handout.read(lo, hi)
        return n

    claims = _Claims(len(chunks), read_chunk)
    helpers = [pool.submit(claims.work) for _ in range(min(READ_THREADS, len(chunks) - 1))]
    got = chunks[0][0]
    try:
        for index, (lo, hi) in enumerate(chunks):
            n = claims.result(index)
            got = handout.landed(lo, lo + n)
            if n != hi - lo:
                break  # The file ended early; the caller says so.
    finally:
        claims.stop()
        for helper in helpers:
            if not helper.cancel():
                helper.exception()  # Every chunk finishes before ``into`` is the caller's again.
    return ReadResult(got, direct is not None and not refused.is_set(), refused.is_set())


class _Claims:
    """The chunks of one read, claimed in order by whichever thread is free.

    Why not one pool task per chunk: on two cores a 32 MiB read from the page cache in 33
    pieces then spent more on the tasks (a future each, the caller woken per chunk while it
    had nothing to do) than on the copies: ~0.85x of a bare ``read`` at the median where
    threads that take the next chunk themselves, the caller one of them, run at ~1.2x. The
    pool's threads still bound how many reads a device has in flight, and the caller reads
    too while it waits, so a read finishes even while other reads hold every pool thread.
    Reads are claimed in file order, as the kernel's readahead expects.
    """

    __slots__ = ("_changed", "_claimed", "_outcomes", "_read")

    def __init__(self, count: int, read: Callable[[int], int]) -> None:
        self._read = read
        self._claimed = 0
        self._outcomes: list[int | BaseException | None] = [None] * count
        self._changed = threading.Condition()

    def work(self) -> None:
        """Read chunks until none is left to claim (a pool thread's task)."""
        while (index := self._claim()) is not None:
            self._run(index)

    def result(self, index: int) -> int:
        """Chunk ``index``'s byte count once it is read, reading other chunks meanwhile;
        raises what its read raised."""
        while True:
            with self._changed:
                outcome = self._outcomes[index]
            if outcome is not None:
                break
            claimed = self._claim()
            if claimed is not None:
                self._run(claimed)
                continue
            with self._changed:
                self._changed.wait_for(lambda: self._outcomes[index] is not None)
                outcome = self._outcomes[index]
            break
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, int), outcome
        return outcome

    def stop(self) -> None:
        """Leave the chunks not claimed yet unread."""
        with self._changed:
            self._claimed = len(self._outcomes)

    def _claim(self) -> int | None:
        with self._changed:
            if self._claimed == len(self._outcomes):
                return None
            self._claimed += 1
            return self._claimed - 1

    def _run(self, index: int) -> None:
        try:
            outcome: int | BaseException = self._read(index)
        except BaseException as err:
            # Raised in the caller's thread, by `result`; recorded first whatever it is, so
            # that no thread waits on this chunk for ever.
            self._record(index, err)
            if not isinstance(err, Exception):
                raise  # KeyboardInterrupt, SystemExit: on their way out of this thread now.
            return
        self._record(index, outcome)

    def _record(self, index: int, outcome: int | BaseException) -> None:
        with self._changed:
            self._outcomes[index] = outcome
            self._changed.notify_all()
