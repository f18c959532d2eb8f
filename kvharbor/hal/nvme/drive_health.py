"""An NVMe drive's health from nvme-cli, read at most once per interval.

A tier's status asks its device's health on every status request; nvme-cli is a
subprocess per log. `DriveHealth` keeps the last reading for ``interval_s``
(`kvharbor.config.CardSection.health_interval_s`) so that a busy status page
costs one nvme-cli run per interval, not one per request. A drive that nvme-cli
cannot read (missing, failing, unexpected output) is reported as unknown in the
detail, never as a fault: the device serves as far as it answers its I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvharbor.hal.base import Health, HealthState
from kvharbor.hal.nvme.card_view import health_from_logs
from kvharbor.hal.nvme.cli import NvmeCliError
from kvharbor.hal.nvme.health import NvmeAdmin

HEALTH_INTERVAL_S_DEFAULT = 10.0


@dataclass(frozen=True, slots=True)
class _Reading:
    health: Health
    at_s: float


class DriveHealth:
    """The SMART (and OCP) verdict of one drive, cached; thread-safe."""

    def __init__(
        self,
        admin: NvmeAdmin,
        interval_s: float = HEALTH_INTERVAL_S_DEFAULT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"health interval_s must be > 0, got {interval_s}")
        self.admin = admin
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: _Reading | None = None

    def read(self) -> Health:
        """The last reading if younger than ``interval_s``, else a fresh one."""
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last.at_s >= self.interval_s:
                self._last = _Reading(self._ask(), now)
            return self._last.health

    def _ask(self) -> Health:
        try:
            return health_from_logs(self.admin.smart_log(), self.admin.ocp_smart_log())
        except NvmeCliError as err:
            return Health(HealthState.OK, f"its SMART log is unknown: {err}")
