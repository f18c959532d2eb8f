"""The simulated card's parts: parameters refused by key, channel times, clocks, windows, faults."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvharbor.hal.base import HealthState, TargetUnreachable
from kvharbor.hal.sim.channels import Channels
from kvharbor.hal.sim.clock import ScaledClock, VirtualClock
from kvharbor.hal.sim.control import write_control
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.params import CardParams, TargetWindow, load_params

KEY = b"k" * 16


def card(**changes: object) -> SimCardDevice:
    params = CardParams(capacity_bytes=1 << 20, value_bytes_max=64 * 1024, **changes)  # type: ignore[arg-type]
    return SimCardDevice("card", params, VirtualClock())


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("capacity_byte: 10\n", "unknown key 'capacity_byte'"),
        ("capacity_bytes: -1\n", "capacity_bytes: must be > 0"),
        ("channels: 2.5\n", "channels: expected an integer"),
        ("key_eviction: 1\n", "key_eviction: expected true or false"),
        ("key_bytes_max: 32\n", "key_bytes_max"),
        ("warning_usage_ratio: 0.99\n", "warning_usage_ratio"),
        ("target_windows: [{start_s: 1}]\n", "target_windows"),
        ("- 1\n", "must hold a mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_a_parameter_file_with_a_bad_key_is_refused_naming_it(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "card.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"sim parameter file .*card\.yaml") as refused:
        load_params(str(path))
    assert named in str(refused.value)


def test_a_parameter_file_sets_what_it_names_and_keeps_the_other_defaults(tmp_path: Path) -> None:
    path = tmp_path / "card.yaml"
    path.write_text("capacity_bytes: 4194304\nkey_eviction: false\ntarget_windows: [{start_s: 2, duration_s: 0.5}]\n")
    params = load_params(str(path))
    assert params.capacity_bytes == 4 << 20 and params.key_eviction is False
    assert params.target_windows == (TargetWindow(2.0, 0.5),)
    assert params.channels == CardParams().channels


def test_stripes_of_one_value_run_on_parallel_channels() -> None:
    channels = Channels(count=4, stripe_bytes=100)
    # 400 bytes, 4 stripes on 4 free channels at 100 B/s: one second, not four, plus the latency.
    assert channels.complete_at(0.0, 400, 100.0, 0.5) == pytest.approx(1.5)
    # Every channel is busy until 1 s: the next operation queues behind them.
    assert channels.complete_at(0.0, 100, 100.0, 0.0) == pytest.approx(2.0)
    # After a power loss nothing is in flight.
    channels.reset()
    assert channels.complete_at(0.0, 100, 100.0, 0.0) == pytest.approx(1.0)


def test_virtual_time_moves_by_operations_and_a_window_runs_on_simpy() -> None:
    device = card(target_windows=(TargetWindow(start_s=1.0, duration_s=2.0),))
    device.put(KEY, [b"v" * 1000])
    assert 0 < device.card.clock.now() < 1.0
    device.faults.advance(1.0)
    with pytest.raises(TargetUnreachable, match="3/70h"):
        device.get(KEY, memoryview(bytearray(1000)))
    assert device.health().state is HealthState.FAILED
    device.faults.advance(2.0)
    assert device.get(KEY, memoryview(bytearray(1000))) == 1000, "back with its contents"
    codes = [e.code for e in device.card_events()]
    assert codes[-2:] == [6001, 6002]


def test_scaled_real_time_waits_for_an_operation_to_complete() -> None:
    clock = ScaledClock(time_scale=1e-3)
    until = clock.now() + 5.0  # Five card seconds: five milliseconds of wall time.
    clock.wait(until)
    assert clock.now() >= until


def test_writes_not_on_flash_are_lost_at_a_power_loss_only_without_supercapacitor() -> None:
    device = card(persist_delay_s=1.0)
    device.put(KEY, [b"old"])
    device.faults.advance(2.0)  # On flash.
    device.put(KEY, [b"new"])
    assert device.faults.power_cycle() == 0, "a healthy supercapacitor flushes the buffer"
    device.put(b"j" * 16, [b"young"])
    device.faults.fail_supercap()
    assert device.health().state is HealthState.DEGRADED
    assert device.faults.power_cycle() == 1
    assert device.get(b"j" * 16, memoryview(bytearray(16))) is None, "lost, never served"
    assert device.get(KEY, memoryview(bytearray(16))) == 3, "flushed before the first power loss"
    assert {5001, 5002, 5003} <= {e.code for e in device.card_events()}


def test_a_hot_card_is_throttled_and_says_so() -> None:
    cool, hot = card(), card()
    hot.faults.set_temperature(83.0)
    for device in (cool, hot):
        device.put(KEY, [b"v" * 4096])
    assert hot.card.clock.now() > cool.card.clock.now()
    assert hot.health().state is HealthState.DEGRADED
    hot.faults.set_temperature(90.0)
    assert hot.health().state is HealthState.FAILED
    assert [e.code for e in hot.card_events()] == [4001, 4002]


def test_status_reports_the_card_and_its_wear() -> None:
    device = card(flash_endurance_bytes=1 << 20)
    device.put(KEY, [b"v" * (64 * 1024)])
    status = device.card_status()
    assert status.driver == "kvharbor-sim" and status.firmware_version == CardParams().firmware_version
    assert status.flash_wear_percent == pytest.approx(6.25)
    assert (status.used_bytes, status.keys, status.supercap) == (64 * 1024, 1, "ok")


def test_faults_arrive_through_the_control_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    control = str(tmp_path / "control.yaml")
    device = card(control_path=control, control_poll_s=1e-9)
    device.put(KEY, [b"v"])
    write_control(control, target_up=False, temperature_c=83.0)
    with pytest.raises(TargetUnreachable):
        device.get(KEY, memoryview(bytearray(1)))
    assert device.card.temperature_c == 83.0
    write_control(control, target_up=True, power_cycles=1)
    assert device.get(KEY, memoryview(bytearray(1))) == 1
    assert device.card.counts["power_cycles"] == 1
    with pytest.raises(ValueError, match="unknown field 'target'"):
        write_control(control, target=True)
    Path(control).write_text("target_up: 3\n")
    with caplog.at_level(logging.WARNING):
        assert device.get(KEY, memoryview(bytearray(1))) == 1, "an invalid file changes nothing"
    assert "target_up: got 3; ignored" in caplog.text
