"""The simulated card's parameters: every one, its unit and its default, in one place.

Timing defaults are those of a current PCIe Gen4 x4 NVMe SSD, the Samsung 990 PRO
2 TB (data sheet, Samsung Electronics 2022: sequential read 7,450 MB/s, sequential
write 6,900 MB/s, 4 KB random read at queue depth 1 22 K IOPS, i.e. ~45 us, 4 KB
random write at queue depth 1 80 K IOPS, i.e. ~12.5 us; 8 NAND channels on its Pascal
controller; 1,200 TB written endurance; composite temperature warning 82 C, critical
85 C). The capacity default is not the SSD's: the simulator keeps every value in
host memory, so it defaults to 1 GiB. Key limits are those of the NVMe Key Value
command set (a key is at most 16 bytes); the value limit is kvharbor's default
`card.fragment_bytes`.

A parameter file (``sim:PARAMS.yaml``) names any subset of the fields below; an
unknown key or an impossible value is refused with `ValueError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class TargetWindow:
    """The remote target does not answer from ``start_s`` for ``duration_s`` (card time)."""

    start_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class CardParams:
    # Capacity and limits.
    capacity_bytes: int = 1 << 30
    keys_max: int = 1 << 20
    key_bytes_max: int = 16
    value_bytes_max: int = 2 * MIB
    # Timing: per-operation latency plus bytes over one channel's bandwidth.
    channels: int = 8
    read_latency_s: float = 45e-6
    write_latency_s: float = 12.5e-6
    delete_latency_s: float = 12.5e-6
    read_bandwidth_bytes_per_s: float = 7.45e9
    write_bandwidth_bytes_per_s: float = 6.9e9
    """Whole-card bandwidths; each channel moves its share."""
    stripe_bytes: int = 128 * 1024
    """A value is spread over the channels in stripes of this size, as a controller spreads a large write."""
    time_scale: float = 1.0
    """Wall seconds per card second in scaled real time (0.001: a thousand times faster)."""
    # Capacity usage.
    key_eviction: bool = True
    """Evict the oldest written keys to make room; off: a write that does not fit is refused."""
    warning_usage_ratio: float = 0.80
    critical_usage_ratio: float = 0.95
    # Health.
    firmware_version: str = "SIM-4B2QJXD7"
    temperature_c: float = 40.0
    temperature_warning_c: float = 82.0
    temperature_critical_c: float = 85.0
    throttle_factor: float = 2.0
    """Operations take this many times longer at or above the warning temperature."""
    flash_spare_percent: float = 100.0
    flash_endurance_bytes: int = 1_200 * 10**12
    flash_wear_percent: float = 0.0
    """Wear at start; grows with the bytes written against ``flash_endurance_bytes``."""
    supercap_ok: bool = True
    persist_delay_s: float = 0.002
    """How long a write sits in the card's volatile buffer before it is on flash; a
    power loss with a failed supercapacitor loses the writes younger than this."""
    # Remote target.
    target_windows: tuple[TargetWindow, ...] = field(default=())
    control_path: str = ""
    """A file through which another process injects faults (see `control`); empty: none."""
    control_poll_s: float = 0.05
    """How often, in wall seconds, the card looks at its control file."""
    events_max: int = 4096
    """Events kept in the card's log; older ones are dropped, their count kept."""

    def __post_init__(self) -> None:
        positive = (
            "capacity_bytes",
            "keys_max",
            "key_bytes_max",
            "value_bytes_max",
            "channels",
            "read_bandwidth_bytes_per_s",
            "write_bandwidth_bytes_per_s",
            "time_scale",
            "throttle_factor",
            "stripe_bytes",
            "flash_endurance_bytes",
            "events_max",
            "control_poll_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)!r})")
        for name in ("read_latency_s", "write_latency_s", "delete_latency_s", "persist_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)!r})")
        if self.key_bytes_max > 16:
            raise ValueError(
                f"key_bytes_max: the NVMe KV command set carries at most 16 bytes (got {self.key_bytes_max})"
            )
        if self.value_bytes_max > self.capacity_bytes:
            raise ValueError(f"value_bytes_max: {self.value_bytes_max} exceeds capacity_bytes {self.capacity_bytes}")
        if not 0 < self.warning_usage_ratio < self.critical_usage_ratio <= 1:
            raise ValueError(
                "warning_usage_ratio, critical_usage_ratio: need 0 < warning < critical <= 1 "
                f"(got {self.warning_usage_ratio}, {self.critical_usage_ratio})"
            )
        if not self.temperature_warning_c < self.temperature_critical_c:
            raise ValueError("temperature_warning_c: must be below temperature_critical_c")
        for name in ("flash_spare_percent", "flash_wear_percent"):
            if not 0 <= getattr(self, name) <= 100:
                raise ValueError(f"{name}: must be a percentage 0-100 (got {getattr(self, name)!r})")
        for index, window in enumerate(self.target_windows):
            if window.start_s < 0 or window.duration_s <= 0:
                raise ValueError(f"target_windows[{index}]: needs start_s >= 0 and duration_s > 0")

    @property
    def channel_read_bytes_per_s(self) -> float:
        return self.read_bandwidth_bytes_per_s / self.channels

    @property
    def channel_write_bytes_per_s(self) -> float:
        return self.write_bandwidth_bytes_per_s / self.channels


_FIELDS = {f.name: f for f in fields(CardParams)}


def params_from_mapping(data: dict[str, Any], source: str = "parameters") -> CardParams:
    """`CardParams` from a mapping; raises ValueError naming the key and ``source``."""
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{source}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_FIELDS))}")
    values: dict[str, Any] = {}
    for name, raw in data.items():
        try:
            values[name] = _coerce(name, raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {name}: {err}") from None
    try:
        return CardParams(**values)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def load_params(path: str) -> CardParams:
    """The parameters in a YAML file; raises ValueError naming the file and the key."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"sim parameter file {path}: cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"sim parameter file {path}: not valid YAML ({err})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"sim parameter file {path}: must hold a mapping of parameter names to values")
    return params_from_mapping(data, f"sim parameter file {path}")


def _coerce(name: str, raw: Any) -> Any:
    """One value to its field's type; bool is not taken for a number, nor a number for bool."""
    default = _FIELDS[name].default
    if name == "target_windows":
        if not isinstance(raw, list):
            raise TypeError("a list of {start_s, duration_s} mappings")
        windows = []
        for item in raw:
            if not isinstance(item, dict) or set(item) != {"start_s", "duration_s"}:
                raise TypeError("each window is a mapping with exactly start_s and duration_s")
            windows.append(TargetWindow(float(item["start_s"]), float(item["duration_s"])))
        return tuple(windows)
    if isinstance(default, bool):
        if not isinstance(raw, bool):
            raise TypeError(f"expected true or false, got {raw!r}")
        return raw
    if isinstance(default, int):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise TypeError(f"expected an integer, got {raw!r}")
        return raw
    if isinstance(default, float):
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise TypeError(f"expected a number, got {raw!r}")
        return float(raw)
    if not isinstance(raw, str):
        raise TypeError(f"expected a string, got {raw!r}")
    return raw
