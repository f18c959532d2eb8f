"""Block mode on an NVMe namespace (``/dev/nvmeXnY``): the block store, with the drive's own health.

`BlockStoreDevice` knows what a file or any block device can say (usage, its
settings, its events); an NVMe namespace also has a controller that reports its
temperature, spare, wear and supercapacitor through nvme-cli. This adds those:
health is the worse of the store's and the SMART log's (read at most once per
health interval, `DriveHealth`), and the aggregated status carries the
controller's firmware and sensors where nvme-cli answers.
"""

from __future__ import annotations

import dataclasses

from kvharbor.hal.base import CardStatus, Health, HealthState
from kvharbor.hal.block.store import BlockStoreDevice
from kvharbor.hal.nvme.card_view import supercap_state
from kvharbor.hal.nvme.cli import NvmeCliError
from kvharbor.hal.nvme.drive_health import HEALTH_INTERVAL_S_DEFAULT, DriveHealth
from kvharbor.hal.nvme.health import NvmeAdmin

DRIVER_NAME = "kvharbor-block-nvme"

_SEVERITY = {HealthState.OK: 0, HealthState.DEGRADED: 1, HealthState.FAILED: 2}


class NvmeBlockDevice(BlockStoreDevice):
    """A block store on an NVMe namespace; ``admin`` answers for its controller."""

    def __init__(
        self,
        name: str,
        path: str,
        max_value_bytes: int,
        admin: NvmeAdmin,
        *,
        region_bytes: int,
        health_interval_s: float = HEALTH_INTERVAL_S_DEFAULT,
        exclusive: bool = True,
    ) -> None:
        super().__init__(name, path, max_value_bytes, region_bytes=region_bytes, exclusive=exclusive)
        self._admin = admin
        self._drive = DriveHealth(admin, health_interval_s)

    def health(self) -> Health:
        store, drive = super().health(), self._drive.read()
        worse = store if _SEVERITY[store.state] >= _SEVERITY[drive.state] else drive
        detail = "; ".join(part for part in (store.detail, drive.detail) if part)
        return Health(worse.state, detail)

    def card_status(self) -> CardStatus:
        """The store's status with the controller's firmware and sensors; where nvme-cli
        cannot answer, the store's own (those fields read n/a) rather than no status."""
        status = super().card_status()
        try:
            ctrl, smart, ocp = self._admin.id_ctrl(), self._admin.smart_log(), self._admin.ocp_smart_log()
        except NvmeCliError:
            return dataclasses.replace(status, driver=DRIVER_NAME)
        return dataclasses.replace(
            status,
            driver=DRIVER_NAME,
            firmware_version=ctrl.firmware,
            temperature_c=float(smart.temperature_c),
            supercap=supercap_state(smart, ocp),
            flash_spare_percent=float(smart.available_spare_percent),
            flash_wear_percent=float(smart.percent_used),
        )
