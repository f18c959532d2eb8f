"""`GatewayStatus`: what a gateway says about itself, as one typed, frozen structure.

Built by `kvharbor.gateway.server.Gateway.status`, sent over the socket in STATUS_OK,
parsed back into the same type on the client, printed by ``kvharbor status`` (human
form and ``--json``) and served by the dashboard's ``/api/status``: one JSON form for
all of them (`to_json`, `from_json`), made by a pydantic `TypeAdapter` over these
dataclasses, so a field added here reaches every reader at once and a reader never
sees an untyped dict.

Contract of the JSON form: an object whose ``release`` and ``protocol`` fields are
readable by any release (`peek_release`), so a reader of another release can say
which gateway answered even where the rest of the form is not its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.refill import RefillStatus
from kvharbor.cache.store import StoreStatus
from kvharbor.cache.tier import TierStatus
from kvharbor.hal.base import CardEventRecord, CardStatus


class StatusFormError(ValueError):
    """A status document that is not a `GatewayStatus` of this release; the text says why."""


@dataclass(frozen=True, slots=True)
class ShmStatus:
    """The gateway's shared-memory segment: the transfer ring, then the RAM tiers' regions."""

    path: str
    bytes: int
    ring_bytes: int
    free_bytes: int
    """Of the ring, bytes not lent to a transfer now."""
    pinned: int
    """Values pinned for in-place reads now."""
    in_place_bytes: int
    """Bytes reserved in RAM tiers for puts written in place now."""


@dataclass(frozen=True, slots=True)
class HitRate:
    """Hits against what was asked, in full-chunk tokens (see `kvharbor.telemetry.metrics.HitMetrics`
    and its recent window, `kvharbor.telemetry.window`)."""

    window_s: float
    """The recent window: ``telemetry.hit_rate_window_s``."""
    recent_lookup_tokens: int
    recent_hit_tokens: int
    lookup_tokens: int
    """Since the gateway started."""
    hit_tokens: int
    lookups: int

    @property
    def recent(self) -> float | None:
        """The hit rate of the recent window, or None when nothing was looked up in it."""
        return self.recent_hit_tokens / self.recent_lookup_tokens if self.recent_lookup_tokens else None

    @property
    def total(self) -> float | None:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else None


@dataclass(frozen=True, slots=True)
class AttachedClient:
    """A client that completed the handshake and is connected now."""

    name: str
    pid: int
    """Its process, as the kernel vouches for it (the socket's peer credentials)."""


@dataclass(frozen=True, slots=True)
class DetachedClient:
    """A client whose connection closed, kept in a short history (`DETACHED_KEPT`)."""

    name: str
    pid: int
    at_s: float
    """When, in seconds since the epoch."""
    unclean: bool
    """It went away with transfers open (a killed engine)."""
    process_alive: bool
    """Its process still ran when this status was taken: a rank that turned its external
    cache off closes its connections and keeps serving."""


@dataclass(frozen=True, slots=True)
class RegisteredLayout:
    """One layout a client registered at handshake (see `kvharbor.gateway.layouts`)."""

    digest: str
    """The 16-byte fingerprint digest, hex: what stored objects carry."""
    fingerprint: LayoutFingerprint
    """The full layout the digest is made of."""
    registered_by: str
    """The last client that registered it."""
    registered_at_s: float
    """When that was, in seconds since the epoch."""
    this_run: bool
    """Registered with this gateway since it started (not only known from a tier's registry file)."""

    @property
    def short(self) -> str:
        return self.fingerprint.short()


CARD_EVENTS_IN_STATUS = 64
"""Newest events of each card a status carries (a card keeps more in its own log)."""
RANKS_OFF_NOTE = (
    "a gateway sees a rank's cache off only when the rank closes its connections and its process lives on; "
    "each rank's own metric vllm:kvharbor_cache_off is the authority"
)


@dataclass(frozen=True, slots=True)
class GatewayStatus:
    release: str
    protocol: int
    pid: int
    socket: str
    config_digest: str
    """`kvharbor.config.ConfigDigest.short` of the config the gateway serves."""
    access: str
    """What ``gateway.access`` admits, in its own terms."""
    started_at_s: float
    start_clean: bool
    """Started with ``--start-clean=1``: every tier was emptied at start."""
    shm: ShmStatus
    clients: list[AttachedClient]
    detached: list[DetachedClient]
    transfers_open: int
    counters: dict[str, int]
    """The gateway's own counters (see `kvharbor.gateway.server.GatewayCounters`)."""
    rejected: dict[str, int]
    """Refused messages by `kvharbor.gateway.protocol.ErrorCode` name."""
    hit_rate: HitRate
    store: StoreStatus
    cards: dict[str, CardStatus]
    """The card section, by tier name, for each tier on a card."""
    card_events: dict[str, list[CardEventRecord]]
    """Each card's newest events (`CARD_EVENTS_IN_STATUS` at most), oldest first, by tier
    name: ``kvharbor card events --config`` reads them here while the gateway holds the card."""
    refill: RefillStatus
    layouts: list[RegisteredLayout]
    dashboard_url: str | None = None
    """Where the dashboard serves, when it does (filled by the dashboard)."""
    metrics_url: str | None = None
    """Where ``/metrics`` serves on ``telemetry.prometheus.port``, when it does (else on the dashboard's port)."""
    ranks_off_note: str = RANKS_OFF_NOTE

    # NaN: a card's temperature where the driver cannot read it. Written as the string
    # "NaN" (strict JSON has no NaN) and read back as the float; nested dataclasses
    # without a config of their own follow this one.
    __pydantic_config__ = ConfigDict(ser_json_inf_nan="strings")

    @property
    def ranks_cache_off(self) -> list[DetachedClient]:
        """Clients whose connection closed while their process lives on and holds no other
        connection here: ranks with the external cache off, as far as the gateway can see."""
        attached = {client.pid for client in self.clients}
        return [d for d in self.detached if d.process_alive and d.pid not in attached]

    def tier_conditions(self) -> dict[str, str]:
        """Each configured tier's condition in one phrase: ok, probe failed and why, breaker
        open, unavailable and why (open tiers in order, then those skipped at start)."""
        conditions = {tier.name: tier_condition(tier) for tier in self.store.tiers}
        conditions.update(self.store.skipped)
        return conditions

    def to_json(self, indent: int | None = None) -> str:
        return _adapter().dump_json(self, indent=indent).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> GatewayStatus:
        """Parse the JSON form; raises `StatusFormError` naming what does not fit."""
        try:
            return _adapter().validate_json(text)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the document"
            raise StatusFormError(f"not a gateway status of this release: {where}: {first['msg']}") from None

    def to_document(self) -> dict[str, Any]:
        """The JSON form as Python objects (for a JSON body built around it)."""
        document: dict[str, Any] = json.loads(self.to_json())
        return document


def tier_condition(tier: TierStatus) -> str:
    """One tier's condition: ``ok``, ``breaker open``, ``degraded: why`` or ``failed: why``."""
    if tier.breaker == "open":
        return f"breaker open{': ' + tier.health_detail if tier.health_detail else ''}"
    if tier.health == "ok":
        return "ok" if tier.breaker == "closed" else f"ok (breaker {tier.breaker.replace('_', '-')})"
    return f"{tier.health}{': ' + tier.health_detail if tier.health_detail else ''}"


def peek_release(text: str | bytes) -> tuple[str, int] | None:
    """The ``release`` and ``protocol`` of a status document of any release, or None when
    it has none: enough to name the gateway that answered in a form this release cannot read."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    release, protocol = document.get("release"), document.get("protocol")
    if isinstance(release, str) and isinstance(protocol, int):
        return release, protocol
    return None


@cache
def _adapter() -> TypeAdapter[GatewayStatus]:
    """Built on first use: the adapter costs milliseconds to build, and the gateway's
    import must stay light for the engines that embed it."""
    return TypeAdapter(GatewayStatus)
