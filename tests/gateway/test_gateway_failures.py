"""Faults on either side of the transport: the gateway killed or hung, a client killed
mid-transfer, a second gateway, a full ring. Clients degrade with a `GatewayError`
and never anything else; the gateway frees what a dead client held and serves on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from gateway_harness import (
    FINGERPRINT,
    GatewayProcess,
    Lab,
    closing_client,
    fill,
    get_values,
    keys_of,
    put_values,
    value_for,
    wait_until,
)

from kvharbor.config import MIB
from kvharbor.gateway.client import GatewayUnavailable
from kvharbor.hal.extents import PAGE_BYTES

pytestmark = pytest.mark.timeout(120)


# -- the gateway dies or hangs ----------------------------------------------


def test_gateway_killed_between_prepare_and_commit(started: Callable[..., GatewayProcess]) -> None:
    gateway = started()
    with closing_client(gateway.client()) as client:
        items = [(key, 1 * MIB) for key in keys_of(4)]
        batch = client.prepare_put(FINGERPRINT, items)
        gateway.kill()
        # The segment stays mapped: writing into it after the gateway died is safe.
        fill(batch, items)
        with pytest.raises(GatewayUnavailable, match="connection lost"):
            client.commit_put(batch)
        assert client.down is not None
        with pytest.raises(GatewayUnavailable, match="does not reconnect"):
            client.lookup(keys_of(1))


def test_gateway_killed_during_a_stream_of_gets(lab: Lab, started: Callable[..., GatewayProcess]) -> None:
    gateway = started()
    items = [(key, 256 * 1024) for key in keys_of(8)]
    with closing_client(gateway.client()) as client:
        assert put_values(client, items) == len(items)
    # One streaming client in a thread here, one in a process of its own.
    worker = lab.worker("get-stream", str(gateway.config_path), *(f"{k.hex()}:{n}" for k, n in items))
    streaming = threading.Event()
    outcome: list[BaseException | str] = []

    def stream() -> None:
        with closing_client(gateway.client("stream")) as client:
            rounds = 0
            try:
                while True:
                    for value, (key, size) in zip(get_values(client, [k for k, _ in items]), items, strict=False):
                        assert value == value_for(key, size)
                    rounds += 1
                    if rounds == 3:
                        streaming.set()
            except BaseException as err:  # Judged below: only GatewayUnavailable is right.
                outcome.append(err)
                streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(30)
    assert worker.line() == "streaming"
    gateway.kill()
    thread.join(30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], GatewayUnavailable), outcome
    assert worker.line().startswith("gateway-error GatewayUnavailable")
    code, _, err = worker.finish()
    assert code == 0, err


def test_hung_gateway_fails_a_call_within_request_timeout(started: Callable[..., GatewayProcess]) -> None:
    gateway = started(request_timeout_ms=300, ring_wait_ms=100, progress_interval_ms=100)
    with closing_client(gateway.client()) as client:
        assert client.lookup(keys_of(1)) == 0
        os.kill(gateway.pid, signal.SIGSTOP)
        # Wait until every thread of it has stopped: the kernel reports it to its parent.
        _, status = os.waitpid(gateway.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        try:
            with pytest.raises(GatewayUnavailable, match=r"within 300 ms \(gateway.request_timeout_ms\)") as hang:
                client.lookup(keys_of(1))
            # The message says what the kernel saw: the request still queued, every thread stopped.
            said = str(hang.value)
            assert re.search(r"send queue [1-9]\d* B; receive queue 0 B", said), said
            assert re.search(rf"gateway pid {gateway.pid} threads Tx\d+ \[", said), said
            # Down for good: the late reply can never be mistaken for another request's.
            with pytest.raises(GatewayUnavailable, match="does not reconnect"):
                client.status()
        finally:
            os.kill(gateway.pid, signal.SIGCONT)


def slow_card_tiers(tmp_path: Path, write_s: float) -> list[dict[str, object]]:
    """One tier: a simulated card each of whose writes takes ``write_s`` of wall time."""
    params = tmp_path / "slow-card.yaml"
    params.write_text(yaml.safe_dump({"write_latency_s": write_s}))
    return [{"name": "card", "type": "nvme", "device": f"sim:{params}"}]


def test_one_write_longer_than_request_timeout_is_not_taken_for_a_hang(
    started: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """A commit of a single value whose write takes 1.5 s, against a 400 ms silence limit:
    no item completes to report, and the gateway's heartbeat keeps its client waiting."""
    gateway = started(
        tiers=slow_card_tiers(tmp_path, 1.5), request_timeout_ms=400, progress_interval_ms=100, ring_wait_ms=100
    )
    key = keys_of(1)
    with closing_client(gateway.client()) as client:
        assert put_values(client, [(key[0], 4096)]) == 1
        assert get_values(client, key) == [value_for(key[0], 4096)]


def test_a_request_past_request_max_ms_is_taken_for_hung(
    started: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """The heartbeat is bounded: a write that outlasts gateway.request_max_ms (a hung
    tier) loses its client, which gives up request_timeout_ms after the last report."""
    gateway = started(
        tiers=slow_card_tiers(tmp_path, 3.0),
        request_timeout_ms=400,
        progress_interval_ms=100,
        request_max_ms=800,
        ring_wait_ms=100,
    )
    with (
        closing_client(gateway.client()) as client,
        pytest.raises(GatewayUnavailable, match=r"did not answer PutCommit within 400 ms"),
    ):
        put_values(client, [(keys_of(1)[0], 4096)])
    wait_until(lambda: "past half of gateway.request_timeout_ms" in gateway.log(), "the watchdog's warning")


def test_client_does_not_reconnect_to_a_new_gateway(lab: Lab) -> None:
    """The restart rule: a client whose gateway died stays down, fast, even once a new
    gateway serves the same socket; only a new client (an engine restart) uses it."""
    config_path = lab.config()
    first = lab.gateway(config_path).start()
    with closing_client(first.client("old")) as old:
        put_values(old, [(keys_of(1)[0], 4096)])
        first.kill()
        with pytest.raises(GatewayUnavailable):
            old.lookup(keys_of(1))
        second = lab.gateway(config_path).start()
        for _ in range(3):
            with pytest.raises(GatewayUnavailable, match="does not reconnect"):
                old.lookup(keys_of(1))
        with closing_client(second.client("new")) as new:
            status = new.status()
            assert new.hello.gateway_pid == second.pid != first.pid
    assert status.counters["clients_total"] == 1, "the old client never came back"


# -- a client dies mid-transfer ----------------------------------------------


def test_client_killed_holding_a_put_frees_its_room(lab: Lab, started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=32)
    with closing_client(gateway.client("observer")) as observer:
        full = observer.status().shm.ring_bytes
        worker = lab.worker("hold-put", str(gateway.config_path), str(8 * MIB), "3")
        assert worker.line() == "prepared"
        held = observer.status().shm
        # Lent in the ring, or in place in the RAM tier: 24 MiB in flight either way,
        # and a page of the ring for the batch's completion marks.
        assert full - held.free_bytes + held.in_place_bytes == 24 * MIB + PAGE_BYTES
        worker.kill()
        wait_until(
            lambda: (shm := observer.status().shm).free_bytes == full and shm.in_place_bytes == 0,
            "the dead client's room freed",
        )
        status = observer.status()
        assert status.transfers_open == 0
        assert status.counters["clients_died_mid_transfer"] == 1
        # Its half-written values were never committed, nor marked: nothing of it is stored.
        assert observer.lookup([bytes([0]) * 16]) == 0
        assert status.counters["unmarked_dropped"] == 3
        # And the ring serves others at full size again.
        items = [(key, 8 * MIB) for key in keys_of(3, tag=7)]
        assert put_values(observer, items) == 3
        assert get_values(observer, [k for k, _ in items]) == [value_for(k, n) for k, n in items]
    assert "went away with 1 open transfer(s)" in gateway.log()


@pytest.mark.parametrize("first_tier", ["ram", "file"])
def test_client_killed_before_its_commit_has_its_marked_values_stored(
    lab: Lab, started: Callable[..., GatewayProcess], first_tier: str
) -> None:
    """A RAM tier in the segment lends each value its final place; a file tier, a ring extent."""
    tiers = {
        "ram": [{"name": "ram", "type": "ram", "capacity_gb": 0.25}],
        "file": [{"name": "local", "type": "file", "path": str(lab.tmp_path / "files"), "capacity_gb": 0.25}],
    }
    gateway = started(ring_mb=32, tiers=tiers[first_tier])
    size = 1 * MIB
    keys = [bytes([0xA0 + i]) * 16 for i in range(5)]
    with closing_client(gateway.client("observer")) as observer:
        full = observer.status().shm.ring_bytes
        worker = lab.worker("marked-put", str(gateway.config_path), str(size))
        assert worker.line() == "prepared"
        assert [observer.lookup([key]) for key in keys] == [0] * 5, "nothing is stored before the writer is gone"
        worker.kill()
        wait_until(
            lambda: (shm := observer.status().shm).free_bytes == full and shm.in_place_bytes == 0,
            "the dead client's room freed",
        )
        # The two values marked complete are stored, with their bytes; the half-written one,
        # the one damaged after its checksum and the one marked for another place are not.
        assert [observer.lookup([key]) for key in keys] == [1, 1, 0, 0, 0]
        assert get_values(observer, keys[:2]) == [value_for(key, size) for key in keys[:2]]
        counters = observer.status().counters
        assert (counters["marked_stored"], counters["marks_refused"], counters["unmarked_dropped"]) == (2, 2, 1)
        assert counters["clients_died_mid_transfer"] == 1
    assert "stored 2 value(s) it had marked complete, refused 2 mark(s)" in gateway.log()


def test_client_killed_holding_a_get_frees_its_room(lab: Lab, started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=32)
    items = [(key, 4 * MIB) for key in keys_of(4)]
    with closing_client(gateway.client("observer")) as observer:
        put_values(observer, items)
        full = observer.status().shm.ring_bytes
        worker = lab.worker("hold-get", str(gateway.config_path), *(k.hex() for k, _ in items))
        assert worker.line() == "holding 4"
        held = observer.status().shm
        # Hits come from the ring (copied there) or in place from the RAM tier (pinned).
        assert held.free_bytes < full or held.pinned == len(items)
        worker.kill()
        wait_until(
            lambda: observer.status().shm.free_bytes == full and observer.status().shm.pinned == 0,
            "the dead client's room freed and its pins released",
        )
        assert get_values(observer, [k for k, _ in items]) == [value_for(k, n) for k, n in items]


# -- one gateway per socket --------------------------------------------------


def test_second_gateway_on_the_same_socket_is_refused(lab: Lab) -> None:
    config_path = lab.config()
    first = lab.gateway(config_path).start()
    second = subprocess.run(
        [sys.executable, "-m", "kvharbor", "gateway", "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 2
    assert f"another gateway (pid {first.pid}) already serves {first.config.gateway.socket}" in second.stderr
    assert "Traceback" not in second.stderr
    # The refused one removed nothing of the first: its socket still answers.
    with closing_client(first.client()) as client:
        assert client.hello.gateway_pid == first.pid
        assert client.lookup(keys_of(1)) == 0
        assert Path(client.hello.shm_path).exists()


# -- backpressure ------------------------------------------------------------


def test_full_ring_skips_puts_and_counts_them(lab: Lab, started: Callable[..., GatewayProcess]) -> None:
    # A file tier: its hits travel through the ring (RAM-tier hits are served in place).
    tier = {"name": "local", "type": "file", "path": str(lab.tmp_path / "files"), "capacity_gb": 1}
    gateway = started(ring_mb=4, ring_wait_ms=50, tiers=[tier])
    stored_key = keys_of(1, tag=4)[0]
    with closing_client(gateway.client("a")) as a, closing_client(gateway.client("b")) as b:
        assert put_values(b, [(stored_key, 600 * 1024)]) == 1
        # Larger than the whole ring: skipped at once, not an exception.
        big = a.prepare_put(FINGERPRINT, [(keys_of(1)[0], 8 * MIB)])
        assert big.views == [None]
        assert a.commit_put(big) == 0
        # A holds 3 MiB of the 4; B's 2 MiB waits ring_wait_ms, then is skipped.
        held = a.prepare_put(FINGERPRINT, [(keys_of(1, tag=1)[0], 3 * MIB)])
        assert held.views[0] is not None
        skipped = b.prepare_put(FINGERPRINT, [(keys_of(1, tag=2)[0], 2 * MIB), (keys_of(1, tag=3)[0], 512 * 1024)])
        assert skipped.views[0] is None, "no room for 2 MiB"
        assert skipped.views[1] is not None, "a smaller value still fits"
        # A get that finds the ring full (512 KiB left) is a miss, counted too.
        assert b.lookup([stored_key]) == 1
        assert b.get(FINGERPRINT, [stored_key]).views == []
        b.commit_put(skipped)
        a.commit_put(held)
        counters = a.status().counters
        assert counters["ring_full"] == 3
        # Room again: the same put now goes through.
        assert put_values(b, [(keys_of(1, tag=2)[0], 2 * MIB)]) == 1
