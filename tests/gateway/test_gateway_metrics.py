"""The gateway's Prometheus metrics, read as a scraper reads them: a real gateway (in this
process, so its registry is at hand) serving real clients over its socket and shared
memory, its registry rendered with ``generate_latest`` and parsed back with
prometheus-client's own parser. Values must move exactly as the requests made them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from gateway_harness import FINGERPRINT, closing_client, get_values, put_values, value_for, wait_until
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvharbor import __version__
from kvharbor.gateway import protocol as p
from kvharbor.gateway.client import GatewayRefused
from kvharbor.hal.sim.control import write_control
from tests.support.damage import damage_file_objects
from tests.support.real_gateway import RealGateway

pytestmark = pytest.mark.timeout(120)

SIZE = 100_000
RAM_GB = 1 / 1024
"""1 MiB: ten values fill it, so a few more evict."""
CHUNK_TOKENS = 16

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(gateway: RealGateway) -> Samples:
    assert gateway.server is not None
    text = generate_latest(gateway.server.metrics.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; a series that is not there fails the test (KeyError)."""
    return samples[name, frozenset(labels.items())]


def op(samples: Samples, tier: str, operation: str, outcome: str) -> float:
    return value(samples, "kvharbor_tier_operations_total", tier=tier, op=operation, outcome=outcome)


def items(tag: int, n: int) -> list[tuple[bytes, int]]:
    return [(bytes([tag, i]) * 8, SIZE) for i in range(n)]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[RealGateway]:
    """RAM (1 MiB) over a file tier, write-through."""
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": RAM_GB},
        {"name": "files", "type": "file", "path": str(tmp_path / "files"), "capacity_gb": 0.25},
    ]
    served = RealGateway(tmp_path / "gateway", tiers=tiers, storage={"refill_ram": False}).start()
    yield served
    served.close()


def test_lookups_puts_gets_evictions_and_corrupt_objects_move_their_series(
    gateway: RealGateway, tmp_path: Path
) -> None:
    before = scrape(gateway)
    assert value(before, "kvharbor_gateway_info", release=__version__, protocol=str(p.PROTOCOL_VERSION)) == 1
    assert value(before, "kvharbor_lookups_total") == 0 and value(before, "kvharbor_clients_attached") == 0
    assert value(before, "kvharbor_tier_capacity_bytes", tier="ram") == RAM_GB * 2**30
    assert value(before, "kvharbor_errors_total", kind="UNKNOWN_BATCH") == 0, "every kind is a series from the start"
    first = items(1, 4)
    keys = [key for key, _ in first]
    with closing_client(gateway.client()) as client:
        assert value(scrape(gateway), "kvharbor_clients_attached") == 1
        # A miss, then a put, then a hit: in full-chunk tokens.
        assert client.lookup(keys, CHUNK_TOKENS) == 0
        assert put_values(client, first) == 4
        assert client.lookup(keys, CHUNK_TOKENS) == 4
        assert get_values(client, keys) == [value_for(k, s) for k, s in first]
        gateway.settle()  # The file tier is written from its queue.
        after = scrape(gateway)
        assert value(after, "kvharbor_lookups_total") == 2
        assert value(after, "kvharbor_lookup_tokens_total") == 2 * 4 * CHUNK_TOKENS
        assert value(after, "kvharbor_hit_tokens_total") == 4 * CHUNK_TOKENS
        assert value(after, "kvharbor_bytes_in_total") == value(after, "kvharbor_bytes_out_total") == 4 * SIZE
        for tier in ("ram", "files"):
            assert op(after, tier, "put", "ok") == 4, tier
        assert op(after, "ram", "get", "ok") == 4 and op(after, "files", "get", "ok") == 0
        assert value(after, "kvharbor_requests_total", type="lookup") == 2
        assert value(after, "kvharbor_requests_total", type="put_commit") == 1
        assert value(after, "kvharbor_request_duration_seconds_count", type="put_commit") == 1
        assert value(after, "kvharbor_tier_operation_duration_seconds_count", tier="files", op="put") == 4
        assert value(after, "kvharbor_tier_objects", tier="ram") == 4

        # More than RAM holds: the first values are evicted from it, still on files.
        for tag in itertools.islice(itertools.count(2), 4):
            assert put_values(client, items(tag, 4)) == 4
        gateway.settle()
        full = scrape(gateway)
        evicted = value(full, "kvharbor_tier_evictions_total", tier="ram")
        assert evicted >= 4 and value(full, "kvharbor_tier_evictions_total", tier="files") == 0
        assert value(full, "kvharbor_tier_evicted_bytes_total", tier="ram") >= evicted * SIZE
        assert value(full, "kvharbor_tier_used_bytes", tier="ram") <= RAM_GB * 2**30
        assert value(full, "kvharbor_tier_objects", tier="files") == 20

        # A damaged file object is a miss, counted once, and dropped.
        assert damage_file_objects(tmp_path / "files", only={keys[0]}) == 1
        assert get_values(client, keys[:1]) == []
        damaged = scrape(gateway)
        assert value(damaged, "kvharbor_tier_corrupt_objects_total", tier="files") == 1
        assert op(damaged, "files", "get", "corrupt") == 1
        assert value(damaged, "kvharbor_tier_objects", tier="files") == 19

        # A refused request: counted by kind, and as a request served.
        batch = client.get(FINGERPRINT, keys[1:2])
        client.release(batch)
        with pytest.raises(GatewayRefused, match="UNKNOWN_BATCH"):
            client.release(batch)
        refused = scrape(gateway)
        assert value(refused, "kvharbor_errors_total", kind="UNKNOWN_BATCH") == 1
        assert value(refused, "kvharbor_requests_total", type="release") == 2 + 2, "two by get_values before"

        # The status reads the same numbers.
        status = client.status()
        assert status.counters["get_bytes"] == value(refused, "kvharbor_bytes_out_total")
        assert status.rejected == {"UNKNOWN_BATCH": 1}
        assert status.store.hits.hit_tokens == value(refused, "kvharbor_hit_tokens_total")
        ram, files = status.store.tiers
        assert ram.counters.evictions == value(refused, "kvharbor_tier_evictions_total", tier="ram")
        assert files.counters.corrupt == 1 and files.keys == value(refused, "kvharbor_tier_objects", tier="files")
    wait_until(lambda: value(scrape(gateway), "kvharbor_clients_attached") == 0, "the client counted out")


def test_a_client_gone_with_a_put_open_is_an_unclean_detach(gateway: RealGateway) -> None:
    with closing_client(gateway.client("observer")) as observer:
        vanishing = gateway.client("vanishing")
        batch = vanishing.prepare_put(FINGERPRINT, items(9, 3))
        for view, (key, size) in zip(batch.views, items(9, 3), strict=True):
            assert view is not None
            view[:] = value_for(key, size)
        batch.mark(0)  # One value marked complete: stored from its mark when the client is gone.
        vanishing.close()
        wait_until(lambda: value(scrape(gateway), "kvharbor_client_detaches_unclean_total") == 1, "the detach")
        after = scrape(gateway)
        assert value(after, "kvharbor_marked_values_stored_total") == 1
        assert value(after, "kvharbor_errors_total", kind="unmarked_dropped") == 2
        assert value(after, "kvharbor_clients_attached") == 1, "the observer only"
        assert observer.status().counters["clients_died_mid_transfer"] == 1


def test_a_card_tier_shows_its_sensors_and_its_breaker(tmp_path: Path) -> None:
    control = tmp_path / "card-control.yaml"
    params = tmp_path / "card.yaml"
    params.write_text(yaml.safe_dump({"capacity_bytes": 8 << 20, "control_path": str(control), "control_poll_s": 0.01}))
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": RAM_GB},
        {"name": "card", "type": "nvme", "device": f"sim:{params}"},
    ]
    gateway = RealGateway(
        tmp_path / "gateway", tiers=tiers, card={"key_eviction": False}, storage={"refill_ram": False}
    ).start()
    try:
        assert gateway.server is not None and gateway.server.store is not None
        device = gateway.server.store.tiers[1].device
        card = device.card_status()  # type: ignore[attr-defined]
        ready = scrape(gateway)
        assert value(ready, "kvharbor_card_temperature_celsius", tier="card") == card.temperature_c
        assert value(ready, "kvharbor_card_supercap_ok", tier="card") == 1
        assert value(ready, "kvharbor_card_capacity_usage_level", tier="card") == 0
        assert value(ready, "kvharbor_tier_breaker_open", tier="card") == 0
        assert value(ready, "kvharbor_tier_up", tier="card") == value(ready, "kvharbor_tier_up", tier="ram") == 1
        assert ("kvharbor_card_temperature_celsius", frozenset({("tier", "ram")})) not in ready, "no card there"

        fresh = (bytes([7, i]) * 8 for i in range(200))
        with closing_client(gateway.client()) as client:
            write_control(str(control), target_up=False)
            # The next value written through finds the target gone: the breaker opens at once.
            wait_until(
                lambda: (
                    put_values(client, [(next(fresh), SIZE)]) == 1
                    and value(scrape(gateway), "kvharbor_tier_breaker_open", tier="card") == 1
                ),
                "the card's breaker open",
            )
            down = scrape(gateway)
            assert op(down, "card", "put", "error") >= 1
            assert put_values(client, [(next(fresh), SIZE)]) == 1, "RAM serves on"
            assert op(scrape(gateway), "card", "put", "skipped") > op(down, "card", "put", "skipped")
            assert value(down, "kvharbor_tier_breaker_open", tier="ram") == 0
    finally:
        gateway.close()
