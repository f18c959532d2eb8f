"""The gateway: the one process that owns the storage and serves every client on a host.

Tensor-parallel ranks and several engines attach to it over a Unix socket
(control) and one shared-memory segment (KV bytes). It serves each client on
its own thread: a blocking socket read per client is the lowest-latency
design in Python, and the number of clients is bounded (``clients_max``).

Faults stay local: a malformed message is refused with a reason and counted,
and the gateway keeps serving everyone else; a client that dies mid-transfer
has its shared-memory extents freed when its connection closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvharbor import __version__
from kvharbor.cache.assembly import open_store
from kvharbor.cache.store import TieredStore
from kvharbor.config import MIB, Config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.ring import Ring
from kvharbor.gateway.shm import (
    PAGE_BYTES,
    Segment,
    enlarge_hint,
    plan_ring,
    remove_stale_segments,
    segment_path,
    shm_space,
)
from kvharbor.gateway.wire import PeerClosed, recv_frame, send_message
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.gateway")


class GatewayStartError(Exception):
    """The gateway cannot start; the message says what to change."""


class _RingFull(Exception):
    pass


@dataclass(slots=True)
class _Batch:
    """Extents of the segment lent to one client for one transfer."""

    kind: str
    extents: list[int] = field(default_factory=list)
    items: list[tuple[bytes, int, int]] = field(default_factory=list)
    """put: (key, offset, length) of each value to store."""
    fingerprint: bytes = b""


@dataclass(slots=True)
class GatewayCounters:
    clients_total: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    ring_full: int = 0
    put_bytes: int = 0
    get_bytes: int = 0


class Gateway:
    def __init__(self, config: Config, start_clean: bool = False) -> None:
        self.config = config
        self.start_clean = start_clean
        self.socket_path = Path(config.gateway.socket)
        self.counters = GatewayCounters()
        self.segment: Segment | None = None
        self.ring: Ring | None = None
        self.store: TieredStore | None = None
        self._listener: socket.socket | None = None
        self._lock_file: int | None = None
        self._clients: dict[int, socket.socket] = {}
        self._clients_lock = threading.Lock()
        self._batch_ids = iter(range(1, 2**63))
        self._batch_lock = threading.Lock()
        self._stopping = threading.Event()

    # -- life cycle --------------------------------------------------------

    def start(self) -> None:
        """Take the socket's lock, size and create the segment, open the store, listen."""
        gw = self.config.gateway
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        shm_dir = Path(gw.shm_dir)
        if not shm_dir.is_dir():
            raise GatewayStartError(f"gateway.shm_dir {shm_dir} is not a directory")
        remove_stale_segments(shm_dir, gw.shm_name)
        free, total = shm_space(shm_dir)
        try:
            plan = plan_ring(gw.ring_mb * MIB, gw.ring_mb_min * MIB, free, total)
        except Exception as err:
            raise GatewayStartError(str(err)) from None
        if plan.shrunk:
            _log.warning(
                "kvharbor: gateway ring of %d MiB doesn't fit in %s (%d MiB free of %d MiB); using %d MiB. %s",
                gw.ring_mb, shm_dir, free // MIB, total // MIB, plan.granted_bytes // MIB,
                enlarge_hint(plan.requested_bytes),
            )  # fmt: skip
        size = plan.granted_bytes - plan.granted_bytes % PAGE_BYTES
        try:
            self.segment = Segment.create(segment_path(shm_dir, gw.shm_name, os.getpid()), size)
        except Exception as err:
            raise GatewayStartError(str(err)) from None
        self.ring = Ring(size)
        self.store = open_store(self.config, start_clean=self.start_clean)
        self.socket_path.unlink(missing_ok=True)  # Ours: we hold the lock.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        listener.listen(gw.clients_max)
        self._listener = listener
        _log.info(
            "kvharbor: gateway %s (protocol %d) serving %s, shared memory %s (%d MiB), start-clean=%d",
            __version__, p.PROTOCOL_VERSION, self.socket_path, self.segment.path, size // MIB,
            int(self.start_clean),
        )  # fmt: skip

    def serve_forever(self) -> None:
        assert self._listener is not None, "start() first"
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                break  # The listener was closed by stop().
            with self._clients_lock:
                if len(self._clients) >= self.config.gateway.clients_max:
                    self._refuse(conn, p.ErrorCode.BUSY, f"clients_max {self.config.gateway.clients_max} reached")
                    continue
                self._clients[conn.fileno()] = conn
                self.counters.clients_total += 1
            threading.Thread(target=self._serve_client, args=(conn,), daemon=True, name="kvharbor-client").start()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._clients_lock:
            for conn in self._clients.values():
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.socket_path.unlink(missing_ok=True)
        if self.store is not None:
            self.store.close()
        if self.segment is not None:
            self.segment.close()
        if self._lock_file is not None:
            os.close(self._lock_file)
        _log.info("kvharbor: gateway stopped")

    def status(self) -> dict[str, Any]:
        assert self.store is not None and self.ring is not None and self.segment is not None
        with self._clients_lock:
            clients = len(self._clients)
        return {
            "release": __version__,
            "protocol": p.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "socket": str(self.socket_path),
            "shm": {"path": str(self.segment.path), "bytes": self.segment.size, "free_bytes": self.ring.free_bytes},
            "clients": clients,
            "counters": {
                "clients_total": self.counters.clients_total,
                "rejected": dict(self.counters.rejected),
                "ring_full": self.counters.ring_full,
                "put_bytes": self.counters.put_bytes,
                "get_bytes": self.counters.get_bytes,
            },
            "store": asdict(self.store.status()),
        }

    # -- one client --------------------------------------------------------

    def _serve_client(self, conn: socket.socket) -> None:
        batches: dict[int, _Batch] = {}
        greeted = False
        body_max = self.config.gateway.message_bytes_max
        try:
            while not self._stopping.is_set():
                try:
                    frame, body = recv_frame(conn, body_max)
                except p.ProtocolError as err:
                    # An oversized frame cannot be skipped safely: answer and hang up.
                    self._reject(conn, err, 0)
                    return
                try:
                    message = p.decode_body(frame.type, body)
                    if not greeted and not isinstance(message, p.Hello):
                        raise p.ProtocolError(p.ErrorCode.NOT_READY, "the first message must be HELLO")
                    reply = self._handle(message, batches)
                    greeted = True
                except p.ProtocolError as err:
                    self._reject(conn, err, frame.request_id)
                    if err.code is p.ErrorCode.VERSION_MISMATCH:
                        return
                    continue
                send_message(conn, reply, frame.request_id)
        except (PeerClosed, OSError):
            pass  # The client went away; its extents are freed below.
        finally:
            for batch in batches.values():
                self._free(batch)
            with self._clients_lock:
                self._clients = {k: c for k, c in self._clients.items() if c is not conn}
            conn.close()

    def _handle(self, message: p.Message, batches: dict[int, _Batch]) -> p.Message:
        store, ring = self.store, self.ring
        assert store is not None and ring is not None
        match message:
            case p.Hello():
                return self._hello(message)
            case p.Lookup(chunk_tokens=chunk_tokens, keys=keys):
                return p.LookupOk(store.lookup(keys, chunk_tokens))
            case p.PutPrepare():
                batch_id, batch, offsets = self._prepare_put(message)
                batches[batch_id] = batch
                return p.PutReady(batch_id, offsets)
            case p.PutCommit(batch=batch_id):
                batch = self._pop_batch(batches, batch_id, "put")
                try:
                    return p.PutDone(self._commit_put(batch))
                finally:
                    self._free(batch)
            case p.Get(fingerprint=fingerprint, keys=keys):
                batch_id, spans, batch = self._get(fingerprint, keys)
                batches[batch_id] = batch
                return p.GetReady(batch_id, spans)
            case p.Release(batch=batch_id):
                self._free(self._pop_batch(batches, batch_id, "get"))
                return p.Released(batch_id)
            case p.Status():
                return p.StatusOk(self.status())
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"{type(message).__name__} is not a request")

    def _hello(self, hello: p.Hello) -> p.Message:
        if hello.protocol != p.PROTOCOL_VERSION or hello.release != __version__:
            text = (
                f"client {hello.client} (pid {hello.pid}) speaks release {hello.release} protocol {hello.protocol}; "
                f"gateway is release {__version__} protocol {p.PROTOCOL_VERSION}: deploy both from the same release"
            )
            _log.error("kvharbor: VERSION_MISMATCH: %s", text)
            raise p.ProtocolError(p.ErrorCode.VERSION_MISMATCH, text)
        assert self.segment is not None
        _log.info("kvharbor: client %s (pid %d) attached", hello.client, hello.pid)
        return p.HelloOk(p.PROTOCOL_VERSION, __version__, str(self.segment.path), self.segment.size, os.getpid())

    # -- puts --------------------------------------------------------------

    def _prepare_put(self, message: p.PutPrepare) -> tuple[int, _Batch, list[int]]:
        """Room for each value not yet stored; `SKIP` for the rest (stored, or no room)."""
        store, ring = self.store, self.ring
        assert store is not None and ring is not None
        value_max = self.config.storage.value_mb_max * MIB
        for _, size in message.items:
            if not 0 < size <= value_max:
                raise p.ProtocolError(
                    p.ErrorCode.TOO_LARGE,
                    f"value of {size} bytes is outside 1..{value_max} (storage.value_mb_max)",
                )
        batch = _Batch("put", fingerprint=message.fingerprint)
        present = store.contains([key for key, _ in message.items])
        offsets = []
        for (key, size), stored in zip(message.items, present, strict=True):
            offset = None if stored else ring.allocate(size, self.config.gateway.ring_wait_ms)
            if offset is None:
                self.counters.ring_full += not stored
                offsets.append(p.SKIP)
                continue
            batch.extents.append(offset)
            batch.items.append((key, offset, size))
            offsets.append(offset)
        return self._new_batch_id(), batch, offsets

    def _commit_put(self, batch: _Batch) -> int:
        store, segment = self.store, self.segment
        assert store is not None and segment is not None
        pinned = frozenset(key for key, _, _ in batch.items)
        stored = 0
        for key, offset, size in batch.items:
            assert offset + size <= segment.size
            if store.put(key, batch.fingerprint, segment.view[offset : offset + size], pinned):
                stored += 1
                self.counters.put_bytes += size
        return stored

    # -- gets --------------------------------------------------------------

    def _get(self, fingerprint: bytes, keys: Sequence[bytes]) -> tuple[int, list[tuple[int, int]], _Batch]:
        store, ring, segment = self.store, self.ring, self.segment
        assert store is not None and ring is not None and segment is not None
        batch = _Batch("get")
        spans: list[tuple[int, int]] = []

        def source(nbytes: int) -> memoryview:
            offset = ring.allocate(nbytes, self.config.gateway.ring_wait_ms)
            if offset is None:
                raise _RingFull
            batch.extents.append(offset)
            return segment.view[offset : offset + nbytes]

        try:
            for key in keys:
                value = store.get(key, fingerprint, source)
                if value is None:
                    break
                spans.append(self._place(value, source))
                self.counters.get_bytes += value.nbytes
        except _RingFull:
            self.counters.ring_full += 1  # The hits so far are served; the rest are misses.
        return self._new_batch_id(), spans, batch

    def _place(self, value: memoryview, source: Any) -> tuple[int, int]:
        """(offset, length) of ``value`` in the segment, copying it there if it is elsewhere."""
        segment = self.segment
        assert segment is not None
        if value.obj is segment.map:
            offset = _address(value) - _address(segment.view)
        else:
            target = source(value.nbytes)
            target[:] = value
            offset = _address(target) - _address(segment.view)
        assert offset >= 0 and offset + value.nbytes <= segment.size
        return offset, value.nbytes

    # -- helpers -----------------------------------------------------------

    def _new_batch_id(self) -> int:
        with self._batch_lock:
            return next(self._batch_ids)

    def _pop_batch(self, batches: dict[int, _Batch], batch_id: int, kind: str) -> _Batch:
        batch = batches.get(batch_id)
        if batch is None or batch.kind != kind:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_BATCH, f"no open {kind} batch {batch_id} on this connection")
        del batches[batch_id]
        return batch

    def _free(self, batch: _Batch) -> None:
        assert self.ring is not None
        for offset in batch.extents:
            self.ring.free(offset)
        batch.extents.clear()

    def _reject(self, conn: socket.socket, err: p.ProtocolError, request_id: int) -> None:
        self.counters.rejected[err.code.name] += 1
        _log.warning("kvharbor: refused a message: %s", err)
        with contextlib.suppress(OSError):
            send_message(conn, p.Error(err.code, err.message), request_id)

    def _refuse(self, conn: socket.socket, code: p.ErrorCode, text: str) -> None:
        self._reject(conn, p.ProtocolError(code, text), 0)
        conn.close()

    def _take_lock(self) -> None:
        """One gateway per socket: an exclusive lock beside it, held for life."""
        lock_path = self.socket_path.with_name(self.socket_path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise GatewayStartError(
                f"another gateway (pid {holder}) already serves {self.socket_path}; stop it or set gateway.socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_file = fd


def _address(view: memoryview) -> int:
    """The memory address of a writable view's first byte (for offsets within the segment)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


