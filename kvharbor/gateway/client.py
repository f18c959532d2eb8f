"""The client side of the gateway protocol: one connection, one mapped segment.

Transfers are two-phase, so KV bytes are copied exactly once on each side of
the shared memory:

- put: `prepare_put` reserves room and returns writable views; the caller
  copies its values into them; `commit_put` stores them.
- get: `get` returns read views of the leading hits; the caller copies them
  out; `release` gives the room back.

Every failure raises a `GatewayError`; deciding what a failure means for the
engine (turn the cache off on this rank) is the connector's job.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvharbor import __version__
from kvharbor.config import GatewaySection
from kvharbor.gateway import protocol as p
from kvharbor.gateway.shm import Segment, ShmUnavailable
from kvharbor.gateway.wire import PeerClosed, recv_message, send_message

_Reply = TypeVar("_Reply", bound=p.Message)


class GatewayError(Exception):
    """The gateway cannot serve this client (gone, hung, refused, incompatible)."""


class GatewayUnavailable(GatewayError):
    pass


class VersionMismatch(GatewayError):
    pass


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


@dataclass(frozen=True, slots=True)
class GetBatch:
    batch: int
    views: list[memoryview]
    """The values of the leading hits, in key order; valid until `release`."""


class GatewayClient:
    def __init__(self, sock: socket.socket, segment: Segment, hello: p.HelloOk, section: GatewaySection) -> None:
        self._sock = sock
        self.segment = segment
        self.hello = hello
        self._section = section
        self._next_id = 1
        # One request in flight per connection: replies come back in order.
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        section: GatewaySection,
        client_name: str,
        release: str = __version__,
        protocol: int = p.PROTOCOL_VERSION,
    ) -> GatewayClient:
        """Connect, shake hands and map the segment; raises a `GatewayError` subclass."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(section.connect_timeout_ms / 1000)
        try:
            sock.connect(section.socket)
        except OSError as err:
            sock.close()
            raise GatewayUnavailable(f"no gateway answers at {section.socket} ({err.strerror or err})") from None
        sock.settimeout(section.request_timeout_ms / 1000)
        try:
            send_message(sock, p.Hello(protocol, release, os.getpid(), client_name), 0)
            _, reply = recv_message(sock, section.message_bytes_max)
        except (OSError, PeerClosed, p.ProtocolError) as err:
            sock.close()
            raise GatewayUnavailable(f"gateway at {section.socket} did not complete the handshake: {err}") from None
        if isinstance(reply, p.Error):
            sock.close()
            if reply.code is p.ErrorCode.VERSION_MISMATCH:
                raise VersionMismatch(f"VERSION_MISMATCH: {reply.text}")
            raise GatewayRefused(reply.code, reply.text)
        if not isinstance(reply, p.HelloOk):
            sock.close()
            raise GatewayUnavailable(f"gateway answered HELLO with {type(reply).__name__}")
        try:
            segment = Segment.attach(Path(reply.shm_path), reply.shm_bytes)
        except ShmUnavailable as err:
            sock.close()
            raise GatewayUnavailable(str(err)) from None
        return cls(sock, segment, reply, section)

    # -- requests ------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], chunk_tokens: int = 0) -> int:
        """How many leading keys the gateway holds."""
        hits = 0
        for start in range(0, len(keys), p.KEYS_PER_MESSAGE_MAX):
            part = list(keys[start : start + p.KEYS_PER_MESSAGE_MAX])
            found = self._call(p.Lookup(chunk_tokens, part), p.LookupOk).hits
            assert 0 <= found <= len(part)
            hits += found
            if found < len(part):
                break
        return hits

    def prepare_put(self, fingerprint: bytes, items: Sequence[tuple[bytes, int]]) -> PutBatch:
        ready = self._call(p.PutPrepare(fingerprint, list(items)), p.PutReady)
        if len(ready.offsets) != len(items):
            raise GatewayUnavailable(f"PUT_READY has {len(ready.offsets)} offsets for {len(items)} values")
        views: list[memoryview | None] = []
        for offset, (_, size) in zip(ready.offsets, items, strict=True):
            views.append(None if offset == p.SKIP else self._span(offset, size))
        return PutBatch(ready.batch, views)

    def commit_put(self, batch: PutBatch) -> int:
        return self._call(p.PutCommit(batch.batch), p.PutDone).stored

    def get(self, fingerprint: bytes, keys: Sequence[bytes]) -> GetBatch:
        ready = self._call(p.Get(fingerprint, list(keys)), p.GetReady)
        if len(ready.spans) > len(keys):
            raise GatewayUnavailable(f"GET_READY has {len(ready.spans)} values for {len(keys)} keys")
        return GetBatch(ready.batch, [self._span(offset, size) for offset, size in ready.spans])

    def release(self, batch: GetBatch) -> None:
        self._call(p.Release(batch.batch), p.Released)

    def status(self) -> dict[str, Any]:
        return self._call(p.Status(), p.StatusOk).document

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            self.segment.close()

    # -- internals -----------------------------------------------------------

    def _span(self, offset: int, size: int) -> memoryview:
        if offset + size > self.segment.size:
            raise GatewayUnavailable(f"span {offset}+{size} lies outside the {self.segment.size}-byte segment")
        return self.segment.view[offset : offset + size]

    def _call(self, request: p.Message, expect: type[_Reply]) -> _Reply:
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            try:
                send_message(self._sock, request, request_id)
                frame, reply = recv_message(self._sock, self._section.message_bytes_max)
            except TimeoutError:
                raise GatewayUnavailable(
                    f"gateway did not answer {type(request).__name__} within "
                    f"{self._section.request_timeout_ms} ms (gateway.request_timeout_ms)"
                ) from None
            except (OSError, PeerClosed) as err:
                raise GatewayUnavailable(f"gateway connection lost: {err}") from None
            except p.ProtocolError as err:
                raise GatewayUnavailable(f"gateway sent a malformed reply: {err}") from None
        if isinstance(reply, p.Error):
            raise GatewayRefused(reply.code, reply.text)
        if frame.request_id != request_id or not isinstance(reply, expect):
            raise GatewayUnavailable(
                f"expected {expect.__name__} for request {request_id}, got {type(reply).__name__} "
                f"for {frame.request_id}"
            )
        return reply
