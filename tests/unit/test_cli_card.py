"""``kvharbor card``, run as users run it: a separate process, on the simulated card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_cli import kvharbor_cmd


def test_status_shows_the_cards_aggregated_status(tmp_path: Path) -> None:
    params = tmp_path / "card.yaml"
    params.write_text("capacity_bytes: 4194304\nfirmware_version: FW-TEST\ntemperature_c: 83\n")
    result = kvharbor_cmd("card", "status", "--device", f"sim:{params}", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["driver"] == "kvharbor-sim" and status["firmware_version"] == "FW-TEST"
    assert (status["capacity_bytes"], status["capacity_usage"], status["health"]) == (4 << 20, "OK", "degraded")
    assert {"supercap", "flash_spare_percent", "flash_wear_percent", "temperature_c", "service"} <= set(status)
    lines = kvharbor_cmd("card", "status", "--device", f"sim:{params}").stdout
    assert "firmware_version     FW-TEST" in lines


def test_usage_and_events_of_the_configured_card_take_the_card_settings(tmp_path: Path) -> None:
    config = tmp_path / "kvharbor.yaml"
    config.write_text(
        yaml.safe_dump(
            {"storage": {"tiers": [{"name": "box", "type": "nvme", "device": "sim"}]}, "card": {"key_eviction": False}}
        )
    )
    usage = json.loads(kvharbor_cmd("card", "usage", "--config", str(config), "--json").stdout)
    assert usage["key_eviction"] is False and usage["used_bytes"] == 0
    events = json.loads(kvharbor_cmd("card", "events", "--config", str(config), "--json").stdout)["events"]
    assert [(e["code"], e["name"]) for e in events] == [(3011, "key_eviction_off")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "nope"], "--device 'nope': expected sim, sim:PARAMS.yaml"),
        (["--device", "/dev/ng97n1"], "tier 'card': device /dev/ng97n1 does not exist"),
        (["--device", "/dev/null"], "device /dev/null is not an NVMe device"),
        (["--device", "file:/nonexistent/card.img"], "card.img does not exist; set the tier's capacity_gb"),
        (["--device", "sim:/nonexistent/card.yaml"], "sim parameter file /nonexistent/card.yaml"),
        (["--config", "/nonexistent/kvharbor.yaml"], "does not exist"),
    ],
)
def test_a_card_that_cannot_open_is_one_line_on_stderr_and_exit_2(args: list[str], message: str) -> None:
    result = kvharbor_cmd("card", "status", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("kvharbor: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_without_a_card_says_so(tmp_path: Path) -> None:
    config = tmp_path / "kvharbor.yaml"
    config.write_text(yaml.safe_dump({"storage": {"tiers": [{"name": "ram", "type": "ram", "capacity_gb": 1}]}}))
    result = kvharbor_cmd("card", "status", "--config", str(config))
    assert result.returncode == 2 and "the config has no card tier" in result.stderr
