"""What a card driver does with each status its card answers: count it, say it once, raise it typed.

Shared by every KV card driver (the simulator's now, the NVMe passthrough's
next), so that both treat the same code the same way:

- success: True; a missing key: False, counted, never logged (a card-backed
  cache's log is otherwise "full of" them, and they mean nothing);
- capacity exceeded: `DeviceFull` (the tier says "full" once);
- a lost path: `TargetUnreachable` (the tier is unavailable at once);
- any other code: said once per code with its meaning, then only counted, and
  raised as `DeviceTransient` or `DeviceError`.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvharbor.hal.base import DeviceError, DeviceFull, DeviceTransient, TargetUnreachable
from kvharbor.hal.kv_status import KEY_NOT_FOUND, SUCCESS, KvStatus, StatusClass
from kvharbor.telemetry.log import OnceLog, get_logger

_log = get_logger("kvharbor.hal.card")


class StatusJudge:
    def __init__(self, device: str) -> None:
        self.device = device
        self._counts: Counter[KvStatus] = Counter()
        self._lock = threading.Lock()
        self._once = OnceLog(_log)

    def judge(self, status: KvStatus, operation: str) -> bool:
        """True on success, False on a miss; raises the typed error of any other status."""
        if status == SUCCESS:
            return True
        with self._lock:
            self._counts[status] += 1
        kind = StatusClass.MISS if status is KEY_NOT_FOUND else status.kind
        if kind is StatusClass.MISS:
            return False
        detail = f"{operation} answered status {status.code} ({status.meaning})"
        if kind is StatusClass.FULL:
            raise DeviceFull(self.device, detail)
        self._once.say(f"status:{status.code}", f"card '{self.device}': {detail}; counted by code from now on")
        if kind is StatusClass.UNAVAILABLE:
            raise TargetUnreachable(self.device, detail)
        if kind is StatusClass.TRANSIENT:
            raise DeviceTransient(self.device, detail)
        raise DeviceError(self.device, detail)

    def counts(self) -> dict[str, int]:
        """Answers other than success so far, by code (``1/87h``: misses)."""
        with self._lock:
            return {status.code: count for status, count in self._counts.items()}
