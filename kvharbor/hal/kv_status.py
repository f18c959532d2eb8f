"""NVMe Key Value command-set status codes: what each means and what the cache does with it.

A completion's status field carries a status code type (SCT, bits 10:8) and a
status code (SC, bits 7:0); CRD, More and DNR are ignored. The KV command set's
own codes are command specific (SCT 1h, NVM Express Key Value Command Set
Specification 1.0, "Command Specific Status Values"); path-related codes (SCT
3h) say the host lost its way to the controller, e.g. an NVMe-oF target that
restarts. The simulated card answers with these codes too, so that its driver
and the hardware's decode them the same way.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

SCT_GENERIC = 0x0
SCT_COMMAND_SPECIFIC = 0x1
SCT_MEDIA = 0x2
SCT_PATH = 0x3


class StatusClass(enum.Enum):
    """What a status means for the cache."""

    OK = "ok"
    MISS = "miss"
    """The key is not on the card: ordinary, counted, never logged per key."""
    FULL = "full"
    REFUSED = "refused"
    """The card will not take this value (key or value size): the value, not the card, is wrong."""
    UNAVAILABLE = "unavailable"
    """No path to the card: the tier is unavailable until it answers again."""
    TRANSIENT = "transient"
    OTHER = "other"


class KvStatus(NamedTuple):
    """A status code type and status code. A named tuple (not a frozen dataclass) because
    the driver counts every answer by it: its hash and equality are the tuple's, in C."""

    sct: int
    sc: int

    @staticmethod
    def decode(status: int) -> KvStatus:
        """From a completion's status field (DW3 bits 31:17 shifted down to bit 0)."""
        return KvStatus((status >> 8) & 0x7, status & 0xFF)

    def encode(self) -> int:
        return (self.sct << 8) | self.sc

    @property
    def code(self) -> str:
        """The short form logs and counters use, e.g. ``1/87h``."""
        return f"{self.sct:x}/{self.sc:02x}h"

    @property
    def meaning(self) -> str:
        known = _MEANINGS.get((self.sct, self.sc))
        return known[1] if known else "unknown status"

    @property
    def kind(self) -> StatusClass:
        known = _MEANINGS.get((self.sct, self.sc))
        if known is not None:
            return known[0]
        return StatusClass.UNAVAILABLE if self.sct == SCT_PATH else StatusClass.OTHER


SUCCESS = KvStatus(SCT_GENERIC, 0x00)
CAPACITY_EXCEEDED = KvStatus(SCT_COMMAND_SPECIFIC, 0x81)
INVALID_VALUE_SIZE = KvStatus(SCT_COMMAND_SPECIFIC, 0x85)
INVALID_KEY_SIZE = KvStatus(SCT_COMMAND_SPECIFIC, 0x86)
KEY_NOT_FOUND = KvStatus(SCT_COMMAND_SPECIFIC, 0x87)
INTERNAL_PATH_ERROR = KvStatus(SCT_PATH, 0x00)
HOST_PATHING_ERROR = KvStatus(SCT_PATH, 0x70)
NAMESPACE_NOT_READY = KvStatus(SCT_GENERIC, 0x82)
INTERNAL_ERROR = KvStatus(SCT_GENERIC, 0x06)

# fmt: off
_MEANINGS: dict[tuple[int, int], tuple[StatusClass, str]] = {
    (SCT_GENERIC, 0x00):          (StatusClass.OK,          "successful completion"),
    (SCT_GENERIC, 0x06):          (StatusClass.OTHER,       "internal error"),
    (SCT_GENERIC, 0x82):          (StatusClass.TRANSIENT,   "namespace not ready"),
    (SCT_COMMAND_SPECIFIC, 0x81): (StatusClass.FULL,        "capacity exceeded (card full)"),
    (SCT_COMMAND_SPECIFIC, 0x85): (StatusClass.REFUSED,     "invalid value size"),
    (SCT_COMMAND_SPECIFIC, 0x86): (StatusClass.REFUSED,     "invalid key size"),
    (SCT_COMMAND_SPECIFIC, 0x87): (StatusClass.MISS,        "key does not exist"),
    (SCT_PATH, 0x00):             (StatusClass.UNAVAILABLE, "internal path error"),
    (SCT_PATH, 0x70):             (StatusClass.UNAVAILABLE, "host pathing error (target unreachable)"),
}
# fmt: on
