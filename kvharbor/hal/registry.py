"""Device drivers by tier type name: how a config's ``type:`` becomes a driver.

The config side of each type (its fields) lives in `kvharbor.config.TIER_TYPES`;
this table holds the factories. A test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable

from kvharbor.config import (
    CardSection,
    FileTierSection,
    IncompleteTierSection,
    NfsTierSection,
    NvmeTierSection,
    OntapTierSection,
    RamTierSection,
    S3TierSection,
    TierSection,
)
from kvharbor.hal.base import Device

DeviceFactory = Callable[[TierSection, CardSection, int], Device]
"""Builds a driver from its tier section, the `card` section (read by card drivers only)
and the largest value it must take."""


def _open_ram(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    from kvharbor.hal.ram import RamDevice

    assert isinstance(section, RamTierSection)
    return RamDevice(section.name, section.capacity_bytes, min(max_value_bytes, section.capacity_bytes))


def _open_file(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    from kvharbor.hal.file import open_file_device

    assert isinstance(section, FileTierSection)
    return open_file_device(section, max_value_bytes)


def _open_nvme(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    from kvharbor.hal.cards import open_card

    assert isinstance(section, NvmeTierSection)
    return open_card(section, card, max_value_bytes)


def _open_s3(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    from kvharbor.hal.s3 import open_s3_device

    assert isinstance(section, S3TierSection)
    return open_s3_device(section, max_value_bytes)


def _open_nfs(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    from kvharbor.hal.nfs import open_nfs_device

    assert isinstance(section, NfsTierSection)
    return open_nfs_device(section, max_value_bytes)


def _open_ontap(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    from kvharbor.hal.nfs import open_ontap_device

    assert isinstance(section, OntapTierSection)
    return open_ontap_device(section, max_value_bytes)


_FACTORIES: dict[str, DeviceFactory] = {
    "ram": _open_ram,
    "file": _open_file,
    "nvme": _open_nvme,
    "s3": _open_s3,
    "nfs": _open_nfs,
    "ontap": _open_ontap,
}


def register(type_name: str, factory: DeviceFactory) -> None:
    """Add a driver; a name can be registered once."""
    if type_name in _FACTORIES:
        raise ValueError(f"device type {type_name!r} is already registered")
    _FACTORIES[type_name] = factory


def device_types() -> list[str]:
    return sorted(_FACTORIES)


def open_device(section: TierSection, card: CardSection, max_value_bytes: int) -> Device:
    """Open the driver for ``section``; raises ValueError for an unknown type or a section
    that lacks required keys."""
    if isinstance(section, IncompleteTierSection):
        raise ValueError(section.reason)
    factory = _FACTORIES.get(section.type)
    if factory is None:
        known = ", ".join(device_types())
        raise ValueError(f"tier '{section.name}': unknown tier type {section.type!r}; known: {known}")
    return factory(section, card, max_value_bytes)
