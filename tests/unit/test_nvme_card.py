"""The NVMe KV driver as a card: health, aggregated status and events from nvme-cli (a
stand-in ``nvme`` printing fixtures from nvme-cli's field names), KV commands answered
by the KV controller stand-in."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache.assembly import open_tier
from kvharbor.cache.breaker import BreakerState
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.tier import Tier
from kvharbor.config import validate_config
from kvharbor.hal.base import CapacityUsage, DeviceError, HealthState
from kvharbor.hal.nvme.card_view import ERROR_LOG_EVENT, capacity_usage
from kvharbor.hal.nvme.cli import NvmeCli
from kvharbor.hal.nvme.health import NvmeAdmin
from kvharbor.hal.nvme.kv_commands import KvOpcode
from kvharbor.hal.nvme.kv_device import NvmeKvDevice, open_kv_namespace
from kvharbor.hal.nvme.passthru import PassthruCmd64
from tests.support.nvme_kv_standin import KvNamespaceStandIn

FIXTURES = Path(__file__).parent / "fixtures" / "nvme_cli"


def nvme_printing(tmp_path: Path, smart: str, ocp: str | None) -> NvmeCli:
    """An ``nvme`` that answers each subcommand from a fixture (``ocp`` None: no OCP log)."""
    answers = {"id-ctrl": "id_ctrl.jsonc", "smart-log": smart, "error-log": "error_log.jsonc"}
    cases = "".join(f"  {sub}) grep -v '^//' {FIXTURES / name} ;;\n" for sub, name in answers.items())
    ocp_case = f"grep -v '^//' {FIXTURES / ocp}" if ocp else "echo 'ocp: Invalid Log Page' >&2; exit 1"
    script = tmp_path / "nvme"
    script.write_text(f'#!/bin/sh\ncase "$1" in\n{cases}  ocp) {ocp_case} ;;\n  *) exit 2 ;;\nesac\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return NvmeCli(str(script), timeout_s=30)


def card(tmp_path: Path, smart: str, ocp: str | None = None, **standin: Any) -> NvmeKvDevice:
    admin = NvmeAdmin("/dev/ng0n1", nvme_printing(tmp_path, smart, ocp))
    return open_kv_namespace("card", "/dev/null", 1 << 20, KvNamespaceStandIn(**standin), admin)


def test_a_failed_supercapacitor_degrades_health_and_shows_in_status(tmp_path: Path) -> None:
    device = card(tmp_path, "smart_log_v2.3.jsonc", capacity_bytes=1000)
    device.put((1).to_bytes(16, "big"), [bytes(850)])
    health = device.health()
    assert health.state is HealthState.DEGRADED and "supercapacitor" in health.detail
    status = device.card_status()
    assert (status.firmware_version, status.temperature_c, status.supercap) == ("4B2QJXD7", 45.0, "failed")
    assert (status.flash_spare_percent, status.flash_wear_percent) == (100.0, 2.0)
    assert (status.capacity_usage, status.used_bytes, status.capacity_bytes, status.keys) == (
        CapacityUsage.WARNING, 850, 1000, 1
    )  # fmt: skip
    assert (status.keys_max, status.key_eviction, status.paths) == (1024, False, ("/dev/null",))


def test_ocp_capacitor_health_and_a_healthy_drive(tmp_path: Path) -> None:
    healthy = card(tmp_path, "smart_log_v2.7.jsonc", "ocp_smart_add_log_format2.jsonc")
    assert healthy.health().state is HealthState.OK
    assert healthy.card_status().supercap == "none"  # 0xFFFF: the drive has no capacitor.
    worn = card(tmp_path, "smart_log_v2.7.jsonc", "ocp_smart_add_log_format1.jsonc")
    assert worn.health().state is HealthState.DEGRADED and "capacitor health 97%" in worn.health().detail
    assert worn.card_status().supercap == "failed"


def test_the_error_log_is_the_cards_event_log(tmp_path: Path) -> None:
    device = card(tmp_path, "smart_log_v2.7.jsonc")
    (event,) = device.card_events()
    assert (event.seq, event.code, event.name) == (7, ERROR_LOG_EVENT, "controller_error")
    assert "status 1/87h (key does not exist) on queue 1 command 42" in event.message
    assert device.card_events(since_seq=7) == []


def test_key_eviction_is_recorded_not_done_by_the_namespace(tmp_path: Path) -> None:
    device = card(tmp_path, "smart_log_v2.7.jsonc")
    assert not device.evicts_on_its_own
    device.set_key_eviction(True)
    assert device.card_status().key_eviction is True
    device.set_key_eviction(False)
    assert device.card_status().key_eviction is False


def test_without_nvme_cli_the_namespace_still_serves_and_says_why_health_is_unknown(tmp_path: Path) -> None:
    admin = NvmeAdmin("/dev/ng0n1", NvmeCli(str(tmp_path / "absent")))
    device = open_kv_namespace("card", "/dev/null", 1 << 20, KvNamespaceStandIn(), admin)
    device.put(b"k", [b"v"])
    health = device.health()
    assert health.state is HealthState.OK and "nvme-cli is not installed" in health.detail
    with pytest.raises(DeviceError, match=r"card: .*id-ctrl /dev/ng0n1 -o json`: nvme-cli is not installed"):
        device.card_status()


def test_capacity_usage_levels() -> None:
    assert [capacity_usage(u, 100) for u in (0, 79, 80, 94, 95, 100)] == [
        CapacityUsage.OK, CapacityUsage.OK, CapacityUsage.WARNING, CapacityUsage.WARNING,
        CapacityUsage.CRITICAL, CapacityUsage.CRITICAL,
    ]  # fmt: skip


# -- the driver under the real tier --------------------------------------------

FINGERPRINT = LayoutFingerprint(model_id="test/nvme", chunk_size=16).digest()


def nvme_tier(device: NvmeKvDevice, **card_settings: object) -> Tier:
    config = validate_config(
        {"storage": {"tiers": [{"name": "card", "type": "nvme", "device": "/dev/ng0n1"}]}, "card": card_settings}
    )
    return open_tier(config.storage.tiers[0], config, device)


@pytest.mark.parametrize(
    "limit",
    [{"value_bytes_max": 8192}, {"value_bytes_max": 64 * 1024, "mdts": 1}],
    ids=["namespace maximum value length", "controller MDTS of 2 pages"],
)
def test_the_tier_fragments_values_to_the_largest_one_command_carries(tmp_path: Path, limit: dict[str, Any]) -> None:
    standin = KvNamespaceStandIn(capacity_bytes=1 << 20, **limit)
    admin = NvmeAdmin("/dev/ng0n1", nvme_printing(tmp_path, "smart_log_v2.7.jsonc", None))
    tier = nvme_tier(open_kv_namespace("card", "/dev/null", 1 << 20, standin, admin), key_eviction=False)
    key, data = os.urandom(16), os.urandom(3 * (8192 - HEADER_BYTES) + 1)  # Three fragments and a byte.
    assert tier.write(key, FINGERPRINT, data)
    assert tier.index.get(key).parts == 4  # type: ignore[union-attr]
    assert all(len(v) <= 8192 for v in standin.values.values()) and len(standin.values) == 4
    assert bytes(tier.read(key, FINGERPRINT) or b"") == data
    moved = [PassthruCmd64.from_buffer_copy(c) for c in standin.commands]
    assert max(c.cdw10 for c in moved if c.opcode == KvOpcode.STORE) <= 8192
    if "mdts" in limit:
        assert max(c.data_len for c in moved) <= 8192, "no command moves more than MDTS (Retrieve, List too)"
    standin.values.clear()  # The card lost them (a wipe behind the cache's back): a miss, never wrong bytes.
    assert tier.read(key, FINGERPRINT) is None


def test_a_full_namespace_is_counted_full_and_the_tier_stays_closed(tmp_path: Path) -> None:
    standin = KvNamespaceStandIn(capacity_bytes=64 * 1024, value_bytes_max=64 * 1024)
    admin = NvmeAdmin("/dev/ng0n1", nvme_printing(tmp_path, "smart_log_v2.7.jsonc", None))
    tier = nvme_tier(open_kv_namespace("card", "/dev/null", 1 << 20, standin, admin), key_eviction=False)
    standin.values[b"\xff" * 16] = bytes(60 * 1024)  # Another user of the namespace filled it.
    assert not tier.write(os.urandom(16), FINGERPRINT, os.urandom(8 * 1024))
    assert tier.counters.full == 1 and tier.breaker.state is BreakerState.CLOSED


def test_with_the_default_key_eviction_the_tier_evicts_least_recently_used_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    admin = NvmeAdmin("/dev/ng0n1", nvme_printing(tmp_path, "smart_log_v2.7.jsonc", None))
    standin = KvNamespaceStandIn(capacity_bytes=1 << 20, value_bytes_max=64 * 1024)
    device = open_kv_namespace("card", "/dev/null", 1 << 20, standin, admin)
    config = validate_config(
        {"storage": {"tiers": [{"name": "card", "type": "nvme", "device": "/dev/ng0n1", "capacity_gb": 100 / 2**20}]}}
    )
    with caplog.at_level("INFO", logger="kvharbor"):
        tier = open_tier(config.storage.tiers[0], config, device)
    said = [r.getMessage() for r in caplog.records if "no key eviction of its own" in r.getMessage()]
    assert len(said) == 1 and "done by the tier (least recently used" in said[0]
    assert not tier.device_evicts
    keys = [os.urandom(16) for _ in range(4)]
    for key in keys:  # 100 KiB budget, 40 KiB values: the third and fourth evict the oldest.
        assert tier.write(key, FINGERPRINT, os.urandom(40 * 1024))
    assert tier.contains(keys) == [False, False, True, True]
    assert tier.counters.evictions == 2 and len(standin.values) == 2
