"""Admin and health of an NVMe device through nvme-cli, as typed results.

nvme-cli's JSON differs between releases (names from nvme-cli's
``nvme-print-json.c`` and ``plugins/ocp/ocp-print-json.c``):

- smart-log ``critical_warning`` is an integer, or with ``-v`` (and always in
  2.11-2.12) an object whose ``value`` is that integer; 2.7 wrote
  ``Temperature`` where the others write ``temperature`` (Kelvin);
- ``list`` prints a flat ``Devices`` list (``DevicePath``, ``ModelNumber``, ...),
  or verbose ``Devices[].Subsystems[].Controllers[].Namespaces[]`` (and, for
  multipath, ``Subsystems[].Namespaces[]``);
- OCP ``smart-add-log`` says ``"Capacitor health"`` in output format 1 and
  ``capacitor_health`` in format 2;
- id-ctrl's ``sn``, ``mn``, ``fr`` are space padded.

Keys are therefore matched after folding case and spaces to underscores, and
strings are stripped. A missing or mistyped field raises `NvmeCliError` naming
the command, the device and the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvharbor.hal.nvme.cli import NvmeCli, NvmeCliError

KELVIN_AT_0_C = 273


def _fold(name: str) -> str:
    return name.strip().lower().replace(" ", "_")


class _Fields:
    """A JSON object read with folded keys; errors name what was asked for."""

    def __init__(self, raw: Any, where: str) -> None:
        if not isinstance(raw, dict):
            raise NvmeCliError(f"{where}: expected an object, got {type(raw).__name__}")
        self._raw = {_fold(k): v for k, v in raw.items()}
        self.where = where

    def folded(self) -> dict[str, Any]:
        """Every field, under its folded name."""
        return dict(self._raw)

    def get(self, name: str) -> Any | None:
        return self._raw.get(_fold(name))

    def integer(self, name: str) -> int:
        value = self.get(name)
        if isinstance(value, dict):  # A verbose bit field: {"value": N, ...}.
            value = _Fields(value, f"{self.where}: {name}").get("value")
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise NvmeCliError(f"{self.where}: field '{name}' is missing or not an integer")
        try:
            return int(value, 0) if isinstance(value, str) else value
        except ValueError:
            raise NvmeCliError(f"{self.where}: field '{name}' is not an integer: {value!r}") from None

    def text(self, name: str) -> str:
        value = self.get(name)
        if not isinstance(value, str | int):
            raise NvmeCliError(f"{self.where}: field '{name}' is missing or not a string")
        return str(value).strip()

    def items(self, name: str) -> list[Any]:
        value = self.get(name)
        if isinstance(value, dict):
            return list(value.values())
        if not isinstance(value, list):
            raise NvmeCliError(f"{self.where}: field '{name}' is missing or not a list")
        return value


@dataclass(frozen=True, slots=True)
class NamespaceEntry:
    """One namespace of ``nvme list``."""

    device_path: str
    generic_path: str
    """``/dev/ngXnY``, where the release names it ("" when not)."""
    nsid: int
    model: str
    serial: str
    firmware: str
    used_bytes: int
    size_bytes: int
    sector_bytes: int


@dataclass(frozen=True, slots=True)
class ControllerId:
    """``nvme id-ctrl``: the fields kvharbor shows."""

    vendor_id: int
    serial: str
    model: str
    firmware: str


@dataclass(frozen=True, slots=True)
class NamespaceId:
    """``nvme id-ns``: sizes in logical blocks and the block size in use."""

    size_blocks: int
    capacity_blocks: int
    used_blocks: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class SmartLog:
    critical_warning: int
    temperature_c: int
    available_spare_percent: int
    spare_threshold_percent: int
    percent_used: int
    media_errors: int
    error_log_entries: int

    @property
    def supercap_failed(self) -> bool:
        """Critical warning bit 4: the volatile memory backup device (supercapacitor) failed."""
        return bool(self.critical_warning & 0x10)

    @property
    def read_only(self) -> bool:
        """Critical warning bit 3: the media is read only."""
        return bool(self.critical_warning & 0x08)


@dataclass(frozen=True, slots=True)
class OcpSmartLog:
    capacitor_health_percent: int | None
    """None where the drive has no power-loss capacitor (the log says 0xFFFF)."""


@dataclass(frozen=True, slots=True)
class ErrorEntry:
    error_count: int
    sqid: int
    cmdid: int
    status_field: int
    nsid: int


@dataclass(frozen=True, slots=True)
class FirmwareLog:
    active_slot: int
    revisions: tuple[tuple[int, str], ...]
    """(slot, revision) for each filled slot."""


def parse_list(raw: dict[str, Any], where: str = "nvme list") -> list[NamespaceEntry]:
    """Both ``list`` shapes: flat ``Devices`` entries or the verbose tree."""
    entries: list[NamespaceEntry] = []
    for device in _Fields(raw, where).items("Devices"):
        top = _Fields(device, where)
        if top.get("Subsystems") is None:
            entries.append(_flat_entry(top))
            continue
        for subsystem in top.items("Subsystems"):
            sub = _Fields(subsystem, where)
            controllers = [_Fields(c, where) for c in (sub.items("Controllers") if sub.get("Controllers") else [])]
            for ctrl in controllers:
                entries += [
                    _tree_entry(_Fields(n, where), ctrl) for n in ctrl.items("Namespaces") if ctrl.get("Namespaces")
                ]
            if sub.get("Namespaces") and controllers:  # Multipath: namespaces of the subsystem.
                entries += [_tree_entry(_Fields(n, where), controllers[0]) for n in sub.items("Namespaces")]
    return entries


def _dev(name: str) -> str:
    return name if not name or name.startswith("/dev/") else f"/dev/{name}"


def _flat_entry(f: _Fields) -> NamespaceEntry:
    generic = f.get("GenericPath")
    return NamespaceEntry(
        f.text("DevicePath"),
        str(generic or ""),
        f.integer("NameSpace"),
        f.text("ModelNumber"),
        f.text("SerialNumber"),
        f.text("Firmware"),
        f.integer("UsedBytes"),
        f.integer("PhysicalSize"),
        f.integer("SectorSize"),
    )


def _tree_entry(ns: _Fields, ctrl: _Fields) -> NamespaceEntry:
    generic = ns.get("Generic")
    return NamespaceEntry(
        _dev(ns.text("NameSpace")),
        _dev(str(generic or "")),
        ns.integer("NSID"),
        ctrl.text("ModelNumber"),
        ctrl.text("SerialNumber"),
        ctrl.text("Firmware"),
        ns.integer("UsedBytes"),
        ns.integer("PhysicalSize"),
        ns.integer("SectorSize"),
    )


def parse_id_ctrl(raw: dict[str, Any], where: str) -> ControllerId:
    f = _Fields(raw, where)
    return ControllerId(f.integer("vid"), f.text("sn"), f.text("mn"), f.text("fr"))


def parse_id_ns(raw: dict[str, Any], where: str) -> NamespaceId:
    f = _Fields(raw, where)
    formats = f.items("lbafs")
    index = f.integer("flbas") & 0xF
    if index >= len(formats):
        raise NvmeCliError(f"{where}: flbas names LBA format {index}, but {len(formats)} are listed")
    return NamespaceId(
        f.integer("nsze"), f.integer("ncap"), f.integer("nuse"), 1 << _Fields(formats[index], where).integer("ds")
    )


def parse_smart_log(raw: dict[str, Any], where: str) -> SmartLog:
    f = _Fields(raw, where)
    return SmartLog(
        f.integer("critical_warning"),
        f.integer("temperature") - KELVIN_AT_0_C,
        f.integer("avail_spare"),
        f.integer("spare_thresh"),
        f.integer("percent_used"),
        f.integer("media_errors"),
        f.integer("num_err_log_entries"),
    )


_NO_CAPACITOR = 0xFFFF


def parse_ocp_smart_log(raw: dict[str, Any], where: str) -> OcpSmartLog:
    health = _Fields(raw, where).integer("capacitor_health")
    return OcpSmartLog(None if health == _NO_CAPACITOR else health)


def parse_error_log(raw: dict[str, Any], where: str) -> list[ErrorEntry]:
    entries = []
    for item in _Fields(raw, where).items("errors"):
        e = _Fields(item, where)
        entries.append(
            ErrorEntry(
                e.integer("error_count"),
                e.integer("sqid"),
                e.integer("cmdid"),
                e.integer("status_field"),
                e.integer("nsid"),
            )
        )
    return entries


_SLOT = re.compile(r"firmware_rev_slot_(\d+)")
_REVISION_IN_PARENS = re.compile(r"\((.*)\)\s*$")


def parse_fw_log(raw: dict[str, Any], where: str) -> FirmwareLog:
    """The log is one object under the device's name: the active slot and ``Firmware Rev Slot N``
    entries, each ``"NUMBER (REVISION)"``."""
    if len(raw) != 1:
        raise NvmeCliError(f"{where}: expected one object named after the device, got {len(raw)} fields")
    inner = _Fields(next(iter(raw.values())), where)
    active = inner.integer("Active Firmware Slot (afi)") & 0x7  # AFI bits 2:0; 6:4 name the next reset's slot.
    revisions = []
    for name, value in inner.folded().items():
        slot = _SLOT.fullmatch(name)
        if slot:
            text = str(value)
            match = _REVISION_IN_PARENS.search(text)
            revisions.append((int(slot.group(1)), (match.group(1) if match else text).strip()))
    return FirmwareLog(active, tuple(sorted(revisions)))


@dataclass(frozen=True, slots=True)
class NvmeAdmin:
    """Admin and health queries of one device through nvme-cli."""

    device: str
    cli: NvmeCli = field(default_factory=NvmeCli)

    def _ask(self, *args: str) -> tuple[dict[str, Any], str]:
        return self.cli.json(*args), f"{self.device}: nvme {args[0]}"

    def namespaces(self) -> list[NamespaceEntry]:
        return parse_list(self.cli.json("list"))

    def id_ctrl(self) -> ControllerId:
        return parse_id_ctrl(*self._ask("id-ctrl", self.device))

    def id_ns(self) -> NamespaceId:
        return parse_id_ns(*self._ask("id-ns", self.device))

    def smart_log(self) -> SmartLog:
        return parse_smart_log(*self._ask("smart-log", self.device))

    def ocp_smart_log(self) -> OcpSmartLog | None:
        """The OCP extended SMART log where the drive has one; None where nvme-cli or the
        drive does not support it (the command fails): not every drive is an OCP drive."""
        try:
            raw = self.cli.json("ocp", "smart-add-log", self.device)
        except NvmeCliError:
            return None
        return parse_ocp_smart_log(raw, f"{self.device}: nvme ocp smart-add-log")

    def error_log(self) -> list[ErrorEntry]:
        return parse_error_log(*self._ask("error-log", self.device))

    def fw_log(self) -> FirmwareLog:
        return parse_fw_log(*self._ask("fw-log", self.device))
