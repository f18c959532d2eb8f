"""The client side of the gateway protocol: one connection, one mapped segment.

Transfers are two-phase, so KV bytes are copied exactly once on each side of
the shared memory:

- put: `prepare_put` reserves room and returns writable views; the caller
  copies its values into them, marks each one complete (`PutBatch.mark`) once
  its bytes are all there, and `commit_put` stores them. Should this process
  die before the commit, the gateway stores the values marked complete and
  only those. The room may be the value's final place in a RAM tier, in the
  part of the segment this client maps read-only: it is writable from
  `prepare_put` to `commit_put` only.
- get: `get` returns read views of the leading hits; the caller copies them
  out; `release` gives the room back.

Every failure raises a `GatewayError`; deciding what a failure means for the
engine (turn the cache off on this rank) is the connector's job.

Restart rule: **the client never reconnects.** Once a call finds the gateway
gone, hung past ``gateway.request_timeout_ms`` or talking nonsense
(`GatewayUnavailable`), this client is down for good: every later call raises
`GatewayUnavailable` at once, without touching the socket, so the connector
keeps the external cache off on that rank until the engine restarts. A
gateway restart therefore needs an engine restart too: stop the engine, then
the gateway; start the gateway, then the engine. Reconnecting is not safe:

- the new gateway has a new segment, so every view the engine still holds
  into the old one would silently point at memory nobody reads;
- a transfer cut off by the failure cannot be told apart from a new one, and
  a put replayed against the new gateway could store half-written bytes;
- the new gateway may be another release, and the handshake is the only
  place a mismatch is caught.

A refusal (`GatewayRefused`: a request the gateway judged bad, or BUSY) is
not a failure of the gateway: the connection stays usable.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kvharbor import __version__
from kvharbor.cache.keys import NAMESPACE_UNKNOWN, LayoutFingerprint
from kvharbor.cache.purge import PurgeFilter, PurgeReport
from kvharbor.config import GatewaySection
from kvharbor.gateway import protocol as p
from kvharbor.gateway.access import denied_hint, peer_of
from kvharbor.gateway.shm import Segment, ShmDenied, ShmUnavailable
from kvharbor.gateway.silence import describe_silence
from kvharbor.gateway.status import GatewayStatus
from kvharbor.gateway.wire import FrameReader, PeerClosed, send_message
from kvharbor.hal.base import Buffer
from kvharbor.hal.checksum import copy_with_checksum

_Reply = TypeVar("_Reply", bound=p.Message)
_TIMEVAL = struct.Struct("@ll")


def _kernel_timeouts(sock: socket.socket, timeout_ms: int) -> None:
    """Bound each send and receive in the kernel (SO_SNDTIMEO, SO_RCVTIMEO) on a blocking
    socket. Python's own socket timeouts poll() before every call: two system calls
    per send and per receive instead of one, on the path of every small request.
    An expired timeout surfaces as `BlockingIOError`."""
    assert timeout_ms > 0
    timeval = _TIMEVAL.pack(timeout_ms // 1000, (timeout_ms % 1000) * 1000)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class GatewayError(Exception):
    """The gateway cannot serve this client (gone, hung, refused, incompatible)."""


class GatewayUnavailable(GatewayError):
    """The gateway is gone, hung, unreachable or incoherent; the client is down for good."""


class GatewayNotRunning(GatewayUnavailable):
    """Nothing listens on the socket: the only case in which embedded mode starts a gateway."""


class VersionMismatch(GatewayError):
    pass


class GatewaySteppingAside(GatewayUnavailable):
    """An idle embedded gateway that cannot serve this client exits instead (see
    `kvharbor.gateway.lifetime`); once it has, a new one can be started."""

    def __init__(self, text: str, gateway_pid: int) -> None:
        super().__init__(f"STEPPING_ASIDE: {text}")
        self.gateway_pid = gateway_pid
        """The exiting gateway, from the socket's peer credentials; 0 if not visible here."""


class ConfigMismatch(GatewayError):
    """The gateway serves another storage or card config (``CONFIG_MISMATCH``)."""


class AccessDenied(GatewayUnavailable):
    """This process's user may not use the gateway: the kernel refused the socket or the
    segment (EACCES), or the gateway's ``gateway.access`` refused it (``ACCESS_DENIED``)."""


_REFUSED_HELLO: dict[p.ErrorCode, type[GatewayError]] = {
    p.ErrorCode.VERSION_MISMATCH: VersionMismatch,
    p.ErrorCode.CONFIG_MISMATCH: ConfigMismatch,
    p.ErrorCode.ACCESS_DENIED: AccessDenied,
}
"""A refused handshake whose reason is a class of its own; its message starts with the code."""


class GatewayRefused(GatewayError):
    """The gateway answered a request with an error; ``code`` says which."""

    def __init__(self, code: p.ErrorCode, text: str) -> None:
        super().__init__(f"{code.name}: {text}")
        self.code = code


@dataclass(frozen=True, slots=True)
class PutBatch:
    batch: int
    views: list[memoryview | None]
    """Where to copy each value; None: skip it (already stored, or no room)."""
    in_place: list[tuple[int, int]]
    """(offset, length) of the views that lie in a RAM tier, writable until the commit."""
    checksums: list[int | None] = field(default_factory=list)
    """Per view, the checksum of what `write` copied into it, or None."""
    marks: memoryview | None = None
    """The batch's completion marks (see `protocol.write_mark`); None when nothing was lent."""
    offsets: list[int] = field(default_factory=list)
    """Per view, its offset in the segment (`protocol.SKIP` for a skipped value)."""
    no_room: int = 0
    """Of the skipped values, those the gateway had no room for (the others are stored)."""

    def write(self, index: int, value: Buffer) -> None:
        """Copy ``value`` into view ``index``, keep its checksum (taken during the copy)
        for the commit, and mark it complete: the gateway then need not read the value
        again. Filling a view any other way is fine too (then `mark` it); the gateway
        takes the checksums itself unless every view was filled with `write`."""
        view = self.views[index]
        assert view is not None, f"value {index} is skipped: nothing to write"
        self.checksums[index] = copy_with_checksum(value, view)
        self.mark(index)

    def mark(self, index: int) -> None:
        """Value ``index`` is complete: every byte of it is in its view (a DMA into it has
        finished). Call it after the bytes, never before: from then on, should this
        process die before the commit, the gateway stores the value as it lies."""
        view = self.views[index]
        assert view is not None and self.marks is not None, f"value {index} is skipped: nothing to mark"
        p.write_mark(self.marks, index, self.offsets[index], view.nbytes, self.checksums[index])

    def commit_checksums(self) -> list[int]:
        """The checksums to send with the commit: one per view, or none at all."""
        taken = [c for c, view in zip(self.checksums, self.views, strict=True) if view is not None]
        return [c for c in taken if c is not None] if None not in taken else []


@dataclass(frozen=True, slots=True)
class GetBatch:
    batch: int
    views: list[memoryview]
    """The values of the leading hits, in key order; valid until `release`."""
    ring_bytes: int = 0
    """Of their bytes, those the gateway copied into the shared ring (the rest are served in
    place from a RAM tier): ring room this batch holds until `release`."""


class GatewayClient:
    def __init__(self, sock: socket.socket, segment: Segment, hello: p.HelloOk, section: GatewaySection) -> None:
        self._sock = sock
        self._reader = FrameReader(sock, section.message_bytes_max)
        self.segment = segment
        self.hello = hello
        self._section = section
        self._next_id = 1
        # One request in flight per connection: replies come back in order.
        self._lock = threading.Lock()
        self._down: str | None = None
        """Why the client is down for good (see the restart rule), or None."""

    @classmethod
    def connect(
        cls,
        section: GatewaySection,
        client_name: str,
        release: str = __version__,
        protocol: int = p.PROTOCOL_VERSION,
        layouts: Sequence[LayoutFingerprint] = (),
    ) -> GatewayClient:
        """Connect, shake hands (registering ``layouts``, the layouts this client stores
        and looks up under) and map the segment; raises a `GatewayError` subclass."""
        hello = p.Hello(
            protocol, release, os.getpid(), client_name, section.config_digest, tuple(f.canonical() for f in layouts)
        )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(section.connect_timeout_ms / 1000)
        try:
            sock.connect(section.socket)
        except PermissionError:
            # Someone listens there, but not for this user: starting a gateway of our own could not help.
            sock.close()
            raise AccessDenied(denied_hint("the gateway socket", section.socket)) from None
        except OSError as err:
            sock.close()
            raise GatewayNotRunning(f"no gateway answers at {section.socket} ({err.strerror or err})") from None
        _kernel_timeouts(sock, section.request_timeout_ms)
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # A gateway that refuses this process at accept answers before it reads, and
                # hangs up: its reason is still there to read.
                send_message(sock, hello, 0)
            _, reply = FrameReader(sock, section.message_bytes_max).answer(0)
        except (OSError, PeerClosed, p.ProtocolError) as err:
            sock.close()
            raise GatewayUnavailable(f"gateway at {section.socket} did not complete the handshake: {err}") from None
        if isinstance(reply, p.Error):
            if reply.code is p.ErrorCode.STEPPING_ASIDE:
                pid = peer_of(sock).pid
                sock.close()
                raise GatewaySteppingAside(reply.text, pid)
            sock.close()
            refused = _REFUSED_HELLO.get(reply.code)
            if refused is not None:
                raise refused(f"{reply.code.name}: {reply.text}")
            raise GatewayRefused(reply.code, reply.text)
        if not isinstance(reply, p.HelloOk):
            sock.close()
            raise GatewayUnavailable(f"gateway answered HELLO with {type(reply).__name__}")
        if reply.protocol != protocol or reply.release != release:
            # The gateway checks too; checking here as well catches a gateway of a
            # release that accepted what it should not have.
            sock.close()
            raise VersionMismatch(
                f"VERSION_MISMATCH: client is release {release} protocol {protocol}; gateway (pid "
                f"{reply.gateway_pid}) is release {reply.release} protocol {reply.protocol}: "
                "deploy both from the same release"
            )
        try:
            segment = Segment.attach(Path(reply.shm_path), reply.shm_bytes, reply.ring_bytes)
        except ShmUnavailable as err:
            sock.close()
            raise (AccessDenied if isinstance(err, ShmDenied) else GatewayUnavailable)(str(err)) from None
        return cls(sock, segment, reply, section)

    @property
    def down(self) -> str | None:
        """Why this client is down for good, or None while it works."""
        return self._down

    # -- requests ------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], chunk_tokens: int = 0) -> int:
        """How many leading keys the gateway holds."""
        return self.probe(keys, chunk_tokens).hits

    def probe(self, keys: Sequence[bytes], chunk_tokens: int = 0, value_bytes: int = 0) -> p.LookupOk:
        """How many leading keys the gateway holds as values of ``value_bytes`` (0: any
        size), and how many of those leading ones are resident (see `p.LookupOk`)."""
        hits = resident = 0
        for part in p.batches(keys):
            found = self._call(p.Lookup(chunk_tokens, part, value_bytes), p.LookupOk)
            if not 0 <= found.hits <= len(part):
                raise self._fail(f"LOOKUP_OK says {found.hits} hits for {len(part)} keys")
            resident += found.resident if resident == hits else 0
            hits += found.hits
            if found.hits < len(part):
                break
        return p.LookupOk(hits, resident)

    def verify(self, items: Sequence[tuple[bytes, bytes]], value_bytes: int = 0) -> int:
        """How many leading (fingerprint, key) items the gateway read back intact (see `p.Verify`)."""
        verified = 0
        for part in p.batches(items):
            found = self._call(p.Verify(value_bytes, part), p.VerifyOk).count
            if not 0 <= found <= len(part):
                raise self._fail(f"VERIFY_OK says {found} verified of {len(part)}")
            verified += found
            if found < len(part):
                break
        return verified

    def locate(self, keys: Sequence[bytes]) -> list[int]:
        """Per key, a bit per tier that holds it; 0: none does (see `p.Locate`)."""
        return p.locate_all(keys, lambda question: self._call(question, p.LocateOk), self._fail)

    def drop(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` from every tier (see `p.Drop`)."""
        for part in p.batches(keys):
            self._call(p.Drop(part), p.Dropped)

    def prepare_put(
        self, fingerprint: bytes, items: Sequence[tuple[bytes, int]], namespace: int = NAMESPACE_UNKNOWN
    ) -> PutBatch:
        """``namespace``: the writer's `kvharbor.cache.keys.namespace_tag`, recorded with the values."""
        ready = self._call(p.PutPrepare(fingerprint, list(items), namespace), p.PutReady)
        if len(ready.offsets) != len(items):
            raise self._fail(f"PUT_READY has {len(ready.offsets)} offsets for {len(items)} values")
        views: list[memoryview | None] = []
        in_place = []
        for offset, (_, size) in zip(ready.offsets, items, strict=True):
            if offset == p.SKIP:
                views.append(None)
                continue
            views.append(self._span(offset, size))
            if offset + size > self.segment.read_only_from:
                if offset < self.segment.read_only_from:
                    raise self._fail(f"put span {offset}+{size} straddles the ring's end")
                in_place.append((offset, size))
        marks = None
        if any(view is not None for view in views):
            if ready.marks == p.SKIP:
                raise self._fail("PUT_READY lends places but no completion marks")
            marks = self._span(ready.marks, len(items) * p.MARK_BYTES)
            if ready.marks + marks.nbytes > self.segment.read_only_from:
                raise self._fail(f"completion marks at {ready.marks} lie outside the ring")
        if in_place:
            self._protect(in_place, writable=True)
        return PutBatch(ready.batch, views, in_place, [None] * len(views), marks, list(ready.offsets), ready.no_room)

    def commit_put(self, batch: PutBatch) -> int:
        if batch.in_place:
            # Before the gateway checksums them where they stay: from now on only it writes there.
            self._protect(batch.in_place, writable=False)
        return self._call(p.PutCommit(batch.batch, batch.commit_checksums()), p.PutDone).stored

    def get(self, fingerprint: bytes, keys: Sequence[bytes]) -> GetBatch:
        ready = self._call(p.Get(fingerprint, list(keys)), p.GetReady)
        if len(ready.spans) > len(keys):
            raise self._fail(f"GET_READY has {len(ready.spans)} values for {len(keys)} keys")
        views = [self._span(offset, size) for offset, size in ready.spans]
        return GetBatch(ready.batch, views, sum(size for offset, size in ready.spans if offset < self.ring_bytes))

    def release(self, batch: GetBatch) -> None:
        self._call(p.Release(batch.batch), p.Released)

    @property
    def ring_bytes(self) -> int:
        """The size of the segment's ring, shared by every client's transfers in flight."""
        return self.hello.ring_bytes

    def purge(self, selection: PurgeFilter, apply: bool) -> PurgeReport:
        """Empty what ``selection`` names from every tier (``apply``), or say what would go."""
        return self._call(p.Purge(selection, apply), p.Purged).report

    def status(self) -> GatewayStatus:
        return self._call(p.Status(), p.StatusOk).status

    def close(self) -> None:
        """Hang up and unmap. Views handed out earlier keep the mapping alive until dropped."""
        if self._down is None:
            self._down = "closed by its owner"
        with contextlib.suppress(OSError):
            self._sock.close()
        self.segment.close()

    # -- internals -----------------------------------------------------------

    def _span(self, offset: int, size: int) -> memoryview:
        """The segment's bytes at ``offset``."""
        if offset + size > self.segment.size:
            raise self._fail(f"span {offset}+{size} lies outside the {self.segment.size}-byte segment")
        return self.segment.view[offset : offset + size]

    def _protect(self, spans: list[tuple[int, int]], writable: bool) -> None:
        try:
            self.segment.set_writable(spans, writable)
        except ShmUnavailable as err:
            raise self._fail(str(err)) from None

    def _fail(self, reason: str) -> GatewayUnavailable:
        """Mark the client down for good (the restart rule) and return the error to raise."""
        if self._down is None:
            self._down = reason
            with contextlib.suppress(OSError):
                # Unblocks nothing of ours (one request at a time) but tells the
                # gateway at once that this client's transfers are over.
                self._sock.shutdown(socket.SHUT_RDWR)
        return GatewayUnavailable(reason)

    def _call(self, request: p.Message, expect: type[_Reply]) -> _Reply:
        with self._lock:
            if self._down is not None:
                raise GatewayUnavailable(
                    f"the gateway connection is down ({self._down}); the client does not reconnect: "
                    "restart the engine (after the gateway) to use the external cache again"
                )
            request_id = self._next_id
            self._next_id += 1
            try:
                data = p.encode(request, request_id)
            except p.ProtocolError as err:
                # The caller's request is bad (a key of the wrong length, too many
                # keys): refused here, before sending; the connection is untouched.
                raise GatewayRefused(err.code, f"not sent: {err.message}") from None
            try:
                self._sock.sendall(data)
                frame, reply = self._reader.answer(request_id)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO expired.
                raise self._fail(
                    f"gateway did not answer {type(request).__name__} within "
                    f"{self._section.request_timeout_ms} ms (gateway.request_timeout_ms); "
                    f"{describe_silence(self._sock)}"
                ) from None
            except (OSError, PeerClosed) as err:
                raise self._fail(f"gateway connection lost: {err}") from None
            except p.ProtocolError as err:
                raise self._fail(f"gateway sent a malformed reply: {err}") from None
            if frame.request_id != request_id:
                raise self._fail(f"reply to request {frame.request_id} came for request {request_id}")
        if isinstance(reply, p.Error):
            raise GatewayRefused(reply.code, reply.text)
        if not isinstance(reply, expect):
            raise self._fail(f"expected {expect.__name__} for request {request_id}, got {type(reply).__name__}")
        return reply
