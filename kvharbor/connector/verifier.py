"""Reading stored chunks back before they are promised to the engine, behind its scheduler.

A lookup answers from the gateway's indexes. What it finds in a shared-memory
RAM tier was verified where readers see it and nobody but the gateway can
change it (`LookupOk.resident`): that is promised as it is. What it finds only
on a tier that outlives the gateway (files) may have been damaged at rest; an
engine told it holds such a chunk counts it as cached, whether or not its load
then succeeds. So those chunks are read back in full first (`CacheLink.verify`,
which also promotes them into a RAM tier above, where the load then finds
them), and only the intact leading ones are promised.

The read-back runs on its own thread and gateway connection: the scheduler
keeps scheduling other requests meanwhile and asks again each step
(`Verification.settle`). It is bounded: past its deadline, what is verified by
then is promised and the rest is recomputed. Each read-back's bytes and seconds go to
its submitter (the load planner learns the read-back rate from them: a tier slower than
recomputing is then not read from).

A chunk that fails ends the verified prefix, and the chunks behind it are
dropped as well: keys are prefix-chained, so nothing reaches them until that
chunk is stored again, and the request that recomputes them stores only what
is absent. Dropping them is what lets that request store them all anew.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvharbor.connector.link import CacheLink
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.connector")

CHUNKS_PER_VERIFY = 8
"""Chunks read back per gateway request: the verified prefix grows (and can be promised at
the deadline) request by request, at one round trip per 8 chunk reads."""


@dataclass(slots=True)
class Verification:
    """One request's read-back of chunks ``first .. end``, of the chunks stored from ``first``.

    Written by the verifier's thread, read by the scheduler's: ``verified`` only
    grows, and `settle` freezes the outcome (under ``lock``, which the verifier
    holds while it drops chunks).
    """

    items: list[list[tuple[bytes, bytes]]]
    """Per chunk stored from ``first`` on, the (fingerprint, key) of every rank."""
    first: int
    """Chunks before it are known good (resident), or not to be loaded (vLLM holds them)."""
    end: int
    """Chunks from ``first`` up to here are read back (a load needs no more)."""
    deadline: float
    """`time.monotonic` past which the unverified rest is not promised."""
    verified: int = 0
    """Leading chunks from ``first`` read back intact so far."""
    failed: bool = False
    """A chunk failed: it and every stored chunk behind it were dropped."""
    settled: bool = False
    timed: Callable[[int, float], None] | None = None
    """Told the read-back's bytes and seconds when it ends (`Verifier.submit`)."""
    proceed: Callable[[int, float], bool] | None = None
    """Asked before each request after the first, with the chunks read back so far and the
    seconds that took: whether reading the rest is still faster than recomputing it."""
    cut: bool = False
    """``proceed`` said no: the chunks after ``verified`` were left unread (still stored)."""
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def settle(self, now: float) -> bool:
        """Is the outcome known: finished, or past the deadline (it then stops where it is)?"""
        if self.settled:
            return True
        if not self.done.is_set() and now < self.deadline:
            return False
        with self.lock:
            self.settled = True
        return True

    @property
    def good_chunks(self) -> int:
        """Leading chunks known intact: those before ``first`` and those verified."""
        return self.first + self.verified


class Verifier:
    """Reads chunks back on its own thread and link (see the module docstring)."""

    def __init__(self, link: CacheLink, fingerprints: Sequence[bytes], value_bytes: int) -> None:
        self.link = link
        self.fingerprints = tuple(fingerprints)
        self.value_bytes = value_bytes
        """The size of each rank's value of a chunk (0: not checked)."""
        self._jobs: queue.SimpleQueue[Verification | None] = queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvharbor-verifier", daemon=True)
        self._thread.start()

    def submit(
        self,
        keys: Sequence[Sequence[bytes]],
        first: int,
        end: int,
        stored: int,
        wait_s: float,
        timed: Callable[[int, float], None] | None = None,
        proceed: Callable[[int, float], bool] | None = None,
    ) -> Verification:
        """Read back chunks ``first .. end`` of ``keys`` (one list per rank); when one fails,
        it and every chunk behind it up to ``stored`` are dropped. Returns at once. ``timed``
        is told, from the verifier's thread, the bytes read back intact (every rank's values)
        and the seconds that took, when the read-back ends (not where ``value_bytes`` is 0);
        ``proceed`` may stop it early (`Verification.proceed`)."""
        assert 0 <= first < end <= stored <= len(keys[0]), (first, end, stored, len(keys[0]))
        items = [[(f, bytes(k[chunk])) for f, k in zip(self.fingerprints, keys, strict=True)]
                 for chunk in range(first, stored)]  # fmt: skip
        job = Verification(items, first, end, time.monotonic() + wait_s, timed=timed, proceed=proceed)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Stop: the read-back under way ends after its current request (bounded by
        ``gateway.request_timeout_ms``); those still queued are not started."""
        self._closing = True
        self._jobs.put(None)
        self._thread.join()
        self.link.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._verify(job)
            finally:
                job.done.set()

    def _verify(self, job: Verification) -> None:
        started, read = time.perf_counter(), 0
        try:
            read = self._read_back(job, started)
        finally:
            if job.timed is not None and read and self.value_bytes:
                job.timed(read * self.value_bytes, time.perf_counter() - started)

    def _read_back(self, job: Verification, started: float) -> int:
        """Read ``job``'s chunks back, request by request; the values read back intact (of
        every rank: a failed one ends the read-back, and weighs little in the rate)."""
        ranks = len(self.fingerprints)
        wanted = job.end - job.first
        read = 0
        for start in range(0, wanted, CHUNKS_PER_VERIFY):
            if job.settled or self._closing:
                break  # Past its deadline, or shutting down: nobody waits for the rest.
            if start and job.proceed is not None and not job.proceed(job.verified, time.perf_counter() - started):
                job.cut = True  # The rest arrives slower than it recomputes: left stored, unread.
                break
            part = job.items[start : min(start + CHUNKS_PER_VERIFY, wanted)]
            answer = self.link.verify([item for chunk in part for item in chunk], self.value_bytes)
            if answer is None:
                break  # No answer (the link said why): what is verified so far is all there is.
            intact = answer // ranks
            read += answer
            job.verified = start + intact
            if intact < len(part):
                self._drop_behind(job)
                break
        return read

    def _drop_behind(self, job: Verification) -> None:
        """Drop every stored chunk from the one that failed (the gateway has dropped that
        one if it was damaged; one rank's copy may be intact), unless the promise was
        made meanwhile: the request may be storing them anew by then."""
        with job.lock:
            if job.settled:
                return
            job.failed = True
            behind = job.items[job.verified :]
            self.link.drop([key for chunk in behind for _, key in chunk])
        _log.debug("kvharbor: chunk %d failed its read-back; it and %d behind it dropped",
                   job.good_chunks, len(behind) - 1)  # fmt: skip
