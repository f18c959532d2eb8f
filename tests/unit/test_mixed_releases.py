"""Mixed releases on one shared file tier: objects of another format version are misses,
left in place, counted neither corrupt nor stale, and never replaced by this release.

The previous release's objects are written by a frozen copy of its encoder (format 1: the
96-byte header, the payload right after it), a newer release's by a header that only
shares the magic and the version with this one's: what a later format is bound to keep."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest
import xxhash

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import MAGIC, CorruptObject, ForeignFormat, encode, parse_header
from kvharbor.cache.keys import FORMAT_VERSION, ChunkKey, LayoutFingerprint
from kvharbor.cache.manifest import MANIFEST_FILE, open_manifest
from kvharbor.cache.recovery import FOREIGN_FINGERPRINT
from kvharbor.cache.tier import Damaged, Tier
from kvharbor.hal.file import FileDevice

FINGERPRINT = LayoutFingerprint(model_id="test/mixed", chunk_size=16).digest()
VALUE_BYTES = 20_000
OBJECT_MAX_BYTES = 1 << 20

# Format 1, frozen: magic, version, codec, reserved, key, fingerprint, fragment index and
# count, raw, stored and payload lengths, payload checksum, namespace tag, header checksum.
_V1_HEADER = struct.Struct("<4sHBB16s16sIIQQQQQQ")


def v1_object(key: bytes, fingerprint: bytes, value: bytes) -> bytes:
    """``value`` as the release before format 2 stored it (codec none, one part)."""
    prefix = _V1_HEADER.pack(
        MAGIC, 1, 0, 0, key, fingerprint, 0, 1, len(value), len(value), len(value),
        xxhash.xxh3_64_intdigest(value), 0, 0,
    )[:-8]  # fmt: skip
    return prefix + xxhash.xxh3_64_intdigest(prefix).to_bytes(8, "little") + value


def future_object(value: bytes) -> bytes:
    """An object of a format after this one: the magic and version, then its own layout."""
    return MAGIC + struct.pack("<H", FORMAT_VERSION + 1) + b"\xa5" * 200 + value


def new_key() -> ChunkKey:
    return ChunkKey(os.urandom(16))


def open_tier(root: Path, capacity_bytes: int = 1 << 24) -> Tier:
    device = FileDevice("shared", str(root), OBJECT_MAX_BYTES)
    return Tier("shared", device, open_manifest(device, "shared"), capacity_bytes, CircuitBreaker(BreakerSettings()))


def object_path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[0:2] / name[2:4] / name


@pytest.fixture
def shared(tmp_path: Path) -> tuple[Path, dict[bytes, bytes]]:
    """A tier directory holding one object of the previous format and one of the next,
    written by those releases (before this release's gateway opens it: no manifest yet)."""
    root = tmp_path / "tier"
    writer = FileDevice("other-releases", str(root), OBJECT_MAX_BYTES)
    old, new = new_key(), new_key()
    objects: dict[bytes, bytes] = {
        old: v1_object(old, FINGERPRINT, os.urandom(VALUE_BYTES)),
        new: future_object(os.urandom(VALUE_BYTES)),
    }
    for key, data in objects.items():
        writer.put(key, [data])
    writer.close()
    return root, objects


def test_parse_header_tells_another_format_version_from_damage() -> None:
    key = new_key()
    for data, version in ((v1_object(key, FINGERPRINT, b"v" * 50), 1), (future_object(b"v" * 50), FORMAT_VERSION + 1)):
        with pytest.raises(ForeignFormat) as raised:
            parse_header(data)
        assert raised.value.version == version
    (part,) = encode(key, FINGERPRINT, b"v" * 50)
    damaged = bytearray(part.header)
    damaged[40] ^= 1
    with pytest.raises(CorruptObject) as corrupt:
        parse_header(damaged)
    assert not isinstance(corrupt.value, ForeignFormat)


def test_objects_of_other_format_versions_are_misses_left_in_place(
    shared: tuple[Path, dict[bytes, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    root, objects = shared
    with caplog.at_level(logging.INFO):
        tier = open_tier(root)
        try:
            # Recovery keeps both, in the budget, under the foreign fingerprint.
            assert tier.contains(list(objects)) == [True, True]
            assert tier.index.layout_counts() == {FOREIGN_FINGERPRINT: 2}
            assert tier.index.used_bytes() == sum(len(data) for data in objects.values())
            for _ in range(2):
                for key in objects:
                    assert tier.read(key, FINGERPRINT) is None
                    assert tier.read_described(key) is None  # Not `Damaged`: nothing to drop.
            counts = tier.counters
            assert (counts.gets, counts.hits, counts.corrupt, counts.stale, counts.errors) == (4, 0, 0, 0, 0)
            # This release's own objects live beside them.
            mine = new_key()
            value = os.urandom(VALUE_BYTES)
            assert tier.write(mine, FINGERPRINT, value)
            got = tier.read(mine, FINGERPRINT)
            assert got is not None and bytes(got) == value
        finally:
            tier.close()
    for key, data in objects.items():
        assert object_path(root, key).read_bytes() == data, "another release's object is left as it was"
    said = [r.getMessage() for r in caplog.records if "another release" in r.getMessage()]
    assert len(said) == 2, said  # Once per version found, however many reads met it.
    assert any("format version 1 " in line for line in said)
    assert any(f"format version {FORMAT_VERSION + 1} " in line for line in said)
    assert "entries kept (2 of them objects of another format version" in caplog.text
    assert "corrupt" not in caplog.text


def test_a_restart_keeps_them_too(shared: tuple[Path, dict[bytes, bytes]]) -> None:
    root, objects = shared
    open_tier(root).close()
    assert open_tier(root).contains(list(objects)) == [True, True]  # From the manifest.
    for path in root.glob(MANIFEST_FILE + "*"):
        path.unlink()  # Rebuilt from a scan again.
    tier = open_tier(root)
    try:
        assert tier.contains(list(objects)) == [True, True]
    finally:
        tier.close()
    assert all(object_path(root, key).read_bytes() == data for key, data in objects.items())


def test_a_write_never_replaces_another_releases_object(
    shared: tuple[Path, dict[bytes, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """The rule: the key stays the other release's (two releases replacing each other's
    object under one key would fight); this release does not store it on this tier."""
    root, objects = shared
    tier = open_tier(root)
    try:
        for key in objects:
            assert not tier.write(key, FINGERPRINT, os.urandom(VALUE_BYTES))
            assert tier.read(key, FINGERPRINT) is None
        assert tier.counters.puts == 0
    finally:
        tier.close()
    assert all(object_path(root, key).read_bytes() == data for key, data in objects.items())
    assert caplog.text.count("is not replaced") == 1


def test_the_budget_ages_them_out_like_any_value(shared: tuple[Path, dict[bytes, bytes]]) -> None:
    """Left in place is not kept forever: a fleet that upgraded leaves its old objects to
    the least-recently-used eviction, not on the disk outside every budget."""
    root, objects = shared
    foreign_bytes = sum(len(data) for data in objects.values())
    (part,) = encode(new_key(), FINGERPRINT, bytes(VALUE_BYTES))
    tier = open_tier(root, capacity_bytes=foreign_bytes + part.nbytes)
    try:
        assert tier.write(new_key(), FINGERPRINT, os.urandom(VALUE_BYTES))  # Fits beside them.
        assert tier.counters.evictions == 0
        assert tier.write(new_key(), FINGERPRINT, os.urandom(VALUE_BYTES))
        assert tier.counters.evictions >= 1 and tier.counters.corrupt == 0
        assert tier.index.used_bytes() <= tier.capacity_bytes
    finally:
        tier.close()
    assert not all(object_path(root, key).exists() for key in objects)


def test_a_damaged_object_of_this_format_is_still_dropped(tmp_path: Path) -> None:
    """Telling another release's object apart changes nothing for damage."""
    tier = open_tier(tmp_path / "tier")
    try:
        key = new_key()
        assert tier.write(key, FINGERPRINT, os.urandom(VALUE_BYTES))
        path = object_path(tmp_path / "tier", key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(data)
        assert tier.read(key, FINGERPRINT) is None
        assert tier.counters.corrupt == 1 and not path.exists()
        assert not isinstance(tier.read_described(key), Damaged)  # Gone now: a plain miss.
    finally:
        tier.close()
