"""A real gateway with a simulated card tier, end to end: put, get, card full, target down and back.

The gateway runs in its own process with a RAM tier and a card tier (``device:
sim:PARAMS.yaml``, scaled real time). Faults reach its card through the card's
control file, as a scenario's would; every wait is on a real request's answer or
a line of the gateway's log, bounded by the harness's deadline.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from gateway_harness import Lab, closing_client, get_values, put_values, value_for, wait_until

from kvharbor.cache.tier import TierStatus
from kvharbor.cli import main
from kvharbor.gateway.status import GatewayStatus
from kvharbor.hal.base import CapacityUsage
from kvharbor.hal.sim.control import write_control

pytestmark = pytest.mark.timeout(120)

VALUE_BYTES = 100_000
CARD_BYTES = 2 << 20


def card_gateway_config(lab: Lab, tmp_path: Path, **breaker: float) -> tuple[Path, str]:
    control = str(tmp_path / "card-control.yaml")
    params = tmp_path / "card.yaml"
    params.write_text(yaml.safe_dump({"capacity_bytes": CARD_BYTES, "control_path": control, "control_poll_s": 0.01}))
    path = lab.config(
        tiers=[
            {"name": "ram", "type": "ram", "capacity_gb": 1 / 1024},
            {"name": "card", "type": "nvme", "device": f"sim:{params}"},
        ]
    )
    document = yaml.safe_load(path.read_text())
    document["card"] = {"key_eviction": False}
    document["storage"]["backpressure"] = {
        "circuit_breaker": {"cooldown_s": 0.2, "probe_backoff_factor": 2.0, "probe_interval_max_s": 1.0, **breaker}
    }
    path.write_text(yaml.safe_dump(document))
    return path, control


def card_cli(view: str, config_path: Path) -> dict[str, Any]:
    """``kvharbor card VIEW --config FILE --json``, run as a user runs it."""
    shown = subprocess.run(
        [sys.executable, "-m", "kvharbor", "card", view, "--config", str(config_path), "--json"],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    answer: dict[str, object] = json.loads(shown.stdout)
    return answer


def card_status(status: GatewayStatus) -> TierStatus:
    (card,) = [tier for tier in status.store.tiers if tier.name == "card"]
    return card


def test_a_gateway_serves_from_a_simulated_card_through_full_and_a_target_outage(lab: Lab, tmp_path: Path) -> None:
    config_path, control = card_gateway_config(lab, tmp_path)
    gateway = lab.gateway(config_path).start()
    first = [(bytes([1, i]) * 8, VALUE_BYTES) for i in range(5)]
    more = [(bytes([2, i]) * 8, VALUE_BYTES) for i in range(30)]
    with closing_client(gateway.client()) as client:
        # Put and get: stored in both tiers (write-through), read back whole.
        assert put_values(client, first) == len(first)
        assert card_status(client.status()).counters.puts == len(first)
        # Card full (key eviction off; the tier's own budget never fills the card, something
        # else on it does): the card refuses, RAM keeps taking values (in batches that fit it).
        write_control(control, fill_ratio=1.0)
        for start in range(0, len(more), 5):
            assert put_values(client, more[start : start + 5]) == 5
        status = client.status()
        card = card_status(status)
        assert card.counters.full > 0 and card.device_statuses["1/81h"] == card.counters.full
        assert card.health == "degraded" and "CapacityUsage CRITICAL" in card.health_detail
        # The card section of the status: the card's own figures, and kvharbor status shows them.
        assert status.cards["card"].capacity_usage is CapacityUsage.CRITICAL
        shown = subprocess.run(
            [sys.executable, "-m", "kvharbor", "status", "--config", str(config_path)], capture_output=True, text=True
        )
        assert shown.returncode == 0 and "CapacityUsage CRITICAL" in shown.stdout, shown.stderr
        assert "card [nvme]: degraded: " in shown.stdout
        # kvharbor card asks the gateway that holds the card (its simulated card lives there).
        events = card_cli("events", config_path)
        assert [e["code"] for e in events["events"]].count(3002) >= 1, events
        usage = card_cli("usage", config_path)
        assert usage["capacity_usage"] == "CRITICAL" and usage["key_eviction"] is False
        assert card_cli("status", config_path)["health"] == "degraded"
        # The first values left the small RAM tier long ago: the card serves them.
        keys = [key for key, _ in first]
        assert get_values(client, keys) == [value_for(k, s) for k, s in first]
        assert card_status(client.status()).counters.hits >= 1

        # The remote target stops answering: the tier is unavailable at the next value
        # written through to it, and the gateway serves on from RAM.
        fresh = itertools.count()

        def put_one() -> bool:
            return put_values(client, [(next(fresh).to_bytes(16, "big"), VALUE_BYTES)]) == 1

        write_control(control, target_up=False)
        wait_until(lambda: put_one() and "tier 'card' unavailable" in gateway.log(), "the card tier unavailable")
        assert card_status(client.status()).breaker == "open"

        # It answers again (still full): a probe finds it, the tier resumes without a restart.
        write_control(control, target_up=True)
        wait_until(lambda: put_one() and "tier 'card' answers again" in gateway.log(), "the card tier resumed")
        card = card_status(client.status())
        assert card.breaker == "closed" and card.device_statuses["3/70h"] >= 1
        for _ in range(12):  # Push the first values out of RAM: only the card has them now.
            assert put_one()
        hits = card_status(client.status()).counters.hits
        assert get_values(client, keys) == [value_for(k, s) for k, s in first]
        assert card_status(client.status()).counters.hits > hits, "served by the card again"
    log = gateway.log()
    assert log.count("tier 'card' unavailable") == 1 and log.count("tier 'card' answers again") == 1
    assert log.count("tier 'card' is full") == 1, "said once, not per refused value"
    assert "3/70h" in log and "87h" not in log, "a lost path is said once; misses never"
    assert gateway.stop() == 0


def test_a_target_that_comes_back_with_no_traffic_is_found_by_the_background_probe(lab: Lab, tmp_path: Path) -> None:
    config_path, control = card_gateway_config(lab, tmp_path, background_probe_interval_s=0.05)
    gateway = lab.gateway(config_path).start()
    first = [(bytes([3, i]) * 8, VALUE_BYTES) for i in range(4)]
    with closing_client(gateway.client()) as client:
        assert put_values(client, first) == len(first)
        write_control(control, target_up=False)
        fresh = itertools.count()
        wait_until(
            lambda: (
                put_values(client, [(next(fresh).to_bytes(16, "big"), VALUE_BYTES)]) == 1
                and "tier 'card' unavailable" in gateway.log()
            ),
            "the card tier unavailable",
        )
        for _ in range(4):  # Push the first values out of RAM: only the card holds them.
            batch = [(next(fresh).to_bytes(16, "big"), VALUE_BYTES) for _i in range(4)]
            assert put_values(client, batch) == 4
        requests = card_status(client.status()).counters.skipped
        write_control(control, target_up=True)
        # No request reaches the card now: only the background probe can find it back.
        wait_until(lambda: "tier 'card' answers again" in gateway.log(), "the probe found the card back")
        card = card_status(client.status())
        assert card.breaker == "closed" and card.counters.skipped == requests
        hits = card.counters.hits
        assert get_values(client, [key for key, _ in first]) == [value_for(k, s) for k, s in first]
        assert card_status(client.status()).counters.hits > hits, "the next get hits the card"
    log = gateway.log()
    assert log.count("tier 'card' unavailable") == 1 and log.count("tier 'card' answers again") == 1
    assert gateway.stop() == 0


def block_card_config(lab: Lab, tmp_path: Path) -> Path:
    path = lab.config(
        tiers=[
            {"name": "ram", "type": "ram", "capacity_gb": 1 / 1024},
            {"name": "card", "type": "nvme", "device": f"file:{tmp_path / 'card.img'}", "capacity_gb": 16 / 1024},
        ]
    )
    document = yaml.safe_load(path.read_text())
    document["card"] = {"region_mb": 4, "fragment_bytes": 1 << 20}
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_gateway_restarted_over_a_file_card_still_hits_and_wipe_waits_for_it(
    lab: Lab, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = block_card_config(lab, tmp_path)
    items = [(bytes([4, i]) * 8, VALUE_BYTES) for i in range(4)] + [(bytes([5, 0]) * 8, 3 << 20)]
    gateway = lab.gateway(config_path).start()
    with closing_client(gateway.client()) as client:
        assert put_values(client, items) == len(items)  # The last one: three fragments on the card.
    assert gateway.stop() == 0
    gateway = lab.gateway(config_path).start()
    assert "kvharbor: tier card: 5 values found on the device" in gateway.log()
    with closing_client(gateway.client()) as client:
        assert get_values(client, [key for key, _ in items]) == [value_for(k, s) for k, s in items]
        assert card_status(client.status()).counters.hits == len(items), "RAM was empty: the card served"
        # While the gateway serves the card, wipe refuses (its socket answers, the store is locked).
        assert main(["card", "wipe", "--config", str(config_path), "--yes"]) == 2
        assert "is serving it; stop the gateway first, or pass --force" in capsys.readouterr().err
    assert gateway.stop() == 0
    assert main(["card", "wipe", "--config", str(config_path), "--yes", "--json"]) == 0
    assert '"keys_removed": 7' in capsys.readouterr().out  # Four values and three fragments.


@pytest.mark.parametrize(
    ("device", "said"),
    [
        ("/dev/null", "device /dev/null is not an NVMe device"),
        ("/dev/nvme97n1", "device /dev/nvme97n1 does not exist"),
        ("file:{tmp}/small.img", "small.img: 65536 bytes is too small for block mode"),
    ],
)
def test_a_gateway_beside_a_bad_card_serves_from_ram(lab: Lab, tmp_path: Path, device: str, said: str) -> None:
    (tmp_path / "small.img").write_bytes(bytes(65536))
    config_path = lab.config(
        tiers=[
            {"name": "ram", "type": "ram", "capacity_gb": 1 / 1024},
            {"name": "card", "type": "nvme", "device": device.format(tmp=tmp_path)},
        ]
    )
    gateway = lab.gateway(config_path).start()
    assert "kvharbor: tier card unavailable: tier 'card'" in gateway.log() and said in gateway.log()
    items = [(bytes([6, i]) * 8, VALUE_BYTES) for i in range(3)]
    with closing_client(gateway.client()) as client:
        assert [t.name for t in client.status().store.tiers] == ["ram"]
        assert put_values(client, items) == len(items)
        assert get_values(client, [key for key, _ in items]) == [value_for(k, s) for k, s in items]
    assert gateway.stop() == 0
