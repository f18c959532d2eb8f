"""The card's event log: numbered events, as a card's storage service logs them.

Numbers are a contract (operators grep for them, `kvharbor card events` lists
them): 3xxx capacity, 4xxx temperature, 5xxx power and flash, 6xxx the remote
target. 3002 is the card guide's "card full": a write refused because the card
is full and key eviction is off. Each condition is logged when it starts, not
per operation (a full card refuses every write; its log gets one 3002 per
episode, and `CardEventLog.counts` counts them all).
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass


class CardEventCode(enum.IntEnum):
    # fmt: off
    CAPACITY_OK          = 3000  # CapacityUsage back to OK
    CAPACITY_WARNING     = 3001  # CapacityUsage reached WARNING
    CARD_FULL            = 3002  # a write refused: card full, key eviction off
    CAPACITY_CRITICAL    = 3003  # CapacityUsage reached CRITICAL
    KEY_EVICTION_ON      = 3010
    KEY_EVICTION_OFF     = 3011
    CARD_WIPED           = 3020
    TEMPERATURE_OK       = 4000
    TEMPERATURE_WARNING  = 4001  # at or above the warning temperature: throttled
    TEMPERATURE_CRITICAL = 4002
    SUPERCAP_OK          = 5000
    SUPERCAP_FAILED      = 5001  # power-loss protection lost: unflushed writes at risk
    POWER_LOSS           = 5002
    WRITES_LOST          = 5003  # a power loss without supercapacitor dropped unflushed writes
    TARGET_DOWN          = 6001  # the remote target stopped answering
    TARGET_UP            = 6002
    # fmt: on


@dataclass(frozen=True, slots=True)
class CardEvent:
    seq: int
    time_s: float
    """Card time."""
    code: CardEventCode
    message: str


class CardEventLog:
    """A bounded log of `CardEvent` with a count per code that is never dropped."""

    def __init__(self, events_max: int) -> None:
        self._events: deque[CardEvent] = deque(maxlen=events_max)
        self._seq = 0
        self.counts: Counter[CardEventCode] = Counter()

    def add(self, time_s: float, code: CardEventCode, message: str) -> CardEvent:
        self._seq += 1
        event = CardEvent(self._seq, time_s, code, message)
        self._events.append(event)
        self.counts[code] += 1
        return event

    def since(self, seq: int) -> list[CardEvent]:
        """Events after ``seq`` still in the log, oldest first."""
        return [e for e in self._events if e.seq > seq]

    @property
    def last_seq(self) -> int:
        return self._seq
