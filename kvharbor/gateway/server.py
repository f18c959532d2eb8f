"""The gateway: the one process that owns the storage and serves every client on a host.

Tensor-parallel ranks and several engines attach to it over a Unix socket
(control) and one shared-memory segment (KV bytes). It serves each client on
its own thread: a blocking socket read per client is the lowest-latency
design in Python, and the number of clients is bounded (``clients_max``).

Faults stay local: a malformed message is refused with a reason and counted,
and the gateway keeps serving everyone else; a client that dies mid-transfer
has its shared-memory extents freed when its connection closes (the kernel
closes it however the client dies), after the values of its open puts that it
marked complete are stored (`Transfers.commit_marked`: an engine killed right
after its last step loses no save that step finished). A client that hangs mid-transfer keeps its
extents until its connection closes: reclaiming them earlier could hand memory
it still writes into to another transfer, and a wrong byte must never be stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvharbor import __version__
from kvharbor.cache.assembly import device_limit, open_store
from kvharbor.cache.purge import PurgeFilter, PurgeReport, purge
from kvharbor.cache.refill import RamRefill
from kvharbor.cache.store import TieredStore
from kvharbor.config import MIB, Config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.access import AccessPolicy, Peer, peer_of
from kvharbor.gateway.lifetime import Lifetime
from kvharbor.gateway.prober import TierProber
from kvharbor.gateway.shm import (
    PAGE_BYTES,
    Segment,
    ShmTooSmall,
    enlarge_hint,
    plan_ring,
    remove_stale_segments,
    segment_path,
    shm_space,
)
from kvharbor.gateway.transfers import Batch, Transfers
from kvharbor.gateway.wire import FrameReader, PeerClosed, send_message
from kvharbor.hal.base import Device
from kvharbor.hal.extents import round_up
from kvharbor.hal.shm_ram import SharedRamDevice
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.gateway")

RAM_SLACK_DIVISOR = 64
RAM_SLACK_BYTES = 16 * MIB
"""A RAM tier's region is its budget plus 1/64 plus 16 MiB: values are stored in
whole pages, so the region must hold a little more than the budget counts."""

ACCEPT_RETRY_MS = 100
"""Back-off after a failed accept (e.g. out of file descriptors) before trying again."""

CLOSING_REFUSALS = frozenset({p.ErrorCode.VERSION_MISMATCH, p.ErrorCode.CONFIG_MISMATCH, p.ErrorCode.STEPPING_ASIDE})
"""Refused HELLOs after which the connection is closed: nothing else could be served on it."""


class GatewayStartError(Exception):
    """The gateway cannot start; the message says what to change."""


def _cannot(action: str, path: Path, setting: str, err: OSError) -> GatewayStartError:
    return GatewayStartError(f"cannot {action} {path} ({err.strerror or err}); check {setting}")


class _Progress:
    """Reports a long request's progress to its client at most once per interval (a
    PROGRESS frame), so that a large commit to a slow tier is not taken for a hang."""

    def __init__(self, sock: socket.socket, interval_s: float) -> None:
        self._sock = sock
        self._interval_s = interval_s
        self._request_id = 0
        self._next = 0.0

    def start(self, request_id: int) -> None:
        """A new request begins: its first report is due one interval from now."""
        self._request_id = request_id
        self._next = time.monotonic() + self._interval_s

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now >= self._next:
            send_message(self._sock, p.Progress(done), self._request_id)
            self._next = now + self._interval_s


@dataclass(slots=True)
class _Connection:
    """What the gateway knows about one client connection; touched only by its thread."""

    sock: socket.socket
    batches: dict[int, Batch] = field(default_factory=dict)
    peer: str = "a client before HELLO"
    greeted: bool = False
    refusals_logged: set[p.ErrorCode] = field(default_factory=set)
    progress: _Progress | None = None
    """Reports the progress of the request being served."""


@dataclass(slots=True)
class GatewayCounters:
    """Monotonic counters, updated under `Gateway._counters_lock` (clients run on threads)."""

    clients_total: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    """Refused messages by `ErrorCode` name."""
    ring_full: int = 0
    """Values not transferred because the ring had no room by the request's deadline."""
    put_bytes: int = 0
    get_bytes: int = 0
    clients_died_mid_transfer: int = 0
    marked_stored: int = 0
    """Values of puts whose client went away before committing, stored from their completion marks."""
    marks_refused: int = 0
    """Completion marks for a place not lent, or with a checksum the bytes do not match: not stored."""
    unmarked_dropped: int = 0
    """Values of such puts not marked complete (maybe half-written): given back unread."""


class Gateway:
    def __init__(self, config: Config, start_clean: bool = False, linger_s: float = 0.0) -> None:
        """``linger_s`` > 0: an embedded gateway whose life its clients decide (`Lifetime`);
        0: it serves until stopped (a signal, or its embedding engine's exit)."""
        self.config = config
        self.start_clean = start_clean
        self.socket_path = Path(config.gateway.socket)
        self.access = AccessPolicy(config.gateway.access)
        self.counters = GatewayCounters()
        self.segment: Segment | None = None
        self.ring_bytes = 0
        """The segment's first bytes, the transfer ring; RAM tiers follow it."""
        self.store: TieredStore | None = None
        self._prober: TierProber | None = None
        self.transfers: Transfers | None = None
        self.refill: RamRefill | None = None
        self._listener: socket.socket | None = None
        self._socket_bound = False
        self._lock_file: int | None = None
        self._clients: dict[socket.socket, tuple[_Connection, threading.Thread]] = {}
        self._clients_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._stopping = threading.Event()
        # Held for the whole of `stop`: a second caller (signal thread, main
        # thread, parent watcher) waits until the first has finished cleaning
        # up, so the process never exits half-way through it.
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._once = OnceLog(_log)
        self._lifetime = Lifetime(linger_s, self.stop) if linger_s > 0 else None

    # -- life cycle --------------------------------------------------------

    def start(self) -> None:
        """Take the socket's lock, size and create the segment, open the store, listen."""
        gw = self.config.gateway
        try:
            self.access.make_directory(self.socket_path.parent)
        except OSError as err:
            raise _cannot("create the socket's directory", self.socket_path.parent, "gateway.socket", err) from None
        self._take_lock()
        shm_dir = Path(gw.shm_dir)
        if not shm_dir.is_dir():
            raise GatewayStartError(f"gateway.shm_dir {shm_dir} is not a directory")
        remove_stale_segments(shm_dir, gw.shm_name)
        free, total = shm_space(shm_dir)
        shared = self._create_segment(shm_dir, free, total)
        assert self.segment is not None
        self.store = open_store(self.config, start_clean=self.start_clean, devices=shared)
        self._prober = TierProber(
            self.store.tiers, self.config.storage.backpressure.circuit_breaker.background_probe_interval_s
        )
        self.transfers = Transfers(self.config, self.store, self.segment, self.ring_bytes, self._count)
        storage = self.config.storage
        self.refill = RamRefill(self.store, storage.refill_ram, storage.refill_ram_mb_per_s)
        # Ours to replace: we hold the lock, so a socket file here is a dead gateway's.
        self.socket_path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener = listener
        try:
            listener.bind(str(self.socket_path))
        except OSError as err:
            raise _cannot("bind the socket", self.socket_path, "gateway.socket", err) from None
        self._socket_bound = True
        try:
            self.access.apply(self.socket_path)
        except OSError as err:
            raise _cannot("grant gateway.access on", self.socket_path, "gateway.access", err) from None
        listener.listen(gw.clients_max)
        if self._lifetime is not None:
            self._lifetime.start()
        self.refill.start()
        self._prober.start()
        _log.info(
            "kvharbor: gateway %s (protocol %d, pid %d) serving %s, shared memory %s (%d MiB), start-clean=%d",
            __version__, p.PROTOCOL_VERSION, os.getpid(), self.socket_path, self.segment.path,
            self.segment.size // MIB, int(self.start_clean),
        )  # fmt: skip

    def _create_segment(self, shm_dir: Path, free: int, total: int) -> dict[str, Device]:
        """Create the segment: the transfer ring, then a region per RAM tier.

        RAM tiers live in the segment when it has room for them, so their hits
        are served in place (one copy to the client, one DMA to a GPU); else
        they stay in the gateway's own memory, which costs a copy per hit.
        Returns the shared-memory devices by tier name.
        """
        gw = self.config.gateway
        try:
            plan = plan_ring(gw.ring_mb * MIB, gw.ring_mb_min * MIB, free, total, gw.shm_reserve_mb * MIB, shm_dir)
        except ShmTooSmall as err:
            raise GatewayStartError(str(err)) from None
        if plan.shrunk:
            _log.warning("kvharbor: %s", plan.warning(shm_dir))
        ring = plan.granted_bytes - plan.granted_bytes % PAGE_BYTES
        ram_tiers = [t for t in self.config.storage.tiers if t.type == "ram"]
        regions = {t.name: round_up(t.capacity_bytes + t.capacity_bytes // RAM_SLACK_DIVISOR + RAM_SLACK_BYTES)
                   for t in ram_tiers}  # fmt: skip
        room = free - ring - gw.shm_reserve_mb * MIB
        if sum(regions.values()) > room:
            if regions:
                _log.warning(
                    "kvharbor: RAM tier(s) %s (%d MiB) do not fit in %s beside the ring (%d MiB free); kept in the "
                    "gateway's memory, so each hit costs one more copy. %s",
                    ", ".join(regions), sum(regions.values()) // MIB, shm_dir, max(room, 0) // MIB,
                    enlarge_hint(ring + sum(regions.values())),
                )  # fmt: skip
            regions = {}
        size = ring + sum(regions.values())
        try:
            self.segment = Segment.create(segment_path(shm_dir, gw.shm_name, os.getpid()), size)
        except (ShmTooSmall, OSError) as err:
            raise GatewayStartError(str(err)) from None
        try:
            self.access.apply(self.segment.path)
        except OSError as err:
            raise _cannot("grant gateway.access on", self.segment.path, "gateway.access", err) from None
        self.ring_bytes = ring
        devices: dict[str, Device] = {}
        at = ring
        for tier in ram_tiers:
            if tier.name in regions:
                region = self.segment.view[at : at + regions[tier.name]]
                devices[tier.name] = SharedRamDevice(tier.name, region, at, device_limit(tier, self.config))
                at += regions[tier.name]
        assert at == size
        return devices

    def serve_forever(self) -> None:
        assert self._listener is not None, "start() first"
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as err:
                if self._stopping.is_set():
                    break  # The listener was closed by stop().
                _log.error("kvharbor: gateway cannot accept a client: %s; retrying", err)
                self._stopping.wait(ACCEPT_RETRY_MS / 1000)
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        peer = peer_of(sock)
        if not self.access.admits(peer):
            self._deny(sock, peer)
            return
        clients_max = self.config.gateway.clients_max
        with self._clients_lock:
            if len(self._clients) >= clients_max:
                refuse = True
            else:
                refuse = False
                connection = _Connection(sock)
                thread = threading.Thread(
                    target=self._serve_client, args=(connection,), daemon=True, name="kvharbor-client"
                )
                self._clients[sock] = (connection, thread)
        if refuse:
            busy = p.ProtocolError(p.ErrorCode.BUSY, f"gateway.clients_max {clients_max} reached")
            self._reject(_Connection(sock), busy, 0)
            sock.close()
            return
        self._count(clients_total=1)
        thread.start()

    def _deny(self, sock: socket.socket, peer: Peer) -> None:
        """Refuse a process whose user ``gateway.access`` does not admit, before reading from it;
        said once per uid (a client retrying in a loop must not flood the log)."""
        reason = self.access.refusal(peer, self.socket_path)
        with self._counters_lock:
            self.counters.rejected[p.ErrorCode.ACCESS_DENIED.name] += 1
        self._once.say(f"access:{peer.uid}", f"refused a client: {reason}")
        with contextlib.suppress(OSError):
            send_message(sock, p.Error(p.ErrorCode.ACCESS_DENIED, reason), 0)
        sock.close()

    def stop(self) -> None:
        """Stop serving and release everything; safe to call from any thread, more than once."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopping.set()
            if self._lifetime is not None:
                self._lifetime.close()
            if self._listener is not None:
                with contextlib.suppress(OSError):
                    self._listener.shutdown(socket.SHUT_RDWR)
                self._listener.close()
            if self._socket_bound:
                # Only the gateway that bound the socket removes it: a gateway
                # refused at start must not unlink the one serving there.
                self.socket_path.unlink(missing_ok=True)
            self._stop_clients()
            if self._prober is not None:
                self._prober.stop()
            if self.refill is not None:
                self.refill.stop(self.config.gateway.stop_timeout_ms / 1000)
            if self.transfers is not None:
                self.transfers.close()
            if self.store is not None:
                self.store.close()
            if self.segment is not None:
                self.segment.close()
            if self._lock_file is not None:
                os.close(self._lock_file)
                self._lock_file = None
            if self._socket_bound:
                _log.info("kvharbor: gateway stopped")

    def _stop_clients(self) -> None:
        """Hang up on every client and wait (up to ``stop_timeout_ms``) for requests in flight,
        so the store is not closed under a put that is still being written."""
        with self._clients_lock:
            clients = list(self._clients.items())
        for sock, _ in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + self.config.gateway.stop_timeout_ms / 1000
        busy = 0
        for _, (_, thread) in clients:
            thread.join(max(0.0, deadline - time.monotonic()))
            busy += thread.is_alive()
        if busy:
            _log.warning(
                "kvharbor: %d client request(s) still running after %d ms (gateway.stop_timeout_ms); stopping anyway",
                busy, self.config.gateway.stop_timeout_ms,
            )  # fmt: skip

    def status(self) -> dict[str, Any]:
        assert self.store is not None and self.transfers is not None and self.segment is not None
        assert self.refill is not None
        with self._clients_lock:
            connections = [c for c, _ in self._clients.values()]
        with self._counters_lock:
            counters = asdict(self.counters)
            counters["rejected"] = dict(self.counters.rejected)
        return {
            "release": __version__,
            "protocol": p.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "socket": str(self.socket_path),
            "config_digest": self.config.gateway.config_digest.short,
            "access": self.access.describe(),
            "shm": {
                "path": str(self.segment.path),
                "bytes": self.segment.size,
                "ring_bytes": self.ring_bytes,
                "free_bytes": self.transfers.ring.free_bytes,
                "pinned": self.transfers.pinned,
                "in_place_bytes": self.transfers.reserved_bytes,
            },
            "clients": len(connections),
            "transfers_open": sum(len(c.batches) for c in connections),
            "counters": counters,
            "store": asdict(self.store.status()),
            "refill": asdict(self.refill.status()),
        }

    # -- one client --------------------------------------------------------

    def _serve_client(self, connection: _Connection) -> None:
        sock = connection.sock
        reader = FrameReader(sock, self.config.gateway.message_bytes_max)
        progress = connection.progress = _Progress(sock, self.config.gateway.progress_interval_ms / 1000)
        try:
            while not self._stopping.is_set():
                try:
                    frame, body = reader.frame()
                except p.ProtocolError as err:
                    # An oversized frame cannot be skipped safely: answer and hang up.
                    self._reject(connection, err, 0)
                    return
                progress.start(frame.request_id)
                try:
                    reply = self._answer(connection, frame.type, body)
                except p.ProtocolError as err:
                    self._reject(connection, err, frame.request_id)
                    if err.code is p.ErrorCode.STEPPING_ASIDE and self._lifetime is not None:
                        self._lifetime.told()  # Only now: its stop hangs up on this connection too.
                    if err.code in CLOSING_REFUSALS:
                        return
                    continue
                send_message(sock, reply, frame.request_id)
        except (PeerClosed, OSError):
            pass  # The client went away; its extents are freed below.
        finally:
            self._disconnect(connection)

    def _answer(self, connection: _Connection, kind: int, body: memoryview) -> p.Message:
        message = p.decode_body(kind, body)
        if not connection.greeted and not isinstance(message, p.Hello):
            raise p.ProtocolError(p.ErrorCode.NOT_READY, "the first message must be HELLO")
        if connection.greeted and isinstance(message, p.Hello):
            # One client per connection: a second HELLO must not count it twice (see `Lifetime`).
            raise p.ProtocolError(p.ErrorCode.MALFORMED, "HELLO was sent already on this connection")
        try:
            reply = self._handle(message, connection)
        except (p.ProtocolError, OSError):
            raise  # A refusal, or the client gone while we reported progress to it.
        except Exception as err:
            # A bug below (store, device driver) fails this request, not the
            # connection or the gateway; the traceback is for us.
            _log.exception("kvharbor: internal error serving %s %s", connection.peer, type(message).__name__)
            raise p.ProtocolError(p.ErrorCode.INTERNAL, f"{type(err).__name__}: {err}") from None
        if isinstance(message, p.Hello):
            connection.greeted = True
            connection.peer = f"client {message.client!r} (pid {message.pid})"
        return reply

    def _disconnect(self, connection: _Connection) -> None:
        transfers = self.transfers
        assert transfers is not None
        open_batches = list(connection.batches.values())
        connection.batches.clear()
        stored = refused = unmarked = freed = 0
        for batch in open_batches:
            try:
                if batch.kind == "put":
                    outcome = transfers.commit_marked(batch)
                    stored, refused, unmarked = (
                        stored + outcome.stored, refused + outcome.refused, unmarked + outcome.unmarked
                    )  # fmt: skip
            except Exception:
                # A bug below (store, device) costs these values, never the room they hold.
                _log.exception("kvharbor: internal error storing the marked values of %s", connection.peer)
            finally:
                freed += transfers.free(batch)
        if open_batches:
            self._count(
                clients_died_mid_transfer=1, marked_stored=stored, marks_refused=refused, unmarked_dropped=unmarked
            )
            _log.warning(
                "kvharbor: %s went away with %d open transfer(s); stored %d value(s) it had marked complete, "
                "refused %d mark(s) (wrong place or checksum), dropped %d unfinished value(s); freed %d bytes "
                "of shared memory",
                connection.peer, len(open_batches), stored, refused, unmarked, freed,
            )  # fmt: skip
        elif connection.greeted:
            _log.info("kvharbor: %s detached", connection.peer)
        with self._clients_lock:
            self._clients.pop(connection.sock, None)
        connection.sock.close()
        if connection.greeted and self._lifetime is not None:
            self._lifetime.detach()  # Last: every request of this client has been answered.

    def _handle(self, message: p.Message, connection: _Connection) -> p.Message:
        store, transfers, progress = self.store, self.transfers, connection.progress
        assert store is not None and transfers is not None and progress is not None
        batches = connection.batches
        match message:
            case p.Hello():
                return self._hello(message)
            case p.Lookup(chunk_tokens=chunk_tokens, keys=keys, value_bytes=value_bytes):
                probe = store.probe(keys, chunk_tokens, value_bytes)
                return p.LookupOk(probe.hits, probe.resident)
            case p.Verify(value_bytes=value_bytes, items=items):
                return p.VerifyOk(store.verify(items, value_bytes, progress))
            case p.Drop(keys=keys):
                store.delete(keys)
                return p.Dropped(len(keys))
            case p.PutPrepare():
                batch_id, batch, offsets = transfers.prepare_put(message, progress)
                batches[batch_id] = batch
                return p.PutReady(batch_id, offsets, batch.marks)
            case p.PutCommit(batch=batch_id, checksums=checksums):
                batch = self._pop_batch(batches, batch_id, "put")
                try:
                    return p.PutDone(transfers.commit_put(batch, checksums, progress))
                finally:
                    transfers.free(batch)
            case p.Get(fingerprint=fingerprint, keys=keys):
                batch_id, spans, batch = transfers.get(fingerprint, keys, progress)
                batches[batch_id] = batch
                return p.GetReady(batch_id, spans)
            case p.Release(batch=batch_id):
                transfers.free(self._pop_batch(batches, batch_id, "get"))
                return p.Released(batch_id)
            case p.Status():
                return p.StatusOk(self.status())
            case p.Purge(selection=selection, apply=apply):
                return p.Purged(self._purge(selection, apply, progress))
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"{type(message).__name__} is not a request")

    def _purge(self, selection: PurgeFilter, apply: bool, progress: _Progress) -> PurgeReport:
        """`kvharbor purge` through this gateway: every tier, its RAM tiers included."""
        assert self.store is not None
        report = purge(self.store.tiers, selection, apply, f"gateway pid {os.getpid()}", progress=progress)
        if apply:
            _log.info(
                "kvharbor: purged %s: %d values, %d bytes (%s)",
                selection.describe(),
                report.objects,
                report.nbytes,
                ", ".join(f"{t.tier} {t.objects}" for t in report.tiers),
            )
        return report

    def _hello(self, hello: p.Hello) -> p.Message:
        assert self.segment is not None
        who = f"client {hello.client!r} (pid {hello.pid})"
        if hello.protocol != p.PROTOCOL_VERSION or hello.release != __version__:
            mismatch = (
                f"{who} is release {hello.release} protocol {hello.protocol}; "
                f"gateway (pid {os.getpid()}) is release {__version__} protocol {p.PROTOCOL_VERSION}"
            )
            self._step_aside(f"{who} is release {hello.release}", f"VERSION_MISMATCH, {mismatch}")
            raise p.ProtocolError(p.ErrorCode.VERSION_MISMATCH, f"{mismatch}: {self._mismatch_hint()}")
        served = self.config.gateway.config_digest
        differing = served.differing(hello.config_digest)
        if differing:
            raise p.ProtocolError(
                p.ErrorCode.CONFIG_MISMATCH,
                f"client {hello.client!r} (pid {hello.pid}) has another config than the gateway at "
                f"{self.socket_path} (pid {os.getpid()}): its {' and '.join(differing)} section"
                f"{'s differ' if len(differing) > 1 else ' differs'} (client config {hello.config_digest.short}, "
                f"gateway config {served.short}). Engines that share a gateway need the same storage and card "
                "sections: give this engine the gateway's, or a gateway.socket of its own (left unset, 'derived', "
                "every config gets a gateway of its own)",
            )
        if self._lifetime is not None:
            if not self.segment.path.exists():
                self._step_aside(f"its shared memory {self.segment.path} was removed", "")
            if not self._lifetime.attach():
                raise p.ProtocolError(p.ErrorCode.STEPPING_ASIDE, f"embedded gateway (pid {os.getpid()}) is stopping")
        _log.info("kvharbor: client %r (pid %d) attached", hello.client, hello.pid)
        return p.HelloOk(
            p.PROTOCOL_VERSION, __version__, str(self.segment.path), self.segment.size, self.ring_bytes, os.getpid()
        )

    def _step_aside(self, why: str, detail: str) -> None:
        """An embedded gateway with no clients that cannot serve a new one exits for it:
        raises STEPPING_ASIDE (the client waits for the exit, then starts its own)."""
        if self._lifetime is not None and self._lifetime.step_aside(why):
            raise p.ProtocolError(
                p.ErrorCode.STEPPING_ASIDE,
                f"{detail + '; ' if detail else ''}embedded gateway (pid {os.getpid()}) had no clients and "
                f"steps aside ({why}): wait for it to exit, then start a new one",
            )

    def _mismatch_hint(self) -> str:
        """How to clear a refused release, for the one who reads the refusal."""
        if self._lifetime is not None:
            return (
                f"it serves {self._lifetime.clients} client(s) of its release and steps aside once they detach; "
                "or deploy both from the same release"
            )
        return (
            f"deploy both from the same release, or stop this gateway (kill {os.getpid()}) and start the one "
            "of the engine's release"
        )

    # -- helpers -----------------------------------------------------------

    @staticmethod
    def _pop_batch(batches: dict[int, Batch], batch_id: int, kind: str) -> Batch:
        batch = batches.get(batch_id)
        if batch is None or batch.kind != kind:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_BATCH, f"no open {kind} batch {batch_id} on this connection")
        del batches[batch_id]
        return batch

    def _count(self, **deltas: int) -> None:
        with self._counters_lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def _reject(self, connection: _Connection, err: p.ProtocolError, request_id: int) -> None:
        """Answer a refused message with its reason and count it. Logged once per client and
        kind: a client that keeps sending the same bad message must not flood the log."""
        with self._counters_lock:
            self.counters.rejected[err.code.name] += 1
        if err.code not in connection.refusals_logged:
            connection.refusals_logged.add(err.code)
            if err.code in CLOSING_REFUSALS:
                _log.error("kvharbor: refused %s: %s", connection.peer, err)
            else:
                _log.warning("kvharbor: refused a message from %s: %s", connection.peer, err)
        with contextlib.suppress(OSError):
            send_message(connection.sock, p.Error(err.code, err.message), request_id)

    def _take_lock(self) -> None:
        """One gateway per socket: an exclusive lock beside it, held for life."""
        lock_path = self.socket_path.with_name(self.socket_path.name + ".lock")
        try:
            fd = self.access.open_file(lock_path)
        except OSError as err:
            raise _cannot("open the gateway's lock", lock_path, "gateway.socket and gateway.access", err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise GatewayStartError(
                f"another gateway (pid {holder}) already serves {self.socket_path}; "
                "stop it first, or give this one another gateway.socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_file = fd
