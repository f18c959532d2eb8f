"""Emptying part of a cache: by namespace, by layout, or by age (``kvharbor purge``).

What a purge may go by, and where it is recorded:

- **layout**: every object header carries its fingerprint digest, and every key
  embeds it, so a key's layout is the same in every tier. ``--layout ID`` is the
  short form of the digest (`kvharbor.cache.keys.short_digest`, what status and
  logs show after ``#``) or any longer prefix of its hex. A card tier stores under
  a digest of its own (`kvharbor.cache.keys.tier_fingerprint`): its objects are
  told by the engine fingerprints this process saw (`Tier.engine_fingerprint`) or,
  failing that, by the same key matching in another tier.
- **namespace**: the header's namespace tag (`kvharbor.cache.format`). Objects that
  record none (stored before tags) are counted as ``namespace_unknown`` and kept,
  unless the same key matched in another tier.
- **age**: the index's last use (`TierIndex.stamped`). A value goes only when every
  tier that holds it last used it before the cutoff: a value used a minute ago in
  RAM is not old because the file tier has not been asked for it since.

A selection is made tier by tier and then removed from **every** tier, as DROP does
(`TieredStore.delete`): a value being read in place by a client is not freed under it
(the lending rule of `kvharbor.hal.base.SharedSpans`: its bytes live until unpinned).

The typed `PurgeFilter` and `PurgeReport` travel on the wire (PURGE, PURGED) and
print as the CLI's ``--json``, in one JSON form.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import TypeAdapter

from kvharbor.cache.format import HEADER_BYTES, CorruptObject, Header, parse_header
from kvharbor.cache.keys import KEY_BYTES, NAMESPACE_UNKNOWN, namespace_tag
from kvharbor.hal.base import DeviceError

if TYPE_CHECKING:  # The wire protocol imports the types above; it needs no tiers.
    from kvharbor.cache.tier import Tier

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
LAYOUT_ID_HEX_MIN = 6
"""The shortest layout ID accepted: fewer hex digits would match layouts by accident."""
_LAYOUT_ID = re.compile(f"[0-9a-f]{{{LAYOUT_ID_HEX_MIN},{2 * KEY_BYTES}}}")
STEP_KEYS = 256
"""Keys examined or removed between two progress reports: a file tier's delete is a manifest
transaction and an unlink per key, so a step stays well inside a client's request timeout."""


def parse_duration(text: str) -> float:
    """``2h``, ``30m``, ``7d``, ``90s``, ``1w`` (or a sum of them, ``1h30m``) in seconds;
    raises ValueError naming the text and the accepted form."""
    cleaned = text.strip().lower()
    parts = list(_DURATION.finditer(cleaned))
    if not cleaned or "".join(m.group(0) for m in parts) != cleaned:
        raise ValueError(
            f"--older-than {text!r} is not a duration: expected a number and a unit "
            "(s, m, h, d, w), e.g. 30m, 2h, 7d or 1h30m"
        )
    seconds = sum(float(m.group("number")) * _UNIT_S[m.group("unit")] for m in parts)
    if seconds <= 0:
        raise ValueError(f"--older-than {text!r} must be longer than 0")
    return seconds


def duration_text(seconds: float) -> str:
    """``seconds`` in the largest unit of `parse_duration` that holds it whole: ``7d``, ``90m``."""
    for unit, scale in sorted(_UNIT_S.items(), key=lambda item: -item[1]):
        if seconds >= scale and seconds % scale == 0:
            return f"{seconds // scale:g}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class PurgeFilter:
    """What to purge: exactly one of the three."""

    namespace: str | None = None
    """An ``engine.key_namespace``."""
    older_than_s: float | None = None
    """Values not used for this long."""
    layout: str | None = None
    """A layout ID: a prefix of a fingerprint digest's hex, lower case (see the module docstring)."""

    def __post_init__(self) -> None:
        given = [name for name in ("namespace", "older_than_s", "layout") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a purge names exactly one of namespace, older_than_s, layout; got {given or 'none'}")
        if self.older_than_s is not None and not self.older_than_s > 0:
            raise ValueError(f"older_than_s must be > 0, got {self.older_than_s}")
        if self.layout is not None and _LAYOUT_ID.fullmatch(self.layout) is None:
            raise ValueError(
                f"--layout {self.layout!r} is not a layout ID: expected the hex digits status shows after '#' "
                f"(at least {LAYOUT_ID_HEX_MIN}, at most {2 * KEY_BYTES})"
            )

    @classmethod
    def parse_layout(cls, text: str) -> PurgeFilter:
        """A layout filter from what a user typed (a leading ``#`` and upper case allowed)."""
        return cls(layout=text.strip().lower().removeprefix("#"))

    def describe(self) -> str:
        if self.namespace is not None:
            return f"namespace {self.namespace!r}"
        if self.layout is not None:
            return f"layout #{self.layout}"
        return f"values unused for {duration_text(self.older_than_s or 0)}"

    def to_json(self) -> str:
        return _FILTER.dump_json(self).decode()

    @staticmethod
    def from_json(text: str) -> PurgeFilter:
        return _FILTER.validate_json(text)


@dataclass(frozen=True, slots=True)
class TierPurge:
    """One tier's part of a purge."""

    tier: str
    objects: int
    """Values selected (removed, or to be removed without ``apply``)."""
    nbytes: int
    """Their bytes on the tier, headers and fragments included."""
    namespace_unknown: int = 0
    """Values whose header records no namespace, kept (a ``--namespace`` purge only)."""
    error: str = ""
    """Why this tier could not be searched (it was then left as it is); empty when it was."""


@dataclass(frozen=True, slots=True)
class PurgeReport:
    selection: PurgeFilter
    applied: bool
    """True: the values are gone; False: a dry run, nothing changed."""
    tiers: tuple[TierPurge, ...] = ()
    where: str = ""
    """Who did it: the gateway (its pid) or this process on the persistent tiers."""
    notes: tuple[str, ...] = field(default=())
    """What the user should know about what was not searched (a RAM tier with no gateway)."""

    @property
    def objects(self) -> int:
        return sum(t.objects for t in self.tiers)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tiers)

    def to_json(self) -> str:
        return _REPORT.dump_json(self).decode()

    @staticmethod
    def from_json(text: str) -> PurgeReport:
        return _REPORT.validate_json(text)


_FILTER: TypeAdapter[PurgeFilter] = TypeAdapter(PurgeFilter)
_REPORT: TypeAdapter[PurgeReport] = TypeAdapter(PurgeReport)


# -- selecting and removing ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Found:
    """What one tier's search found."""

    matched: set[bytes]
    unknown: set[bytes]
    """Keys whose namespace the header does not record."""
    error: str = ""


def purge(
    tiers: Sequence[Tier],
    selection: PurgeFilter,
    apply: bool,
    where: str,
    notes: tuple[str, ...] = (),
    progress: Callable[[int], None] | None = None,
    now_ns: int | None = None,
) -> PurgeReport:
    """Select what ``selection`` names on ``tiers`` and, with ``apply``, remove it from
    every one of them; returns what was (or would be) removed, per tier. ``progress``
    is told the steps done (`STEP_KEYS` keys examined or removed), so that a gateway
    keeps its client's request timeout from firing on a long purge.

    A tier that cannot be searched (its index or device failing) is reported with its
    error and left alone; the others are still purged.
    """
    steps = itertools.count(1)
    tell = progress or (lambda done: None)

    def step() -> None:
        tell(next(steps))

    now_ns = time.time_ns() if now_ns is None else now_ns
    found = {tier.name: _search(tier, selection, now_ns, step) for tier in tiers}
    selected = set().union(*(f.matched for f in found.values())) if found else set()
    if selection.older_than_s is not None:
        selected -= _used_since(tiers, found, selected)
    ordered = sorted(selected)
    report = PurgeReport(
        selection,
        apply,
        tuple(_tier_part(tier, found[tier.name], ordered) for tier in tiers),
        where,
        notes,
    )
    if apply:
        for start in range(0, len(ordered), STEP_KEYS):
            batch = ordered[start : start + STEP_KEYS]
            for tier in tiers:
                if not found[tier.name].error:
                    tier.delete(batch)
                step()
    return report


def _search(tier: Tier, selection: PurgeFilter, now_ns: int, step: Callable[[], None]) -> _Found:
    try:
        stamped = tier.index.stamped()
        step()
        if selection.older_than_s is not None:
            cutoff_ns = now_ns - int(selection.older_than_s * 1e9)
            return _Found({bytes(entry.key) for entry, stamp in stamped if stamp < cutoff_ns}, set())
        return _by_header(tier, selection, [entry.key for entry, _ in stamped], step)
    except DeviceError as err:
        return _Found(set(), set(), str(err))


def _by_header(tier: Tier, selection: PurgeFilter, keys: Sequence[bytes], step: Callable[[], None]) -> _Found:
    """Keys whose object header matches a namespace or layout selection (a header read each)."""
    want_tag = None if selection.namespace is None else namespace_tag(selection.namespace)
    matched: set[bytes] = set()
    unknown: set[bytes] = set()
    head = memoryview(bytearray(HEADER_BYTES))
    for done, key in enumerate(keys, 1):
        if done % STEP_KEYS == 0:
            step()
        header = _header(tier, key, head)
        if header is None:
            continue
        if want_tag is not None:
            if header.namespace == NAMESPACE_UNKNOWN:
                unknown.add(bytes(key))
            elif header.namespace == want_tag:
                matched.add(bytes(key))
        elif _layout_matches(tier, header.fingerprint, selection.layout or ""):
            matched.add(bytes(key))
    return _Found(matched, unknown)


def _header(tier: Tier, key: bytes, head: memoryview) -> Header | None:
    """The header of ``key``'s object (fragment 0, under the key itself); None when it is
    gone, damaged or of another format version: a damaged object is the reader's to count and
    drop, not a purge's, and another release's cannot be told (its header is its own)."""
    got = tier.device.peek(key, head)
    if got is None:
        return None
    try:
        return parse_header(head[:got])
    except CorruptObject:
        return None


def _layout_matches(tier: Tier, stored: bytes, layout_id: str) -> bool:
    assert LAYOUT_ID_HEX_MIN <= len(layout_id) <= 2 * KEY_BYTES, layout_id
    engine = tier.engine_fingerprint(stored)
    return engine is not None and engine.hex().startswith(layout_id)


def _used_since(tiers: Sequence[Tier], found: dict[str, _Found], old: set[bytes]) -> set[bytes]:
    """Of ``old`` keys (unused before the cutoff in some tier), those another tier holds
    and used since: they are not old."""
    candidates = sorted(old)
    fresh: set[bytes] = set()
    for tier in tiers:
        if found[tier.name].error or not candidates:
            continue
        try:
            held = tier.index.contains(candidates)
        except DeviceError:
            # Its last uses cannot be read now: keep every candidate rather than guess.
            return set(candidates)
        fresh.update(
            key for key, here in zip(candidates, held, strict=True) if here and key not in found[tier.name].matched
        )
    return fresh


def _tier_part(tier: Tier, found: _Found, selected: list[bytes]) -> TierPurge:
    if found.error:
        return TierPurge(tier.name, 0, 0, error=found.error)
    try:
        sizes = [n for n in tier.index.nbytes(selected) if n is not None] if selected else []
    except DeviceError as err:
        return TierPurge(tier.name, 0, 0, error=str(err))
    unknown = len(found.unknown - set(selected))
    return TierPurge(tier.name, len(sizes), sum(sizes), unknown)
