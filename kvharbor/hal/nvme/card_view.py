"""A real card's health and aggregated status, from what nvme-cli reads of it.

The NVMe Key Value command set reports capacity (Identify NSZE/NUSE) but no
fill levels; kvharbor derives the CapacityUsage level from the used ratio with
the same thresholds the simulated card uses by default. Health comes from the
SMART log's critical warning bits (NVM Express Base Specification, SMART /
Health Information log, byte 0) and, on OCP drives, the capacitor health.
"""

from __future__ import annotations

from kvharbor.hal.base import CapacityUsage, CardEventRecord, Health, HealthState
from kvharbor.hal.kv_status import KvStatus
from kvharbor.hal.nvme.health import ErrorEntry, OcpSmartLog, SmartLog

ERROR_LOG_EVENT = 7001
"""Card event number of an entry of the controller's error log (``nvme error-log``): 7xxx are
the real controller's own reports, beside the simulated card's 3xxx-6xxx."""

CAPACITY_WARNING_RATIO = 0.80
CAPACITY_CRITICAL_RATIO = 0.95
CAPACITOR_HEALTH_MIN_PERCENT = 100
"""OCP Datacenter NVMe SSD specification: below 100 the capacitor misses its factory margin."""

# fmt: off
_WARNING_BITS: tuple[tuple[int, HealthState, str], ...] = (
    (0x08, HealthState.FAILED,   "media is read only (critical warning bit 3)"),
    (0x04, HealthState.DEGRADED, "reliability degraded by media or internal errors (bit 2)"),
    (0x10, HealthState.DEGRADED, "volatile memory backup (supercapacitor) failed: writes not yet on flash "
                                 "are lost at a power loss (bit 4)"),
    (0x01, HealthState.DEGRADED, "available spare below its threshold (bit 0)"),
    (0x02, HealthState.DEGRADED, "temperature outside its thresholds (bit 1)"),
    (0x20, HealthState.DEGRADED, "persistent memory region is read only (bit 5)"),
)
# fmt: on


def capacity_usage(used_bytes: int, capacity_bytes: int) -> CapacityUsage:
    ratio = used_bytes / capacity_bytes if capacity_bytes > 0 else 1.0
    if ratio >= CAPACITY_CRITICAL_RATIO:
        return CapacityUsage.CRITICAL
    return CapacityUsage.WARNING if ratio >= CAPACITY_WARNING_RATIO else CapacityUsage.OK


def supercap_state(smart: SmartLog, ocp: OcpSmartLog | None) -> str:
    """``failed`` (bit 4, or OCP capacitor health under its margin), ``ok``, or ``none``
    where an OCP drive says it has no capacitor."""
    if smart.supercap_failed:
        return "failed"
    if ocp is not None and ocp.capacitor_health_percent is None:
        return "none"
    if ocp is not None and ocp.capacitor_health_percent is not None:
        return "ok" if ocp.capacitor_health_percent >= CAPACITOR_HEALTH_MIN_PERCENT else "failed"
    return "ok"


def health_from_logs(smart: SmartLog, ocp: OcpSmartLog | None) -> Health:
    """FAILED for a read-only medium, DEGRADED for any other warning, else OK; the detail
    names every warning that is set."""
    found = [(state, text) for bit, state, text in _WARNING_BITS if smart.critical_warning & bit]
    capacitor = ocp.capacitor_health_percent if ocp is not None else None
    if not smart.supercap_failed and capacitor is not None and capacitor < CAPACITOR_HEALTH_MIN_PERCENT:
        found.append((HealthState.DEGRADED, f"capacitor health {capacitor}% is under its margin (OCP log)"))
    if not found:
        return Health(HealthState.OK)
    state = HealthState.FAILED if any(s is HealthState.FAILED for s, _ in found) else HealthState.DEGRADED
    return Health(state, "; ".join(text for _, text in found))


def error_events(entries: list[ErrorEntry], since_seq: int = 0) -> list[CardEventRecord]:
    """The error log as card events, oldest first; ``seq`` is the entry's error count (the
    log keeps no time: ``time_s`` is 0). An empty entry (error count 0) is no event."""
    events = []
    for entry in sorted(entries, key=lambda e: e.error_count):
        if entry.error_count <= since_seq:
            continue
        status = KvStatus.decode(entry.status_field)  # nvme-cli prints it without the phase tag.
        message = (
            f"status {status.code} ({status.meaning}) on queue {entry.sqid} command {entry.cmdid}, nsid {entry.nsid}"
        )
        events.append(CardEventRecord(entry.error_count, 0.0, ERROR_LOG_EVENT, "controller_error", message))
    return events
