"""Asynchronous writes to a file tier through a real gateway process.

First the queue's numbers: puts through a real client, the queue written out, the
status and ``/metrics`` read over their real paths and compared. Then the file tier
is held up for real: the test takes the write lock of the tier's own SQLite manifest
from this process (``BEGIN IMMEDIATE``), so the gateway's queue worker waits in its
index admission (SQLite's busy wait, up to the manifest's 10 s) while the puts return
from the RAM tier. The gateway is stopped with SIGTERM; once it says it writes its
queue out, the lock is let go, and a new gateway finds every value on the file tier.
(While the worker waits it holds the manifest's connection, so nothing that reads the
file tier's index, a status for one, is asked then.)
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import FINGERPRINT, WAIT_S, Lab, closing_client, get_values, put_values, value_for, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvharbor.cache.assembly import open_store
from kvharbor.cache.manifest import MANIFEST_FILE
from kvharbor.cache.tier import TierStatus
from kvharbor.config import load_config
from kvharbor.gateway.client import GatewayClient
from kvharbor.gateway.server import Gateway

pytestmark = pytest.mark.timeout(120)

SIZE = 100_000
COUNT = 5
LINGER_S = 3.0
"""Long enough for this test's client to attach after the start (the countdown runs from it)."""


def tiers(root: Path) -> list[dict[str, object]]:
    return [
        {"name": "ram", "type": "ram", "capacity_gb": 0.05},
        {"name": "local", "type": "file", "path": str(root / "files"), "capacity_gb": 0.05, "async_writes": True},
    ]


def scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, sample.labels.get("tier", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@contextlib.contextmanager
def manifest_locked(tier_root: Path) -> Iterator[None]:
    db = sqlite3.connect(tier_root / MANIFEST_FILE, isolation_level=None, timeout=10)
    try:
        db.execute("BEGIN IMMEDIATE")
        yield
    finally:
        db.close()  # Ends the transaction: the gateway's writer goes on.


def test_the_queue_s_numbers_and_a_sigterm_that_writes_the_queue_out(lab: Lab) -> None:
    config = lab.config(tiers=tiers(lab.tmp_path), storage={"refill_ram": False, "async_shutdown_deadline_s": 60})
    gateway = lab.gateway(config).start()
    first = [(bytes([7, i]) * 8, SIZE) for i in range(COUNT)]
    held = [(bytes([8, i]) * 8, SIZE) for i in range(COUNT)]
    with closing_client(gateway.client()) as client:
        assert put_values(client, first) == COUNT

        def local() -> TierStatus:
            return next(t for t in client.status().store.tiers if t.name == "local")

        wait_until(lambda: local().counters.async_flushed == COUNT, "the queue written out")
        status = client.status()
    tier = next(t for t in status.store.tiers if t.name == "local")
    assert tier.write_queue is not None and (tier.write_queue.depth, tier.write_queue.nbytes) == (0, 0)
    assert (tier.counters.puts, tier.counters.async_dropped) == (COUNT, 0)
    assert status.metrics_url is not None
    samples = scrape(status.metrics_url)
    assert samples["kvharbor_tier_async_flushed_total", "local"] == COUNT
    assert samples["kvharbor_tier_async_dropped_total", "local"] == 0
    assert samples["kvharbor_tier_async_queue_depth", "local"] == 0
    assert ("kvharbor_tier_async_queue_depth", "ram") not in samples, "the first tier is written at once"

    with manifest_locked(lab.tmp_path / "files"):
        with closing_client(gateway.client()) as client:
            assert put_values(client, held) == COUNT  # Answered from the RAM tier, the file tier held.
        assert gateway.process is not None
        gateway.process.terminate()
        wait_until(lambda: "writing out queued writes" in gateway.log(), "the stop writing the queue out")
    assert gateway.wait() == 0
    log = gateway.log()
    assert f"(local {COUNT})" in log and "not written within" not in log, log

    again = lab.gateway(config).start()  # RAM empty, no refill: only the file tier can answer.
    keys = [key for key, _ in first + held]
    with closing_client(again.client()) as client:
        assert client.lookup(keys) == 2 * COUNT
        assert get_values(client, keys) == [value_for(key, size) for key, size in first + held]


def test_an_embedded_gateway_s_linger_exit_writes_the_queue_out_first(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    """The end of ``gateway.linger_s`` stops the gateway the same way a signal does: the
    queue is written out before the tiers close. In this process (its log at hand), with
    nothing that reads the file tier's index while the manifest is held (no dashboard)."""
    path = lab.config(
        tiers=tiers(lab.tmp_path), storage={"refill_ram": False}, dashboard={"enabled": False}, mode="embedded"
    )
    config = load_config(path, environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    server = Gateway(config, linger_s=LINGER_S)
    server.start()
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    items = [(bytes([9, i]) * 8, SIZE) for i in range(COUNT)]
    try:
        with caplog.at_level(logging.INFO), manifest_locked(lab.tmp_path / "files"):
            with closing_client(GatewayClient.connect(config.gateway, "engine")) as client:
                assert put_values(client, items) == COUNT
            # Detached: the countdown runs, then the stop writes the queue out.
            wait_until(lambda: any("writing out queued writes" in r.getMessage() for r in caplog.records), "the flush")
        serving.join(WAIT_S)
        assert not serving.is_alive(), "the lingering gateway did not stop"
    finally:
        server.stop()
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "idle for" in said and f"(local {COUNT})" in said and "not written within" not in said, said
    store = open_store(config)  # The file tier as the next gateway finds it.
    try:
        local = store.tiers[1]
        assert [bytes(local.read(key, FINGERPRINT) or b"") for key, _ in items] == [
            value_for(key, size) for key, size in items
        ]
    finally:
        store.close()
