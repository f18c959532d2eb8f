"""A real gateway in the test's own process, for the connector tests.

`RealGateway` runs `kvharbor.gateway.server.Gateway` (service mode, its own
socket in a temporary directory, a unique shared-memory name, a small ring, a
RAM tier) serving on a thread; connector links reach it through the real
client, over the real socket and shared memory. Tests look inside it through
another real client (`hold`, `holds`) or its `status()`, and make it fail for
real with `stop()`, or for one client with `hang_up`, or stall its storage
writes (`stalled_writes`: a first tier that cannot keep up).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvharbor.config import Config, load_config
from kvharbor.gateway.client import GatewayClient
from kvharbor.gateway.server import Gateway
from kvharbor.gateway.status import GatewayStatus
from tests.gateway.gateway_harness import WAIT_S, remove_segments, write_config

INSPECTOR = "inspector"


@dataclass
class Stall:
    """The gateway's storage writes held (`RealGateway.stalled_writes`)."""

    reached: threading.Event = field(default_factory=threading.Event)
    """Set once a commit has a value waiting at the stall."""
    release: threading.Event = field(default_factory=threading.Event)
    """Set it to let the writes through."""
    outlasted: bool = False
    """A write waited `WAIT_S` without a release (it was never meant to get through)."""


class RealGateway:
    def __init__(self, directory: Path, **gateway: Any) -> None:
        settings: dict[str, Any] = {"ring_mb": 64, "ring_mb_min": 16}
        settings.update(gateway)
        self.config_path = write_config(directory, **settings)
        self.config: Config = load_config(self.config_path, environ={})
        self.server: Gateway | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle --------------------------------------------------------

    def start(self) -> RealGateway:
        """Start serving (again, after `stop`: a new gateway on the same socket and shm_name)."""
        assert self.server is None, "already serving"
        server = Gateway(self.config)
        try:
            server.start()
        except BaseException:
            server.stop()
            raise
        self.server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True, name="kvharbor-test-gateway")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop it for real: the socket goes, every client connection is hung up."""
        if self.server is None:
            return
        self.server.stop()
        assert self._thread is not None
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the gateway's accept loop did not end"
        self.server, self._thread = None, None

    @property
    def serving(self) -> bool:
        return self.server is not None

    def close(self) -> None:
        self.stop()
        gw = self.config.gateway
        remove_segments(Path(gw.shm_dir), gw.shm_name)

    # -- clients -----------------------------------------------------------

    def connect(self, config: Config, client_name: str) -> GatewayClient:
        """A `CacheLink` connect function: a real client of this gateway, whatever ``config`` names."""
        return GatewayClient.connect(self.config.gateway, client_name)

    def client(self, name: str = INSPECTOR) -> GatewayClient:
        return GatewayClient.connect(self.config.gateway, name)

    def hold(self, keys: Sequence[bytes], value: bytes = b"\0", fingerprint: bytes = bytes(16)) -> int:
        """Store ``value`` under each key through a real client; returns how many were stored
        (a key already held stays as it is, and is not counted)."""
        client = self.client()
        try:
            batch = client.prepare_put(fingerprint, [(bytes(k), len(value)) for k in keys])
            for view in batch.views:
                if view is not None:
                    view[:] = value
            return client.commit_put(batch)
        finally:
            client.close()

    def holds(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the gateway holds, asked through a real client (a LOOKUP)."""
        client = self.client()
        try:
            return client.lookup([bytes(k) for k in keys])
        finally:
            client.close()

    def hang_up(self, client_name: str) -> int:
        """Hang up, from the gateway's side, on the clients whose name contains ``client_name``
        (what a gateway does to a client it has given up on); returns how many."""
        assert self.server is not None, "not serving"
        with self.server._clients_lock:
            connections = [c for c, _ in self.server._clients.values() if client_name in c.peer]
        for connection in connections:
            connection.sock.shutdown(socket.SHUT_RDWR)
        return len(connections)

    @contextlib.contextmanager
    def stalled_writes(self) -> Iterator[Stall]:
        """Within it, every value a commit stores (into its first tier, in place or from the
        ring) waits until ``release`` is set (at most `WAIT_S`): a first tier that cannot keep
        up, while room is still lent as usual. Released on exit."""
        assert self.server is not None and self.server.store is not None, "not serving"
        store, stall = self.server.store, Stall()

        def stalled(write: Callable[..., bool]) -> Callable[..., bool]:
            def wait_then_write(*args: Any, **kwargs: Any) -> bool:
                stall.reached.set()
                stall.outlasted |= not stall.release.wait(WAIT_S)
                return write(*args, **kwargs)

            return wait_then_write

        store.put, store.complete = stalled(store.put), stalled(store.complete)  # type: ignore[method-assign]
        try:
            yield stall
        finally:
            stall.release.set()
            del store.put, store.complete  # The class's own again.

    def settle(self) -> None:
        """Wait (bounded) until the tiers written from a queue (the file tier below RAM) hold
        what the puts so far gave them."""
        assert self.server is not None and self.server.store is not None, "not serving"
        assert self.server.store.settle(WAIT_S), f"the write queues still held values after {WAIT_S} s"

    # -- what it saw -------------------------------------------------------

    def status(self) -> GatewayStatus:
        assert self.server is not None, "not serving"
        return self.server.status()

    @property
    def lookups(self) -> int:
        """LOOKUP requests the gateway answered."""
        return self.status().store.hits.lookups

    @property
    def connects(self) -> int:
        """Client connections the gateway accepted."""
        return int(self.status().counters["clients_total"])

    @property
    def puts(self) -> int:
        """Values stored (every tier counts its own; this is the first tier's)."""
        return self.status().store.tiers[0].counters.puts
