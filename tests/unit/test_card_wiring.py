"""A card tier's ``device:`` opened through the real registry and assembly: block mode on
``file:PATH`` and block devices, the KV namespace for character devices, and the
refusals of each (a clear message naming the device or the setting)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from test_hal_block import loop_device  # noqa: F401 - a fixture
from test_nvme_card import nvme_printing

from kvharbor.cache.assembly import open_store, open_tier
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.config import CARD_REGION_SLACK_BYTES, MIB, CardSection, NvmeTierSection, validate_config
from kvharbor.hal.base import HealthState
from kvharbor.hal.block.layout import SUPERBLOCK_BYTES
from kvharbor.hal.block.store import BlockStoreDevice
from kvharbor.hal.cards import open_card
from kvharbor.hal.nvme.cli import NvmeCli
from kvharbor.hal.nvme.drive_health import DriveHealth
from kvharbor.hal.nvme.health import NvmeAdmin

FINGERPRINT = LayoutFingerprint(model_id="test/wiring", chunk_size=16).digest()
REGION_MB = 4


def card_config(device: str, **tier: Any) -> Any:
    return validate_config(
        {
            "storage": {"tiers": [{"name": "card", "type": "nvme", "device": device, **tier}]},
            "card": {"region_mb": REGION_MB, "fragment_bytes": 1 * MIB},
        }
    )


def test_file_card_is_created_at_its_capacity_and_a_reopened_tier_still_hits(tmp_path: Path) -> None:
    path = tmp_path / "card.img"
    config = card_config(f"file:{path}", capacity_gb=16 / 1024)
    tier = open_tier(config.storage.tiers[0], config)
    assert isinstance(tier.device, BlockStoreDevice) and tier.capacity_bytes == 16 * MIB
    assert path.stat().st_size == SUPERBLOCK_BYTES + 4 * REGION_MB * MIB
    key, data = os.urandom(16), os.urandom(3 * MIB)  # Three fragments of card.fragment_bytes.
    assert tier.write(key, FINGERPRINT, data)
    tier.close()
    again = open_tier(config.storage.tiers[0], config)  # The file exists now: capacity_gb is a budget.
    try:
        assert again.contains([key]) == [True] and again.index.get(key).parts == 3  # type: ignore[union-attr]
        assert bytes(again.read(key, FINGERPRINT) or b"") == data
    finally:
        again.close()


def test_an_absent_file_without_capacity_gb_names_the_setting(tmp_path: Path) -> None:
    config = card_config(f"file:{tmp_path / 'card.img'}")
    with pytest.raises(ValueError, match=r"tier 'card': .*card\.img does not exist; set the tier's capacity_gb"):
        open_tier(config.storage.tiers[0], config)
    assert not (tmp_path / "card.img").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\0" * (1 * MIB), r"card\.img: 1048576 bytes is too small for block mode"),
        (b"not a block store".ljust(4096 * 4, b"x"), r"card\.img.*(not a kvharbor block store|magic)"),
    ],
    ids=["too-small", "another-format"],
)
def test_a_file_too_small_or_of_another_format_is_refused_naming_it(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "card.img"
    path.write_bytes(content)
    config = card_config(f"file:{path}")
    with pytest.raises(ValueError, match=message):
        open_tier(config.storage.tiers[0], config)
    assert path.read_bytes() == content  # Refused, never formatted over.


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("/dev/nvme97n1", r"tier 'card': device /dev/nvme97n1 does not exist"),
        ("/dev/ng97n1", r"tier 'card': device /dev/ng97n1 does not exist"),
        ("/dev/null", r"tier 'card': device /dev/null is not an NVMe device \(the NVMe ioctl is refused"),
        ("/dev/shm", r"device /dev/shm is neither a block device .* nor a character device"),
        ("file:", r"file: needs a path"),
    ],
)
def test_a_device_that_is_not_a_card_is_refused_naming_it(device: str, message: str) -> None:
    section = NvmeTierSection(name="card", device=device)
    with pytest.raises(ValueError, match=message):
        open_card(section, CardSection(), 1 * MIB)


def test_a_bad_card_tier_is_skipped_and_the_ram_tier_serves(tmp_path: Path) -> None:
    config = validate_config(
        {
            "storage": {
                "tiers": [
                    {"name": "ram", "type": "ram", "capacity_gb": 1 / 1024},
                    {"name": "card", "type": "nvme", "device": "/dev/null"},
                ],
                "fallback_path": None,  # The RAM tier alone serves, no fallback tier beside it.
            }
        }
    )
    store = open_store(config)
    try:
        assert [t.name for t in store.tiers] == ["ram"]
        key = os.urandom(16)
        assert store.put(key, FINGERPRINT, b"v" * 1000)
        assert bytes(store.get(key, FINGERPRINT) or b"") == b"v" * 1000
    finally:
        store.close()


def test_region_mb_must_hold_a_fragment_naming_both_settings() -> None:
    with pytest.raises(ValidationError, match=r"card\.region_mb 2 cannot hold one fragment of card\.fragment_bytes"):
        CardSection(region_mb=2, fragment_bytes=2 * MIB)
    assert CardSection(region_mb=3, fragment_bytes=2 * MIB).region_bytes == 3 * MIB


def test_the_region_slack_holds_the_stored_objects_header() -> None:
    """The config sits below the cache and does not import its format: its slack counts the
    object header's room (and the region header, the store's object header, their padding:
    a 4 KiB block each at the most)."""
    assert CARD_REGION_SLACK_BYTES >= HEADER_BYTES + 3 * 4096


def test_drive_health_runs_nvme_cli_once_per_interval(tmp_path: Path) -> None:
    cli = nvme_printing(tmp_path, "smart_log_v2.3.jsonc", None)
    calls = tmp_path / "calls"
    script = Path(cli.binary)
    script.write_text(script.read_text().replace("#!/bin/sh\n", f'#!/bin/sh\necho "$1" >> {calls}\n', 1))
    now = [100.0]
    health = DriveHealth(NvmeAdmin("/dev/nvme0n1", cli), interval_s=10.0, clock=lambda: now[0])
    first = health.read()
    assert first.state is HealthState.DEGRADED and "supercapacitor" in first.detail
    now[0] += 9.9
    assert health.read() == first
    assert calls.read_text().split().count("smart-log") == 1
    now[0] += 0.1
    health.read()
    assert calls.read_text().split().count("smart-log") == 2


def test_drive_health_without_nvme_cli_is_unknown_not_a_fault(tmp_path: Path) -> None:
    health = DriveHealth(NvmeAdmin("/dev/nvme0n1", NvmeCli(str(tmp_path / "absent")))).read()
    assert health.state is HealthState.OK and "nvme-cli is not installed" in health.detail


def test_a_block_device_opens_in_block_mode(loop_device: str) -> None:  # noqa: F811
    card = CardSection(region_mb=1, fragment_bytes=64 * 1024)  # The loop device holds two 1 MiB regions.
    device = open_card(NvmeTierSection(name="card", device=loop_device), card, 64 * 1024)
    try:
        assert isinstance(device, BlockStoreDevice) and device.card_status().paths == (loop_device,)
        device.put(bytes(16), [b"block"])
        into = memoryview(bytearray(16))
        assert device.get(bytes(16), into) == 5 and bytes(into[:5]) == b"block"
    finally:
        device.close()


def test_block_mode_on_an_nvme_namespace_adds_the_drives_health_and_sensors(tmp_path: Path) -> None:
    from kvharbor.hal.nvme.block_device import NvmeBlockDevice

    admin = NvmeAdmin("/dev/nvme0n1", nvme_printing(tmp_path, "smart_log_v2.3.jsonc", None))
    path = tmp_path / "ns.img"  # A file stands in for the namespace's blocks; nvme-cli answers for its controller.
    path.write_bytes(bytes(4096 + 2 * MIB))
    device = NvmeBlockDevice("card", str(path), 64 * 1024, admin, region_bytes=1 * MIB)
    try:
        health = device.health()
        assert health.state is HealthState.DEGRADED and "supercapacitor" in health.detail
        status = device.card_status()
        assert status.driver == "kvharbor-block-nvme" and status.supercap == "failed"
        assert status.firmware_version not in ("", "n/a") and status.capacity_bytes == 2 * MIB
    finally:
        device.close()
