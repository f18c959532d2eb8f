"""Recovery: what a persistent device holds, told by the objects' own headers.

A device lists device keys; a value of several fragments is several objects,
each under its own device key. Every object's header names its logical key,
its fragment index and the fragment count, so reading the headers alone (a
`peek` of `HEADER_BYTES`, not the payloads) regroups the fragments into the
entries of the index.

An object that cannot be part of a readable value is dropped from the device:
a damaged header, a length that disagrees with it, a name that is not the one
its header implies, or a fragment whose siblings are missing or belong to
another write. A read would find each of these corrupt anyway; dropping them
now keeps their bytes from occupying the disk outside every budget.

An object of another format version (`ForeignFormat`) is another release's, on a tier
releases share: it is kept, never dropped. Its header past the version is that release's
own, so it is entered as it lies, one object under its device key and `FOREIGN_FINGERPRINT`:
the tier's budget counts its bytes and evicts it, least recently used, like any value, and
a write of this release never replaces it (`kvharbor.cache.tier.Tier.write`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvharbor.cache.format import FRAGMENTS_MAX, HEADER_BYTES, CorruptObject, ForeignFormat, Header, parse_header
from kvharbor.cache.index import Entry
from kvharbor.cache.keys import KEY_BYTES, fragment_key
from kvharbor.hal.base import Device

FOREIGN_FINGERPRINT = bytes(KEY_BYTES)
"""The fingerprint an object of another format version is indexed under: its own cannot be
read, and no layout's digest is all zeros (a BLAKE2b output)."""


@dataclass(frozen=True, slots=True)
class Recovered:
    entries: tuple[Entry, ...]
    """Whole values, in scan order."""
    objects: int
    """Device objects scanned, dropped ones included."""
    scanned_bytes: int
    dropped: int
    """Damaged or orphaned objects deleted from the device."""
    foreign: int = 0
    """Objects of another format version, kept (among ``entries``, one each)."""


@dataclass(frozen=True, slots=True)
class _Part:
    device_key: bytes
    nbytes: int
    fragment_count: int
    fingerprint: bytes


def recover_entries(device: Device) -> Recovered:
    """Scan ``device``, regroup fragments by their logical key, drop what cannot be read."""
    groups: dict[bytes, dict[int, _Part]] = {}
    damaged: list[bytes] = []
    foreign: list[Entry] = []
    objects = scanned_bytes = 0
    head = memoryview(bytearray(HEADER_BYTES))
    for device_key, nbytes in device.scan():
        objects += 1
        scanned_bytes += nbytes
        got = device.peek(device_key, head)
        if got is None:
            continue  # Deleted since the scan listed it.
        try:
            header = parse_header(head[:got])
        except ForeignFormat:
            foreign.append(Entry(bytes(device_key), nbytes, 1, FOREIGN_FINGERPRINT))
            continue
        except CorruptObject:
            damaged.append(device_key)
            continue
        if not _consistent(device_key, nbytes, header):
            damaged.append(device_key)
            continue
        group = groups.setdefault(header.key, {})
        group[header.fragment_index] = _Part(device_key, nbytes, header.fragment_count, header.fingerprint)
    entries = list(foreign)
    for key, group in groups.items():
        whole = _whole_value(group)
        kept = {part.device_key for part in whole}
        damaged.extend(part.device_key for part in group.values() if part.device_key not in kept)
        if whole:
            entries.append(Entry(key, sum(part.nbytes for part in whole), len(whole), whole[0].fingerprint))
    for device_key in damaged:
        device.delete(device_key)
    recovered = Recovered(tuple(entries), objects, scanned_bytes, len(damaged), len(foreign))
    kept_objects = sum(entry.parts for entry in recovered.entries)
    assert kept_objects + recovered.dropped <= recovered.objects, recovered
    return recovered


def _consistent(device_key: bytes, nbytes: int, header: Header) -> bool:
    """Whether an object is what its header says, stored where it belongs."""
    index, count = header.fragment_index, header.fragment_count
    if not 1 <= count <= FRAGMENTS_MAX or index >= count:
        return False
    if nbytes != HEADER_BYTES + header.payload_length:
        return False
    expected = header.key if index == 0 else fragment_key(header.key, index)
    return device_key == expected


def _whole_value(group: dict[int, _Part]) -> list[_Part]:
    """Fragments 0..n-1 of one write, as fragment 0 counts them; empty if any is missing.

    Fragments past the count are leftovers of an older, longer value under
    the same key; a fragment with another count is from another write.
    """
    first = group.get(0)
    if first is None:
        return []
    parts = [group.get(index) for index in range(first.fragment_count)]
    whole = [part for part in parts if part is not None]
    if len(whole) != first.fragment_count:
        return []
    if any(part.fragment_count != first.fragment_count for part in whole):
        return []
    return whole
