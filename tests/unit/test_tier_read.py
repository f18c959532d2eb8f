"""A tier reads values in slices, checksumming each as it lands: damage anywhere is still caught.

The tier reads through `Device.get_streamed` and verifies with the checksum
computed on the way (`kvharbor.cache.format.PayloadChecksum`), never hashing
the value a second time. These tests make sure that path is the one taken,
that it returns the value, and that one flipped byte anywhere in a value many
slices long (at a slice boundary too, in a later fragment too) is a counted
miss that drops the object, never a wrong value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvharbor.cache import format
from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint, fragment_key
from kvharbor.cache.manifest import open_manifest
from kvharbor.cache.tier import Tier
from kvharbor.hal.base import STREAM_SLICE_BYTES, Buffer, Device, SliceConsumer
from kvharbor.hal.file import FileDevice
from kvharbor.hal.ram import RamDevice

FINGERPRINT = LayoutFingerprint(model_id="test/model", chunk_size=16).digest()
KEY = ChunkKey(bytes(range(16)))
VALUE_BYTES = 3 * STREAM_SLICE_BYTES + 1000  # Four slices, the last a short one.
FRAGMENT_BYTES = HEADER_BYTES + STREAM_SLICE_BYTES + 500  # Fragments of two slices each.
CAPACITY = 64 * VALUE_BYTES


def value_bytes() -> bytes:
    return bytes(i * 31 % 251 for i in range(VALUE_BYTES))


TierFactory = Callable[[Path], Tier]


def file_tier(max_value_bytes: int) -> TierFactory:
    def make(root: Path) -> Tier:
        device = FileDevice("local", str(root), max_value_bytes)
        return Tier("local", device, open_manifest(device, "local"), CAPACITY, CircuitBreaker(BreakerSettings()))

    return make


def ram_tier(root: Path) -> Tier:
    device = RamDevice("ram", CAPACITY, VALUE_BYTES + HEADER_BYTES)
    return Tier("ram", device, MemoryIndex(), CAPACITY, CircuitBreaker(BreakerSettings()))


TIERS: dict[str, TierFactory] = {
    "file": file_tier(VALUE_BYTES + HEADER_BYTES),
    "file-fragmented": file_tier(FRAGMENT_BYTES),
    "ram": ram_tier,  # The default get_streamed: whole get, then slices.
}


@pytest.fixture(params=sorted(TIERS))
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    made = TIERS[request.param](tmp_path / "tier")
    yield made
    made.close()


class SliceCount:
    """Counts the reads and slices of a device's get_streamed, and makes sure no
    payload is hashed a second time after it was read."""

    def __init__(self, device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = self.slices = 0
        real = device.get_streamed

        def counted(
            key: bytes, into: memoryview, consume: SliceConsumer, slice_bytes: int = STREAM_SLICE_BYTES
        ) -> int | None:
            self.reads += 1

            def each(piece: memoryview) -> None:
                self.slices += 1
                consume(piece)

            return real(key, into, each, slice_bytes)

        monkeypatch.setattr(device, "get_streamed", counted)
        monkeypatch.setattr(format, "checksum", _headers_only)


_real_checksum = format.checksum


def _headers_only(data: Buffer) -> int:
    assert memoryview(data).nbytes < HEADER_BYTES, "a payload was hashed again after the read"
    return _real_checksum(data)


def flip(device: Device, device_key: bytes, position: int) -> None:
    """Damage one byte of a stored object, through the device itself (any driver)."""
    size = device.size(device_key)
    assert size is not None and 0 <= position < size
    data = bytearray(size)
    assert device.get(device_key, memoryview(data)) == size
    data[position] ^= 0x20
    device.put(device_key, [data])


def test_a_value_of_many_slices_reads_back_whole(tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    value = value_bytes()
    assert tier.write(KEY, FINGERPRINT, value)
    counted = SliceCount(tier.device, monkeypatch)
    got = tier.read(KEY, FINGERPRINT)
    assert got is not None and bytes(got) == value
    assert counted.slices >= 4 and counted.reads >= 1
    assert tier.counters.hits == 1 and tier.counters.corrupt == 0


# Positions in the stored object of fragment 0 (header included): the header,
# the first payload byte, both sides of the first slice boundary, the middle,
# the last byte.
POSITIONS = [
    10,
    HEADER_BYTES,
    STREAM_SLICE_BYTES - 1,
    STREAM_SLICE_BYTES,
    STREAM_SLICE_BYTES + 777,
    -1,
]


@pytest.mark.parametrize("position", POSITIONS)
def test_one_flipped_byte_anywhere_is_a_counted_miss_that_drops_the_object(
    tier: Tier, position: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tier.write(KEY, FINGERPRINT, value_bytes())
    size = tier.device.size(KEY)
    assert size is not None
    flip(tier.device, KEY, position % size)
    counted = SliceCount(tier.device, monkeypatch)
    assert tier.read(KEY, FINGERPRINT) is None
    assert counted.reads >= 1
    assert tier.counters.corrupt == 1 and tier.counters.hits == 0
    assert tier.device.size(KEY) is None and tier.index.get(KEY) is None  # Dropped.
    assert tier.read(KEY, FINGERPRINT) is None and tier.counters.corrupt == 1  # Now a plain miss.


def test_a_flipped_byte_in_the_middle_of_a_later_fragment_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = TIERS["file-fragmented"](tmp_path / "tier")
    assert tier.write(KEY, FINGERPRINT, value_bytes())
    entry = tier.index.get(KEY)
    assert entry is not None and entry.parts >= 3
    flip(tier.device, fragment_key(KEY, 2), HEADER_BYTES + STREAM_SLICE_BYTES // 2 + 3)
    SliceCount(tier.device, monkeypatch)
    assert tier.read(KEY, FINGERPRINT) is None
    assert tier.counters.corrupt == 1
    assert all(tier.device.size(fragment_key(KEY, i) if i else KEY) is None for i in range(entry.parts))
    tier.close()
