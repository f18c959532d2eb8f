"""One rank's link to the gateway, and the switch that keeps the engine serving.

Every engine adapter (vLLM, SGLang) talks to kvharbor through a `CacheLink`.
It never raises into the engine: a lookup that cannot be answered is a miss,
a load that cannot complete loads nothing, a store that cannot complete
stores nothing.

Restart rule: when the gateway stops answering, is of another release, or its
shared memory cannot be mapped, the link turns the external cache off on this
rank, says ``external KV cache turned off on this rank`` once, shows it in
`LinkCounters.off`, and from then on answers every call at once with a miss.
It does not reconnect: a new gateway may hold other storage or another
release, and a rank that silently switched gateways mid-flight could mix
layouts. Restart the engine (and, in service mode, the gateway with it).
A gateway that refuses one request (ring full, a value too large) only costs
that request.

The links of one process to one gateway (a vLLM worker's load and save
links, and the scheduler's where it shares the process) share one
`RankSwitch`: the first failure turns the cache off for all of them, and the
line is said once per process, not once per link. The ranks of one engine
turn their switches off together (`kvharbor.connector.ranks`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol

from kvharbor.cache.keys import NAMESPACE_UNKNOWN
from kvharbor.config import Config
from kvharbor.connector.fanout import Fanout
from kvharbor.gateway import embedded
from kvharbor.gateway.client import GatewayClient, GatewayError, GatewayRefused, GetBatch, PutBatch
from kvharbor.gateway.protocol import LookupOk
from kvharbor.gateway.shm import Segment
from kvharbor.telemetry.log import PREFIX, OnceLog, get_logger

_log = get_logger("kvharbor.connector")

Connect = Callable[[Config, str], GatewayClient]


class StreamCopies(Protocol):
    """The copies of a streamed load (`CacheLink.load_streamed`), started request by request."""

    def flush(self) -> Callable[[], None]:
        """Start copying the values staged since the last flush or hold; the returned wait
        blocks until they have read the shared memory."""

    def hold(self) -> None:
        """Keep the values staged since the last flush or hold for `flush_held`, uncopied."""

    def flush_held(self) -> Callable[[], None]:
        """Start copying every held value; the returned wait blocks until they have read the
        shared memory."""

    def drop_held(self) -> None:
        """The held values will not be copied (the load failed before their copy started)."""


@dataclass(frozen=True, slots=True)
class Landing:
    """Values in shared memory, marked complete, not stored yet (`CacheLink.land`)."""

    client: GatewayClient | None
    """The connection the batch is open on (a batch belongs to one)."""
    batch: PutBatch | None
    """The gateway's batch, open until `CacheLink.commit`; None: nothing lent, or it failed."""
    lent_bytes: int
    """The bytes of the values lent a place (and filled)."""
    no_room: int
    """Values the gateway had no room for by ``gateway.ring_wait_ms``: not stored."""


_LANDED_NOTHING = Landing(None, None, 0, 0)

_IN_TURN = Fanout(1, "kvharbor-fill")
"""A store's fills when its caller gives no fanout: in turn, in the calling thread."""

_NONE = LookupOk(0, 0)
"""A lookup's answer when the cache cannot give one: a miss."""


@dataclass(slots=True)
class LinkCounters:
    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    skipped_chunks: int = 0
    """Chunks a store did not write: already stored, or the gateway had no room."""
    no_room_chunks: int = 0
    """Of those, the chunks the gateway had no room for (``gateway.ring_wait_ms``): not stored."""
    refused: int = 0
    off: int = 0
    """1 once the external cache is off on this rank."""

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RankSwitch:
    """Whether the external cache is on, for every link of this process to one gateway."""

    _by_socket: ClassVar[dict[str, RankSwitch]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.reason = ""
        self._lock = threading.Lock()

    @classmethod
    def for_gateway(cls, socket: str) -> RankSwitch:
        """The process-wide switch of the gateway at ``socket``."""
        with cls._registry_lock:
            return cls._by_socket.setdefault(socket, cls())

    @property
    def is_off(self) -> bool:
        return bool(self.reason)

    def turn_off(self, reason: str) -> bool:
        """Turn the cache off; True only for the call that did it."""
        with self._lock:
            if self.reason:
                return False
            self.reason = reason or "unknown failure"
            return True


def say_off(reason: str) -> None:
    """The restart rule's line; said once per rank, by whoever turned its switch off."""
    _log.error(
        "%sexternal KV cache turned off on this rank: %s. The engine keeps serving without it; "
        "restart the engine (and the gateway, in service mode) to turn it back on",
        PREFIX,
        reason,
    )


class CacheLink:
    def __init__(
        self,
        config: Config,
        client_name: str,
        connect: Connect = embedded.connect,
        switch: RankSwitch | None = None,
    ) -> None:
        self.config = config
        self.client_name = client_name
        self.counters = LinkCounters()
        self.switch = switch if switch is not None else RankSwitch.for_gateway(config.gateway.socket)
        self._connect = connect
        self._client: GatewayClient | None = None
        self._lock = threading.Lock()
        self._once = OnceLog(_log)

    @property
    def is_off(self) -> bool:
        if self.switch.is_off and not self.counters.off:
            self._drop_client()  # Another link of this rank found the gateway failed.
        return self.switch.is_off

    @property
    def off_reason(self) -> str:
        return self.switch.reason

    def start(self) -> bool:
        """Connect now (rather than on first use); True if the cache is on."""
        return self._get_client() is not None

    def lookup(self, keys: Sequence[bytes], chunk_tokens: int, value_bytes: int = 0) -> LookupOk:
        """How many leading keys are stored as values of ``value_bytes`` (0: any size), and
        how many of those are resident (promised as they are; see `LookupOk`); none when
        the cache is off or faulty."""
        if not keys:
            return _NONE
        client = self._get_client()
        if client is None:
            return _NONE
        try:
            found = client.probe(keys, chunk_tokens, value_bytes)
        except GatewayError as err:
            self._failed(err)
            return _NONE
        assert 0 <= found.resident <= found.hits <= len(keys), (found, len(keys))
        self.counters.lookups += 1
        self.counters.lookup_chunks += len(keys)
        self.counters.hit_chunks += found.hits
        return found

    def locate(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether some tier holds it (any size; nothing read, no LRU order moved);
        none held when the cache is off or faulty."""
        client = self._get_client()
        if client is None or not keys:
            return [False] * len(keys)
        try:
            return [holders != 0 for holders in client.locate(keys)]
        except GatewayError as err:
            self._failed(err)
            return [False] * len(keys)

    def verify(self, items: Sequence[tuple[bytes, bytes]], value_bytes: int = 0) -> int | None:
        """How many leading (fingerprint, key) items are stored intact, read back in full
        (`GatewayClient.verify`); None when there is no answer (the cache is off or faulty,
        or the gateway refused the request): nothing was found damaged then."""
        client = self._get_client()
        if client is None:
            return None
        try:
            return client.verify(items, value_bytes)
        except GatewayError as err:
            self._failed(err)
            return None

    def drop(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` from every tier; nothing when the cache is off or faulty."""
        client = self._get_client()
        if client is None or not keys:
            return
        try:
            client.drop(keys)
        except GatewayError as err:
            self._failed(err)

    def load(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        sink: Callable[[int, memoryview], None],
        fanout: Fanout | None = None,
    ) -> int:
        """Hand the values of the leading stored keys to ``sink(i, value)``: in order, or,
        with ``fanout``, on its threads, several at once (its contract: sink i touches
        only what is value i's own).

        Returns how many were handed over; the views are valid only inside ``sink``.
        """
        client = self._get_client()
        if client is None or not keys:
            return 0
        try:
            batch = client.get(fingerprint, keys)
        except GatewayError as err:
            self._failed(err)
            return 0
        try:
            views = batch.views
            (fanout or _IN_TURN).run(lambda i: sink(i, views[i]), range(len(views)))
            self.counters.loaded_bytes += sum(view.nbytes for view in views)
        finally:
            try:
                client.release(batch)
            except GatewayError as err:
                self._failed(err)
        self.counters.loaded_chunks += len(batch.views)
        return len(batch.views)

    def load_streamed(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        keys_per_get: int,
        sink: Callable[[int, memoryview], None],
        copies: StreamCopies,
        proceed: Callable[[int], bool] | None,
        in_flight_max: int,
        hold_from: int | None = None,
        answered: Callable[[int], None] | None = None,
    ) -> int:
        """`load` in requests of ``keys_per_get`` keys, for copies that finish later (DMA).

        ``sink(i, value)`` stages value i; after each request's values,
        ``copies.flush()`` starts their copies and returns a ``wait`` that blocks until
        they have read the shared memory. Up to ``in_flight_max`` requests are held
        at once: the gateway reads request n+1 while the copies of the earlier ones
        run, and a request's room is given back only after its wait, oldest first.
        Requests whose values the gateway copied into the ring hold it: they are
        given back before the next request unless the ring's half still has room
        for it, so that a load never waits for ring room it holds itself.
        ``proceed(values_so_far)``, asked before each further request, may stop
        early.

        Requests from value ``hold_from`` on whose values the gateway serves in place
        are held instead (``copies.hold()``), all of them, and copied together once the
        gateway has answered every request (``copies.flush_held()``); values it copied
        into the ring stream as the others. ``answered(values)``, once the last request
        is answered (before the last copies are waited for), tells how many leading
        values were staged: the ones that will be counted unless the room of their
        request cannot be given back, or their held copy fails.

        Returns how many leading values were copied completely: a request whose room
        could not be given back cleanly is not counted (the gateway may have reused its
        memory under the copy), nor what follows it.
        """
        if keys_per_get <= 0 or in_flight_max <= 0:
            raise ValueError(f"keys_per_get {keys_per_get} and in_flight_max {in_flight_max} must be positive")
        client = self._get_client()
        if client is None or not keys:
            return 0
        streaming: deque[tuple[GetBatch, Callable[[], None], int, int]] = deque()
        """Requests whose copies were started: (batch, wait, first value, end)."""
        held: list[tuple[GetBatch, int, int]] = []
        """Requests held for ``copies.flush_held``: (batch, first value, end)."""
        held_wait: Callable[[], None] | None = None
        """The held requests' copies, once started."""
        copied: dict[int, int] = {}
        """First value -> end of each request copied completely and given back."""
        ring_room = client.ring_bytes // 2
        ring_per_get = 0
        """The most ring bytes a request of this load took so far: what the next may take."""

        def give_back_oldest() -> None:
            """Wait for the oldest request's copies, then give its room back (it stays held if
            that fails)."""
            batch, wait, first, end = streaming[0]
            wait()
            client.release(batch)
            streaming.popleft()
            copied[first] = end

        def give_back_held() -> None:
            """After the held copies (started, or never to be), give their room back."""
            if held_wait is not None:
                held_wait()
            while held:
                batch, first, end = held[0]
                client.release(batch)
                held.pop(0)
                if held_wait is not None:
                    copied[first] = end

        try:
            staged = 0
            for start in range(0, len(keys), keys_per_get):
                if start and proceed is not None and not proceed(start):
                    break
                while streaming and (
                    len(streaming) >= in_flight_max
                    or sum(b.ring_bytes for b, _, _, _ in streaming) + ring_per_get > ring_room
                ):
                    give_back_oldest()
                part = keys[start : start + keys_per_get]
                batch = client.get(fingerprint, part)
                ring_per_get = max(ring_per_get, batch.ring_bytes)
                for j, view in enumerate(batch.views):
                    sink(start + j, view)
                    self.counters.loaded_bytes += view.nbytes
                staged = start + len(batch.views)
                if hold_from is not None and start >= hold_from and not batch.ring_bytes:
                    copies.hold()
                    held.append((batch, start, staged))
                else:
                    streaming.append((batch, copies.flush(), start, staged))
                if len(batch.views) < len(part):
                    break
            if answered is not None:
                answered(staged)
            if held:
                held_wait = copies.flush_held()
            while streaming:
                give_back_oldest()
            give_back_held()
        except GatewayError as err:
            if held and held_wait is None:
                copies.drop_held()  # Not copied: nothing of them is counted.
            if isinstance(err, GatewayRefused):  # The connection still works: give their room back.
                with contextlib.suppress(GatewayError):
                    while streaming:
                        give_back_oldest()
                    give_back_held()
            for _, wait, _, _ in streaming:
                wait()  # Copies in flight finish before anything else touches that memory.
            if held_wait is not None:
                held_wait()
            self._failed(err)
        done = 0
        while done in copied and copied[done] > done:
            done = copied[done]
        self.counters.loaded_chunks += done
        return done

    def shared_memory(self) -> Segment | None:
        """This link's mapping of the gateway's shared memory (connecting if need be);
        None while the cache is off."""
        client = self._get_client()
        return None if client is None else client.segment

    def store(
        self,
        fingerprint: bytes,
        items: Sequence[tuple[bytes, int]],
        fill: Callable[[int, memoryview], int | None],
        settle: Callable[[], None] | None = None,
        namespace: int = NAMESPACE_UNKNOWN,
        fanout: Fanout | None = None,
    ) -> int:
        """Store values of the given (key, size): `land` them, then `commit`; returns how
        many the gateway stored."""
        return self.commit(self.land(fingerprint, items, fill, settle, namespace, fanout))

    def land(
        self,
        fingerprint: bytes,
        items: Sequence[tuple[bytes, int]],
        fill: Callable[[int, memoryview], int | None],
        settle: Callable[[], None] | None = None,
        namespace: int = NAMESPACE_UNKNOWN,
        fanout: Fanout | None = None,
    ) -> Landing:
        """The first half of a store: the gateway lends a place to each value not stored yet
        (values already stored, or without room by ``gateway.ring_wait_ms``, are skipped
        unfilled), ``fill(i, view)`` writes value i, and each is marked complete
        (`PutBatch.mark`) as soon as its bytes are in place: right after its ``fill``, or,
        when ``fill`` only starts a copy (a DMA), once ``settle()`` has waited for every copy.
        From then on the sources are free, and should this process die, the gateway still
        stores every marked value. `commit` stores them.

        A ``fill`` may return the `kvharbor.hal.checksum.checksum` of the bytes it wrote,
        taken as it wrote them: when every fill of a batch does, the gateway need not read
        the values again to checksum them. ``namespace``: the writer's
        `kvharbor.cache.keys.namespace_tag`, kept in the headers. ``fanout`` runs the fills
        on its threads, several at once (its contract: fill i touches only value i's view);
        without it they run in turn in this thread.

        Batches of one link may be landed ahead of the commits of earlier ones (the gateway
        keeps each open until its commit); they are committed in any order.
        """
        client = self._get_client()
        if client is None or not items:
            return _LANDED_NOTHING
        try:
            batch = client.prepare_put(fingerprint, items, namespace)
            lent = [i for i, view in enumerate(batch.views) if view is not None]
            self.counters.skipped_chunks += len(batch.views) - len(lent)
            self.counters.no_room_chunks += batch.no_room

            def fill_one(i: int) -> None:
                view = batch.views[i]
                assert view is not None, i
                written = fill(i, view)
                if written is not None:
                    batch.checksums[i] = written
                if settle is None:
                    batch.mark(i)

            (fanout or _IN_TURN).run(fill_one, lent)
            if settle is not None:
                settle()
                for i in lent:
                    batch.mark(i)
        except GatewayError as err:
            self._failed(err)
            return _LANDED_NOTHING
        return Landing(client, batch, sum(items[i][1] for i in lent), batch.no_room)

    def commit(self, landing: Landing) -> int:
        """Store a `land`'s values; returns how many the gateway stored (0 for a landing of
        nothing, or when the gateway failed since)."""
        if landing.client is None or landing.batch is None or self.is_off:
            return 0  # Nothing lent, or the cache went off since: its connection is gone.
        try:
            stored = landing.client.commit_put(landing.batch)
        except GatewayError as err:
            self._failed(err)
            return 0
        self.counters.stored_chunks += stored
        self.counters.stored_bytes += landing.lent_bytes
        return stored

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- internals -------------------------------------------------------------

    def _get_client(self) -> GatewayClient | None:
        if self.is_off:
            return None
        with self._lock:
            if self._client is None and not self.is_off:
                try:
                    self._client = self._connect(self.config, self.client_name)
                except GatewayError as err:
                    self._turn_off(err)
        return self._client

    def _failed(self, err: GatewayError) -> None:
        if isinstance(err, GatewayRefused):
            self.counters.refused += 1
            self._once.say(f"refused:{err.code.name}", f"gateway refused a request ({err}); that request is a miss")
            return
        self._turn_off(err)

    def _turn_off(self, err: GatewayError) -> None:
        if self.switch.turn_off(str(err)):
            say_off(str(err))
        self._drop_client()

    def _drop_client(self) -> None:
        self.counters.off = 1
        with_client, self._client = self._client, None
        if with_client is not None:
            with contextlib.suppress(OSError):
                with_client.close()
