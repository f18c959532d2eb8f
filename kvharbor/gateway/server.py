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
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvharbor import __version__
from kvharbor.cache.assembly import device_limit, open_store
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.purge import PurgeFilter, PurgeReport, purge
from kvharbor.cache.refill import RamRefill
from kvharbor.cache.store import TieredStore
from kvharbor.config import MIB, Config
from kvharbor.dashboard.hooks import GatewayHooks
from kvharbor.dashboard.servers import Dashboard
from kvharbor.gateway import protocol as p
from kvharbor.gateway.access import AccessPolicy, Peer, peer_of
from kvharbor.gateway.collectors import StoreCollector
from kvharbor.gateway.layouts import LayoutRegistry
from kvharbor.gateway.lifetime import Lifetime
from kvharbor.gateway.prober import TierProber
from kvharbor.gateway.progress import Heartbeat, RequestProgress
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
from kvharbor.gateway.status import (
    CARD_EVENTS_IN_STATUS,
    AttachedClient,
    DetachedClient,
    GatewayStatus,
    HitRate,
    ShmStatus,
)
from kvharbor.gateway.transfers import Batch, Transfers
from kvharbor.gateway.watchdog import RequestWatchdog
from kvharbor.gateway.wire import FrameReader, PeerClosed, send_message
from kvharbor.hal.base import CardDevice, CardEventRecord, CardStatus, Device, DeviceError, PersistentDevice
from kvharbor.hal.extents import round_up
from kvharbor.hal.shm_ram import SharedRamDevice
from kvharbor.telemetry.log import OnceLog, get_logger
from kvharbor.telemetry.metrics import GatewayCounts, GatewayMetrics

_log = get_logger("kvharbor.gateway")

RAM_SLACK_DIVISOR = 64
RAM_SLACK_BYTES = 16 * MIB
"""A RAM tier's region is its budget plus 1/64 plus 16 MiB: values are stored in
whole pages, so the region must hold a little more than the budget counts."""

ACCEPT_RETRY_MS = 100
"""Back-off after a failed accept (e.g. out of file descriptors) before trying again."""

DETACHED_KEPT = 64
"""Detached clients remembered for `Gateway.status` (the most recent; a rank that turned
its cache off is one of them while its process lives)."""

READ_ONLY_QUERIES = (p.Status, p.Locate)
"""Served without a HELLO: a tool (``kvharbor status``, ``doctor``) asks them without
attaching, so it counts as no client, keeps no embedded gateway alive and needs no
config digest of the gateway's. ``gateway.access`` still decides at accept."""

CLOSING_REFUSALS = frozenset({p.ErrorCode.VERSION_MISMATCH, p.ErrorCode.CONFIG_MISMATCH, p.ErrorCode.STEPPING_ASIDE})
"""Refused HELLOs after which the connection is closed: nothing else could be served on it."""


def _alive(pid: int) -> bool:
    """Does process ``pid`` exist (signal 0 checks without sending)? Another user's counts."""
    if pid <= 0:
        return False  # Unknown; and signal 0 to pid 0 would ask about our own process group.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class GatewayStartError(Exception):
    """The gateway cannot start; the message says what to change."""


def _cannot(action: str, path: Path, setting: str, err: OSError) -> GatewayStartError:
    return GatewayStartError(f"cannot {action} {path} ({err.strerror or err}); check {setting}")


@dataclass(slots=True)
class _Connection:
    """What the gateway knows about one client connection; touched only by its thread."""

    sock: socket.socket
    pid: int = 0
    """The client's process, from the socket's peer credentials."""
    batches: dict[int, Batch] = field(default_factory=dict)
    peer: str = "a client before HELLO"
    name: str = ""
    """The client's name, from its HELLO."""
    greeted: bool = False
    refusals_logged: set[p.ErrorCode] = field(default_factory=set)
    progress: RequestProgress | None = None
    """Reports the progress of the request being served."""


class Gateway:
    def __init__(
        self,
        config: Config,
        start_clean: bool = False,
        linger_s: float = 0.0,
        config_path: Path | None = None,
        release: str = __version__,
    ) -> None:
        """``linger_s`` > 0: an embedded gateway whose life its clients decide (`Lifetime`);
        0: it serves until stopped (a signal, or its embedding engine's exit).
        ``config_path``: the file ``config`` came from, where the dashboard writes an edit.
        ``release``: the release it says it is and serves (another: a gateway of another
        release, as the scenarios replay one; clients of this release are then refused)."""
        self.release = release
        self.config = config
        """The config in force; the dashboard may replace it by one differing in settings read at each use."""
        self.config_path = config_path
        self.dashboard: Dashboard | None = None
        self.start_clean = start_clean
        self.socket_path = Path(config.gateway.socket)
        self.access = AccessPolicy(config.gateway.access)
        self.metrics = GatewayMetrics(
            error_kinds=[code.name for code in p.ErrorCode],
            request_types={kind.value: kind.name.lower() for kind in p.MessageType},
            hit_rate_window_s=config.telemetry.hit_rate_window_s,
        )
        """The process's metrics; ``metrics.registry`` is what ``/metrics`` serves."""
        self.segment: Segment | None = None
        self.ring_bytes = 0
        """The segment's first bytes, the transfer ring; RAM tiers follow it."""
        self.store: TieredStore | None = None
        self._prober: TierProber | None = None
        self.transfers: Transfers | None = None
        self.refill: RamRefill | None = None
        self.layouts: LayoutRegistry | None = None
        self._listener: socket.socket | None = None
        self._socket_bound = False
        self._lock_file: int | None = None
        self._clients: dict[socket.socket, tuple[_Connection, threading.Thread]] = {}
        self._clients_lock = threading.Lock()
        self._detached: deque[tuple[str, int, float, bool]] = deque(maxlen=DETACHED_KEPT)
        """(name, pid, when, unclean) of the clients that detached, under ``_clients_lock``."""
        self.started_at_s = time.time()
        self._stopping = threading.Event()
        self._watchdog = RequestWatchdog(config.gateway.request_timeout_ms / 1000 / 2)
        """Says a request that outlasts half of its client's patience, with every thread's stack."""
        self._heartbeat = Heartbeat(config.gateway.progress_interval_ms / 1000)
        """Tells each client whose request is in service that it still is."""
        self.metrics.clients_attached.set_function(self._clients_attached)
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
        self.store = open_store(self.config, start_clean=self.start_clean, devices=shared, metrics=self.metrics)
        self.layouts = LayoutRegistry(
            [t.device.state_dir for t in self.store.tiers if isinstance(t.device, PersistentDevice)], self.start_clean
        )
        self._learn_layouts([bytes.fromhex(layout.digest) for layout in self.layouts.layouts()])
        self._prober = TierProber(
            self.store.tiers,
            self.config.storage.backpressure.circuit_breaker.background_probe_interval_s,
            self.config.card.health_interval_s,
        )
        self.transfers = Transfers(self.config, self.store, self.segment, self.ring_bytes, self.metrics)
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
        self.metrics.announce(p.PROTOCOL_VERSION)
        self.metrics.watch(StoreCollector(self.store.tiers, self.refill, self.config.card.health_interval_s))
        if self._lifetime is not None:
            self._lifetime.start()
        self.refill.start()
        self._prober.start()
        self._watchdog.start()
        self._heartbeat.start()
        self.dashboard = Dashboard.start(
            GatewayHooks(
                config=lambda: self.config,
                apply_config=self._take_config,
                config_path=self.config_path,
                status=lambda: self.status().to_document(),
                readiness=self.readiness,
                store_status=self.store.status,
                registry=lambda: self.metrics.registry,
            )
        )
        _log.info(
            "kvharbor: gateway %s (protocol %d, pid %d) serving %s, shared memory %s (%d MiB), start-clean=%d",
            self.release, p.PROTOCOL_VERSION, os.getpid(), self.socket_path, self.segment.path,
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
                connection = _Connection(sock, peer.pid)
                thread = threading.Thread(
                    target=self._serve_client, args=(connection,), daemon=True, name="kvharbor-client"
                )
                self._clients[sock] = (connection, thread)
        if refuse:
            busy = p.ProtocolError(p.ErrorCode.BUSY, f"gateway.clients_max {clients_max} reached")
            self._reject(_Connection(sock), busy, 0)
            sock.close()
            return
        self.metrics.admitted()
        thread.start()

    def _deny(self, sock: socket.socket, peer: Peer) -> None:
        """Refuse a process whose user ``gateway.access`` does not admit, before reading from it;
        said once per uid (a client retrying in a loop must not flood the log)."""
        reason = self.access.refusal(peer, self.socket_path)
        self.metrics.error(p.ErrorCode.ACCESS_DENIED.name)
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
            self._stopping.set()  # From here /readyz answers 503.
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
            self._watchdog.stop()
            self._heartbeat.stop()
            if self.dashboard is not None:
                self.dashboard.stop()  # Before the store closes: the page reads it.
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

    @property
    def counters(self) -> GatewayCounts:
        """The gateway's own counts now, read from its metrics (one source of numbers)."""
        return self.metrics.snapshot()

    def _clients_attached(self) -> int:
        with self._clients_lock:
            return sum(connection.greeted for connection, _ in self._clients.values())

    def status(self) -> GatewayStatus:
        """What this gateway is and holds now (see `kvharbor.gateway.status`)."""
        store, transfers, segment, refill = self.store, self.transfers, self.segment, self.refill
        assert store is not None and transfers is not None and segment is not None and refill is not None
        assert self.layouts is not None
        with self._clients_lock:
            connections = [c for c, _ in self._clients.values()]
            detached = list(self._detached)
        counts = self.counters
        counters = {name: value for name, value in asdict(counts).items() if name != "rejected"}
        store_status = store.status()
        recent_query, recent_hit = store.hits.recent.totals()
        hits = store_status.hits
        cards, card_events = self._cards()
        return GatewayStatus(
            release=self.release,
            protocol=p.PROTOCOL_VERSION,
            pid=os.getpid(),
            socket=str(self.socket_path),
            config_digest=self.config.gateway.config_digest.short,
            access=self.access.describe(),
            started_at_s=self.started_at_s,
            start_clean=self.start_clean,
            shm=ShmStatus(
                path=str(segment.path),
                bytes=segment.size,
                ring_bytes=self.ring_bytes,
                free_bytes=transfers.ring.free_bytes,
                pinned=transfers.pinned,
                in_place_bytes=transfers.reserved_bytes,
            ),
            clients=[AttachedClient(c.name, c.pid) for c in connections if c.greeted],
            detached=[DetachedClient(name, pid, at_s, unclean, _alive(pid)) for name, pid, at_s, unclean in detached],
            transfers_open=sum(len(c.batches) for c in connections),
            counters=counters,
            rejected=dict(counts.rejected),
            hit_rate=HitRate(
                window_s=store.hits.recent.window_s,
                recent_lookup_tokens=recent_query,
                recent_hit_tokens=recent_hit,
                lookup_tokens=hits.lookup_tokens,
                hit_tokens=hits.hit_tokens,
                lookups=hits.lookups,
            ),
            store=store_status,
            cards=cards,
            card_events=card_events,
            refill=refill.status(),
            layouts=self.layouts.layouts(),
            dashboard_url=None if self.dashboard is None else self.dashboard.status.url,
            metrics_url=None if self.dashboard is None else self.dashboard.status.metrics_url,
        )

    def _cards(self) -> tuple[dict[str, CardStatus], dict[str, list[CardEventRecord]]]:
        """The card section and newest events of each tier on a card that answers; one that
        does not shows in its tier's health and breaker instead."""
        assert self.store is not None
        cards, events = {}, {}
        for tier in self.store.tiers:
            if isinstance(tier.device, CardDevice):
                try:
                    cards[tier.name] = tier.device.card_status()
                    events[tier.name] = tier.device.card_events()[-CARD_EVENTS_IN_STATUS:]
                except (DeviceError, OSError) as err:
                    self._once.say(
                        f"card-status:{tier.name}", f"tier {tier.name}: the card's status is unreadable: {err}"
                    )
        return cards, events

    def readiness(self) -> str | None:
        """None while the gateway accepts clients with its store open; else why not (``/readyz``)."""
        if self._stopping.is_set():
            return "the gateway is stopping"
        if self._listener is None or self.store is None:
            return "the gateway is starting"
        return None

    def _take_config(self, config: Config) -> None:
        """Put ``config`` in force (a dashboard edit): it must serve the same storage, or
        clients of the old config would be refused by a gateway still serving it."""
        if config.gateway.config_digest != self.config.gateway.config_digest:
            raise ValueError("a config put in force must have the storage and card sections in force")
        self.config = config

    # -- one client --------------------------------------------------------

    def _serve_client(self, connection: _Connection) -> None:
        sock = connection.sock
        reader = FrameReader(sock, self.config.gateway.message_bytes_max)
        gw = self.config.gateway
        progress = connection.progress = RequestProgress(sock, gw.progress_interval_ms / 1000, gw.request_max_ms / 1000)
        self._heartbeat.add(progress)
        try:
            while not self._stopping.is_set():
                try:
                    frame, body = reader.frame()
                except p.ProtocolError as err:
                    # An oversized frame cannot be skipped safely: answer and hang up.
                    self._reject(connection, err, 0)
                    return
                started = time.perf_counter()
                outcome: p.Message | p.ProtocolError
                self._watchdog.begin(frame.type, connection.peer)
                try:
                    with progress.serving(frame.request_id):
                        outcome = self._answer(connection, frame.type, body)
                except p.ProtocolError as err:
                    outcome = err
                finally:
                    self._watchdog.end()
                    # Before the answer goes out, so a client holding its answer finds the
                    # request counted; refused requests too: their time was the gateway's.
                    self.metrics.served(frame.type, time.perf_counter() - started)
                if isinstance(outcome, p.ProtocolError):
                    self._reject(connection, outcome, frame.request_id)
                    if outcome.code is p.ErrorCode.STEPPING_ASIDE and self._lifetime is not None:
                        self._lifetime.told()  # Only now: its stop hangs up on this connection too.
                    if outcome.code in CLOSING_REFUSALS:
                        return
                    continue
                send_message(sock, outcome, frame.request_id)
        except (PeerClosed, OSError):
            pass  # The client went away; its extents are freed below.
        finally:
            self._heartbeat.remove(progress)
            self._disconnect(connection)

    def _answer(self, connection: _Connection, kind: int, body: memoryview) -> p.Message:
        message = p.decode_body(kind, body)
        if not connection.greeted and not isinstance(message, (p.Hello, *READ_ONLY_QUERIES)):
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
            connection.name = message.client
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
            self.metrics.detaches_unclean.inc()
            self.metrics.marked_stored.inc(stored)
            self.metrics.error("marks_refused", refused)
            self.metrics.error("unmarked_dropped", unmarked)
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
            if connection.greeted:
                self._detached.append((connection.name, connection.pid, time.time(), bool(open_batches)))
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
                return p.PutReady(batch_id, offsets, batch.marks, batch.no_room)
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
            case p.Locate(keys=keys):
                return p.LocateOk(self._locate(keys))
            case p.Purge(selection=selection, apply=apply):
                return p.Purged(self._purge(selection, apply, progress))
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"{type(message).__name__} is not a request")

    def _purge(self, selection: PurgeFilter, apply: bool, progress: RequestProgress) -> PurgeReport:
        """`kvharbor purge` through this gateway: every tier, its RAM tiers included."""
        assert self.store is not None
        # A purge reads what the tiers hold: the writes queued for them land first (within
        # the client's patience), or one would bring a purged value back after the purge.
        if not self.store.settle(self.config.gateway.request_timeout_ms / 1000 / 2):
            _log.warning("kvharbor: purge: the tiers' write queues did not drain in time; queued values may stay")
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
        if hello.protocol != p.PROTOCOL_VERSION or hello.release != self.release:
            mismatch = (
                f"{who} is release {hello.release} protocol {hello.protocol}; "
                f"gateway (pid {os.getpid()}) is release {self.release} protocol {p.PROTOCOL_VERSION}"
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
        layouts = self._layouts_of(hello)
        if self._lifetime is not None:
            if not self.segment.path.exists():
                self._step_aside(f"its shared memory {self.segment.path} was removed", "")
            if not self._lifetime.attach():
                raise p.ProtocolError(p.ErrorCode.STEPPING_ASIDE, f"embedded gateway (pid {os.getpid()}) is stopping")
        if layouts:
            assert self.layouts is not None
            self.layouts.register(layouts, hello.client)
            self._learn_layouts([layout.digest() for layout in layouts])
        _log.info("kvharbor: client %r (pid %d) attached", hello.client, hello.pid)
        return p.HelloOk(
            p.PROTOCOL_VERSION, self.release, str(self.segment.path), self.segment.size, self.ring_bytes, os.getpid()
        )

    def _learn_layouts(self, digests: Sequence[bytes]) -> None:
        """Teach every tier the registered layouts' digests (`Tier.learn_engine_fingerprints`)."""
        assert self.store is not None
        for tier in self.store.tiers:
            tier.learn_engine_fingerprints(digests)

    @staticmethod
    def _layouts_of(hello: p.Hello) -> list[LayoutFingerprint]:
        """The layouts ``hello`` registers; refuses the handshake for one that is not a
        canonical fingerprint (a registry must name what the digests stand for exactly)."""
        layouts = []
        for i, raw in enumerate(hello.layouts):
            try:
                layouts.append(LayoutFingerprint.from_canonical(raw))
            except ValueError as err:
                raise p.ProtocolError(p.ErrorCode.MALFORMED, f"HELLO layout {i}: {err}") from None
        return layouts

    def _locate(self, keys: Sequence[bytes]) -> list[int]:
        """`p.LocateOk.holders` of ``keys``: from each tier's index (or device), nothing read."""
        assert self.store is not None
        holders = [0] * len(keys)
        for bit, tier in enumerate(self.store.tiers):
            for i, present in enumerate(tier.contains(keys)):
                if present:
                    holders[i] |= 1 << bit
        return holders

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

    def _reject(self, connection: _Connection, err: p.ProtocolError, request_id: int) -> None:
        """Answer a refused message with its reason and count it. Logged once per client and
        kind: a client that keeps sending the same bad message must not flood the log."""
        self.metrics.error(err.code.name)
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
