"""The RAM refill (``storage.refill_ram``): a gateway started over a warm file tier copies
its newest objects into its empty RAM tier in the background, verified, and stops cleanly."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import (
    GatewayProcess,
    Lab,
    closing_client,
    get_values,
    keys_of,
    put_values,
    value_for,
    wait_until,
)

from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.refill import RefillStatus
from kvharbor.cache.tier import TierStatus
from kvharbor.config import GIB, MIB
from kvharbor.hal.extents import round_up

pytestmark = pytest.mark.timeout(90)

VALUE_BYTES = 100_000
RAM_OBJECTS = 10
"""How many values the RAM tier's budget holds (headers included, in the whole pages each takes)."""


def tiers(tmp_path: Path, value_bytes: int = VALUE_BYTES) -> list[dict[str, Any]]:
    """A RAM tier of `RAM_OBJECTS` values of ``value_bytes`` over a file tier that holds many."""
    ram_gb = RAM_OBJECTS * round_up(value_bytes + HEADER_BYTES) / GIB
    return [
        {"name": "ram", "type": "ram", "capacity_gb": ram_gb},
        {"name": "local", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 1, "fsync": False},
    ]


def tier_status(gateway: GatewayProcess, name: str) -> TierStatus:
    with closing_client(gateway.client()) as client:
        status = client.status()
    return next(t for t in status.store.tiers if t.name == name)


def refill_status(gateway: GatewayProcess) -> RefillStatus:
    with closing_client(gateway.client()) as client:
        refill = client.status().refill
    return refill


def wait_refilled(gateway: GatewayProcess) -> RefillStatus:
    wait_until(lambda: refill_status(gateway).state != "running", "the refill ends")
    return refill_status(gateway)


def store_then_restart(
    lab: Lab, keys: list[bytes], storage: dict[str, Any], reused: list[bytes], value_bytes: int = VALUE_BYTES
) -> GatewayProcess:
    """Put ``keys`` in order, read ``reused`` one by one (now the most recent), stop the
    gateway and start a new one on the same file tier with ``storage`` settings."""
    first = lab.gateway(lab.config(tiers=tiers(lab.tmp_path, value_bytes), storage={"refill_ram": False})).start()
    with closing_client(first.client()) as client:
        for key in keys:
            assert put_values(client, [(key, value_bytes)]) == 1
        for key in reused:
            assert get_values(client, [key]) == [value_for(key, value_bytes)]
    assert first.stop() == 0
    return lab.gateway(lab.config("again", tiers=tiers(lab.tmp_path, value_bytes), storage=storage)).start()


def test_the_most_recent_objects_that_fit_come_back_into_ram(lab: Lab) -> None:
    keys = keys_of(3 * RAM_OBJECTS)
    reused = keys[:3]
    gateway = store_then_restart(lab, keys, {"refill_ram": True}, reused)
    refill = wait_refilled(gateway)
    assert refill.state == "done" and refill.done
    assert refill.objects == RAM_OBJECTS and refill.bytes == RAM_OBJECTS * VALUE_BYTES
    assert refill.damaged == 0
    # Newest first: the three read last, then the last ones written, as many as fit.
    expected = [*reversed(reused), *reversed(keys[-(RAM_OBJECTS - 3) :])]
    assert tier_status(gateway, "ram").keys == RAM_OBJECTS
    with closing_client(gateway.client()) as client:
        for key in expected:
            assert get_values(client, [key]) == [value_for(key, VALUE_BYTES)]
        assert tier_status(gateway, "ram").counters.hits == RAM_OBJECTS
        assert tier_status(gateway, "local").counters.hits == 0
        # One that did not fit is on disk only.
        older = keys[3]
        assert get_values(client, [older]) == [value_for(older, VALUE_BYTES)]
        assert tier_status(gateway, "local").counters.hits == 1
    log = gateway.log()
    assert log.count("refilling RAM tier 'ram'") == 1, log
    assert f"RAM tier 'ram' refill done: {RAM_OBJECTS} objects, {RAM_OBJECTS * VALUE_BYTES} bytes" in log, log
    assert gateway.stop() == 0


def test_a_damaged_object_on_disk_is_not_promoted_and_is_counted(lab: Lab) -> None:
    keys = keys_of(4, tag=1)
    gateway = store_then_restart(lab, keys, {"refill_ram": True}, [])
    assert gateway.stop() == 0
    damaged = keys[1]
    (path,) = [p for p in (lab.tmp_path / "files").rglob("*") if p.is_file() and p.name.startswith(damaged.hex())]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # A payload byte: the header still parses, the checksum does not match.
    path.write_bytes(bytes(raw))
    again = lab.gateway(lab.config("third", tiers=tiers(lab.tmp_path), storage={"refill_ram": True})).start()
    refill = wait_refilled(again)
    assert refill.done and refill.objects == 3 and refill.damaged == 1
    assert tier_status(again, "local").counters.corrupt == 1
    assert tier_status(again, "ram").keys == 3
    with closing_client(again.client()) as client:
        assert client.lookup([damaged]) == 0  # Dropped from disk, never copied.
        for key in keys[:1] + keys[2:]:
            assert get_values(client, [key]) == [value_for(key, VALUE_BYTES)]
    assert tier_status(again, "local").counters.hits == 0
    assert "RAM tier 'ram' refill done: 3 objects" in again.log() and "(1 damaged, dropped)" in again.log()


def test_refill_off_promotes_nothing(lab: Lab) -> None:
    keys = keys_of(4, tag=2)
    gateway = store_then_restart(lab, keys, {"refill_ram": False}, [])
    refill = refill_status(gateway)
    assert refill.state == "off" and refill.objects == 0 and not refill.done
    assert tier_status(gateway, "ram").keys == 0
    assert "kvharbor: refilling" not in gateway.log() and "refill done" not in gateway.log()
    with closing_client(gateway.client()) as client:
        assert get_values(client, keys) == [value_for(key, VALUE_BYTES) for key in keys]
    assert tier_status(gateway, "local").counters.hits == len(keys)


def test_a_stop_during_the_refill_is_clean_and_engines_win(lab: Lab) -> None:
    keys = keys_of(2 * RAM_OBJECTS, tag=3)
    # 1 MiB/s and values of 1 MiB: one value a second, ten seconds for the RAM tier, so
    # the refill is surely still running below (the pace is a wait on the stop event).
    value_bytes = MIB
    storage = {"refill_ram": True, "refill_ram_mb_per_s": 1}
    gateway = store_then_restart(lab, keys, storage, [], value_bytes)
    wait_until(lambda: refill_status(gateway).objects >= 1, "the refill copies")
    fresh = keys_of(1, tag=4)[0]
    with closing_client(gateway.client()) as client:
        assert put_values(client, [(fresh, value_bytes)]) == 1
        # The refill stores behind what engines store, and only into free room: never over it.
        wait_until(lambda: refill_status(gateway).objects >= 2, "the refill goes on")
        assert get_values(client, [fresh]) == [value_for(fresh, value_bytes)]
        assert tier_status(gateway, "ram").counters.hits == 1
    assert refill_status(gateway).state == "running"
    assert gateway.process is not None
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.wait() == 0
    log = gateway.log()
    assert "RAM tier 'ram' refill stopped at gateway stop" in log, log
    assert "kvharbor: gateway stopped" in log and "Traceback" not in log, log
