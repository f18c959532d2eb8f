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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from kvharbor.config import Config
from kvharbor.gateway import embedded
from kvharbor.gateway.client import GatewayClient, GatewayError, GatewayRefused
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.connector")

Connect = Callable[[Config, str], GatewayClient]


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
    refused: int = 0
    off: int = 0
    """1 once the external cache is off on this rank."""

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CacheLink:
    def __init__(self, config: Config, client_name: str, connect: Connect = embedded.connect) -> None:
        self.config = config
        self.client_name = client_name
        self.counters = LinkCounters()
        self.off_reason = ""
        self._connect = connect
        self._client: GatewayClient | None = None
        self._lock = threading.Lock()
        self._once = OnceLog(_log)

    @property
    def is_off(self) -> bool:
        return self.counters.off == 1

    def start(self) -> bool:
        """Connect now (rather than on first use); True if the cache is on."""
        return self._get_client() is not None

    def lookup(self, keys: Sequence[bytes], chunk_tokens: int) -> int:
        """How many leading keys are stored; 0 when the cache is off or faulty."""
        if not keys:
            return 0
        client = self._get_client()
        if client is None:
            return 0
        try:
            hits = client.lookup(keys, chunk_tokens)
        except GatewayError as err:
            self._failed(err)
            return 0
        assert 0 <= hits <= len(keys), (hits, len(keys))
        self.counters.lookups += 1
        self.counters.lookup_chunks += len(keys)
        self.counters.hit_chunks += hits
        return hits

    def load(self, fingerprint: bytes, keys: Sequence[bytes], sink: Callable[[int, memoryview], None]) -> int:
        """Hand the values of the leading stored keys to ``sink(i, value)``, in order.

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
            for i, view in enumerate(batch.views):
                sink(i, view)
                self.counters.loaded_bytes += view.nbytes
        finally:
            try:
                client.release(batch)
            except GatewayError as err:
                self._failed(err)
        self.counters.loaded_chunks += len(batch.views)
        return len(batch.views)

    def store(
        self,
        fingerprint: bytes,
        items: Sequence[tuple[bytes, int]],
        fill: Callable[[int, memoryview], None],
        on_filled: Callable[[], None] | None = None,
    ) -> int:
        """Store values of the given (key, size): ``fill(i, view)`` writes value i.

        Returns how many the gateway stored; values already stored are skipped
        without being filled. ``on_filled`` runs once every value is copied and
        before the (slower) commit: the caller's source buffers are free then.
        """
        client = self._get_client()
        if client is None or not items:
            return 0
        try:
            batch = client.prepare_put(fingerprint, items)
            for i, view in enumerate(batch.views):
                if view is None:
                    self.counters.skipped_chunks += 1
                    continue
                fill(i, view)
            if on_filled is not None:
                on_filled()
            stored = client.commit_put(batch)
        except GatewayError as err:
            self._failed(err)
            return 0
        self.counters.stored_chunks += stored
        copied = [size for (_, size), view in zip(items, batch.views, strict=True) if view is not None]
        self.counters.stored_bytes += sum(copied)
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
        with_client = self._client
        self._client = None
        self.counters.off = 1
        self.off_reason = str(err)
        self._once.say(
            "off",
            f"external KV cache turned off on this rank: {err}. The engine keeps serving without it; "
            "restart the engine (and the gateway, in service mode) to turn it back on",
            logging.ERROR,
        )
        if with_client is not None:
            with contextlib.suppress(OSError):
                with_client.close()
