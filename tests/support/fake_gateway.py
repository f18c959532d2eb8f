"""An in-memory stand-in for a gateway, for connector unit tests.

It speaks the part of `kvharbor.gateway.client.GatewayClient` that
`kvharbor.connector.link.CacheLink` uses (lookup, two-phase get and put), so
the connector's logic runs unchanged; the real gateway has its own tests and
the end-to-end tests run the two together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvharbor.gateway.client import GatewayUnavailable, GetBatch, PutBatch


class FakeGateway:
    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.failing = False
        """When True, every call fails the way a dead gateway does."""
        self.lookups: list[list[bytes]] = []
        self.puts: list[bytes] = []
        """Every key committed, in order (repeats included)."""
        self.connects = 0
        self._pending: dict[int, list[tuple[bytes, bytearray | None]]] = {}
        self._next = 1

    def connect(self, config: Any, client_name: str) -> FakeClient:
        self._check()
        self.connects += 1
        return FakeClient(self)

    def hold(self, keys: Sequence[bytes], value: bytes = b"\0") -> None:
        for key in keys:
            self.values[bytes(key)] = value

    def _check(self) -> None:
        if self.failing:
            raise GatewayUnavailable("gateway connection lost: connection closed after 0 of 16 bytes")

    def _batch(self) -> int:
        self._next += 1
        return self._next


class FakeClient:
    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway

    def lookup(self, keys: Sequence[bytes], chunk_tokens: int = 0) -> int:
        self.gateway._check()
        self.gateway.lookups.append([bytes(k) for k in keys])
        hits = 0
        for key in keys:
            if bytes(key) not in self.gateway.values:
                break
            hits += 1
        return hits

    def get(self, fingerprint: bytes, keys: Sequence[bytes]) -> GetBatch:
        self.gateway._check()
        views = []
        for key in keys:
            value = self.gateway.values.get(bytes(key))
            if value is None:
                break
            views.append(memoryview(bytearray(value)))
        return GetBatch(self.gateway._batch(), views)

    def release(self, batch: GetBatch) -> None:
        self.gateway._check()

    def prepare_put(self, fingerprint: bytes, items: Sequence[tuple[bytes, int]]) -> PutBatch:
        self.gateway._check()
        batch = self.gateway._batch()
        staged: list[tuple[bytes, bytearray | None]] = []
        for key, size in items:
            staged.append((bytes(key), None if bytes(key) in self.gateway.values else bytearray(size)))
        self.gateway._pending[batch] = staged
        return PutBatch(batch, [memoryview(buffer) if buffer is not None else None for _, buffer in staged])

    def commit_put(self, batch: PutBatch) -> int:
        self.gateway._check()
        stored = 0
        for key, buffer in self.gateway._pending.pop(batch.batch):
            if buffer is not None:
                self.gateway.values[key] = bytes(buffer)
                self.gateway.puts.append(key)
                stored += 1
        return stored

    def close(self) -> None:
        pass
