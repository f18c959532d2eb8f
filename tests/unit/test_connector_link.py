"""`CacheLink`: a failing gateway turns the cache off for the whole rank, once; a refusal costs one request."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from kvharbor.connector.fanout import Fanout
from kvharbor.connector.link import CacheLink, RankSwitch
from kvharbor.gateway.client import GatewayRefused
from kvharbor.gateway.protocol import ErrorCode, LookupOk
from kvharbor.hal.checksum import checksum
from tests.support.real_gateway import RealGateway

OFF = "external KV cache turned off on this rank"
KEYS = [bytes([i]) * 16 for i in range(3)]


def links(gateway: RealGateway, count: int = 2) -> list[CacheLink]:
    """Links of one rank, through the real client (the default connect in service mode)."""
    switch = RankSwitch()
    return [CacheLink(gateway.config, f"link {i}", switch=switch) for i in range(count)]


def test_one_links_failure_turns_off_every_link_of_the_rank_and_says_so_once(
    real_gateway: RealGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = real_gateway
    gateway.hold(KEYS)
    load, save = links(gateway)
    assert load.lookup(KEYS, 256).hits == 3 and save.start()
    gateway.stop()
    with caplog.at_level(logging.ERROR, "kvharbor"):
        assert load.lookup(KEYS, 256).hits == 0  # A miss, not an exception.
        assert save.store(b"f" * 16, [(KEYS[0], 8)], lambda i, view: None) == 0
    assert load.is_off and save.is_off
    assert caplog.text.count(OFF) == 1
    assert "connection lost" in load.off_reason
    # From now on every call answers at once, without touching the gateway, even one serving again.
    gateway.start()
    connects = gateway.connects
    assert load.lookup(KEYS, 256).hits == 0 and load.load(b"f" * 16, KEYS, lambda i, v: None) == 0
    assert gateway.connects == connects and save.counters.off == 1


def test_a_gateway_that_is_not_there_turns_the_cache_off_at_start(real_gateway: RealGateway) -> None:
    gateway = real_gateway
    gateway.stop()
    [link] = links(gateway, 1)
    assert not link.start()
    assert link.is_off and link.counters.off == 1


def test_a_refusal_costs_only_that_request(real_gateway: RealGateway, caplog: pytest.LogCaptureFixture) -> None:
    [link] = links(real_gateway, 1)
    link.start()

    def refuse(*args: object) -> LookupOk:
        raise GatewayRefused(ErrorCode.BUSY, "ring full")

    client = link._client
    assert client is not None
    client.probe = refuse  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, "kvharbor"):
        assert link.lookup(KEYS, 256).hits == 0
        assert link.lookup(KEYS, 256).hits == 0
    assert not link.is_off
    assert link.counters.refused == 2
    assert caplog.text.count("gateway refused a request") == 1


def test_links_to_different_gateways_do_not_share_fate() -> None:
    assert RankSwitch.for_gateway("/run/a.sock") is RankSwitch.for_gateway("/run/a.sock")
    assert RankSwitch.for_gateway("/run/a.sock") is not RankSwitch.for_gateway("/run/b.sock")


def test_a_landing_is_stored_if_its_writer_dies_and_may_be_committed_after_a_later_one(
    real_gateway: RealGateway,
) -> None:
    """`CacheLink.land` leaves its values marked complete in shared memory: the gateway stores
    them if the link goes away before `commit`, and a later landing on the same link may be
    committed first (a saver lands a step that waits ahead of the commits queued before it)."""
    [link] = links(real_gateway, 1)
    first, second = link.land(b"f" * 16, [(KEYS[0], 64)], fill), link.land(b"f" * 16, [(KEYS[1], 64)], fill)
    assert (first.lent_bytes, first.no_room) == (64, 0)
    assert link.commit(second) == 1 and link.commit(first) == 1
    assert real_gateway.holds(KEYS[:2]) == 2
    dying = link.land(b"f" * 16, [(KEYS[2], 64)], fill)
    assert dying.batch is not None
    transfers = real_gateway.server.transfers if real_gateway.server is not None else None
    assert transfers is not None
    stored_marked, real_commit_marked = threading.Event(), transfers.commit_marked

    def commit_marked(batch: Any) -> Any:
        try:
            return real_commit_marked(batch)
        finally:
            stored_marked.set()

    transfers.commit_marked = commit_marked  # type: ignore[method-assign]
    link.close()  # Its writer goes away before the commit.
    assert stored_marked.wait(30)
    assert real_gateway.holds(KEYS) == 3


def fill(i: int, view: memoryview) -> None:
    view[:] = bytes([i + 1]) * view.nbytes


def test_fills_spread_over_a_fanout_are_each_stored_and_marked(real_gateway: RealGateway) -> None:
    """Two fills at once (each waits for the other), every value stored with its own bytes."""
    [link] = links(real_gateway, 1)
    link.start()
    fanout = Fanout(2, "test-fill")
    both = threading.Barrier(2, timeout=10)
    items = [(key, 4096) for key in KEYS[:2]]

    def fill(i: int, view: memoryview) -> int:
        both.wait()  # Passed only when the other value's fill runs at the same time.
        view[:] = bytes([i + 7]) * view.nbytes
        return checksum(view)

    assert link.store(b"f" * 16, items, fill, fanout=fanout) == 2
    fanout.close()
    read: dict[int, bytes] = {}
    assert link.load(b"f" * 16, KEYS[:2], lambda i, view: read.__setitem__(i, bytes(view))) == 2
    assert read == {0: bytes([7]) * 4096, 1: bytes([8]) * 4096}
