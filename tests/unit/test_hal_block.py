"""The block store (`kvharbor.hal.block`) on a file and on a loop block device: format,
bad input, rebuild, checksums, FIFO eviction and card full. The device contract
is in test_hal_contract.py; crashes in test_block_crash.py."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache.format import HEADER_BYTES, Codec, PayloadChecksum, decode, encode
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.cache.recovery import recover_entries
from kvharbor.hal.base import DeviceEventKind, DeviceFull, DeviceUnavailable, HealthState
from kvharbor.hal.block.direct import AlignedBuffer, open_direct
from kvharbor.hal.block.layout import (
    BLOCK_BYTES,
    FORMAT_MAGIC,
    FORMAT_VERSION,
    OBJECT_HEADER_BYTES,
    REGION_HEADER_BYTES,
    SUPERBLOCK_BYTES,
    LayoutError,
    ValueLayout,
    checksum,
    object_span,
    round_up,
)
from kvharbor.hal.block.pipeline import CHUNK_BYTES, FIRST_CHUNK_BYTES, _Segments, chunk_plan, in_place_run
from kvharbor.hal.block.store import IN_PLACE_MIN_BYTES, BlockStoreDevice
from kvharbor.hal.checksum import SEGMENT_BYTES, combine, segment_digest
from kvharbor.hal.checksum import checksum as body_checksum
from kvharbor.hal.ram import RamDevice

REGION_BYTES = 256 * 1024
VALUE_MAX_BYTES = 64 * 1024
REGIONS = 8
STORE_BYTES = SUPERBLOCK_BYTES + REGIONS * REGION_BYTES


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def value(n: int, nbytes: int = 20_000) -> bytes:
    return n.to_bytes(4, "big") * (nbytes // 4)


def collector(into: list[bytes]) -> Callable[[memoryview], None]:
    """A streamed get's consumer that keeps a copy of each slice in ``into``."""
    return lambda piece: into.append(bytes(piece))


def open_store(path: Path | str, **options: Any) -> BlockStoreDevice:
    return BlockStoreDevice(
        "card", str(path), VALUE_MAX_BYTES, region_bytes=REGION_BYTES, create_bytes=STORE_BYTES, **options
    )


def read(store: BlockStoreDevice, k: bytes) -> bytes | None:
    buffer = memoryview(bytearray(VALUE_MAX_BYTES))
    n = store.get(k, buffer)
    return None if n is None else bytes(buffer[:n])


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "card.blocks"


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    """A real block device: a loop device over a file, detached afterwards."""
    backing = tmp_path / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(STORE_BYTES)
    device = subprocess.run(
        ["losetup", "-f", "--show", str(backing)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=True)


def test_a_reopened_store_rebuilds_its_index_from_the_regions(store_path: Path) -> None:
    store = open_store(store_path)
    for n in range(30):  # Three regions' worth: the index spans several.
        store.put(key(n), [value(n)])
    store.put(key(4), [b"replaced"])
    store.delete(key(7))
    store.put(key(8), [])
    before = dict(store.scan())
    store.close()
    store = open_store(store_path)
    try:
        assert dict(store.scan()) == before
        assert read(store, key(4)) == b"replaced"
        assert read(store, key(7)) is None, "a delete survives a restart"
        assert read(store, key(8)) == b""
        assert all(read(store, key(n)) == value(n) for n in range(9, 30))
        store.put(key(100), [b"after"])  # Appends continue after the rebuilt tail.
        assert read(store, key(100)) == b"after" and read(store, key(29)) == value(29)
    finally:
        store.close()


def test_a_file_of_another_format_is_refused_naming_the_path(store_path: Path) -> None:
    store_path.write_bytes(b"SQLite format 3\x00" + bytes(STORE_BYTES))
    with pytest.raises(LayoutError, match=rf"{store_path} belongs to another format"):
        open_store(store_path)
    assert store_path.read_bytes()[:6] == b"SQLite", "a foreign file is never overwritten"


def test_a_file_too_small_is_refused_naming_the_path_and_the_size_needed(store_path: Path) -> None:
    store_path.write_bytes(bytes(REGION_BYTES))
    with pytest.raises(LayoutError, match=rf"{store_path}: {REGION_BYTES} bytes is too small .* at least"):
        open_store(store_path)


def set_format_version(path: Path, version: int) -> None:
    """Rewrite block 0 as a store of format ``version`` would have it, with a valid checksum."""
    with open(path, "r+b") as f:
        body = bytearray(f.read(56))  # magic, version, geometry, store id: then the checksum.
        struct.pack_into("<I", body, 8, version)
        f.seek(0)
        f.write(bytes(body) + struct.pack("<Q", checksum(bytes(body), 0)))


def test_a_newer_format_version_is_refused_naming_it(store_path: Path) -> None:
    store = open_store(store_path)
    store.put(key(1), [value(1)])
    store.close()
    set_format_version(store_path, FORMAT_VERSION + 1)
    with pytest.raises(LayoutError, match=rf"{store_path}: a newer kvharbor's block store \(format version"):
        open_store(store_path)
    set_format_version(store_path, FORMAT_VERSION)
    assert read(open_store(store_path), key(1)) == value(1), "a refused store is left as it was"


def test_an_older_format_version_is_formatted_again_and_says_so(
    store_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(store_path)
    store.put(key(1), [value(1)])
    store.close()
    set_format_version(store_path, FORMAT_VERSION - 1)
    with caplog.at_level(logging.WARNING, logger="kvharbor.hal.block"):
        store = open_store(store_path)
    try:
        assert f"{store_path} holds a block store of format version {FORMAT_VERSION - 1}" in caplog.text
        assert read(store, key(1)) is None and list(store.scan()) == [], "an older release's objects are gone"
        store.put(key(2), [value(2)])
        assert read(store, key(2)) == value(2)
    finally:
        store.close()
    with open(store_path, "rb") as f:
        assert struct.unpack_from("<I", f.read(12), 8)[0] == FORMAT_VERSION


def test_a_region_that_cannot_hold_a_value_is_refused_naming_the_setting(store_path: Path) -> None:
    with pytest.raises(ValueError, match=r"region_bytes 65536 must .* hold"):
        BlockStoreDevice("card", str(store_path), VALUE_MAX_BYTES, region_bytes=64 * 1024, create_bytes=STORE_BYTES)


def test_an_absent_file_without_a_size_is_unavailable_naming_the_path(store_path: Path) -> None:
    with pytest.raises(DeviceUnavailable, match=rf"{store_path} does not exist"):
        BlockStoreDevice("card", str(store_path), VALUE_MAX_BYTES, region_bytes=REGION_BYTES)


def test_a_store_open_in_another_process_is_refused(store_path: Path) -> None:
    store = open_store(store_path)
    try:
        # flock is per open file description: a second open is refused like another process's.
        with pytest.raises(DeviceUnavailable, match="in use by another process"):
            open_store(store_path)
    finally:
        store.close()
    open_store(store_path).close()  # Free again once closed.


def test_a_damaged_object_is_a_counted_miss_never_wrong_bytes(store_path: Path) -> None:
    store = open_store(store_path)
    try:
        store.put(key(1), [value(1)])
        store.put(key(2), [value(2)])
        # Flip one byte of key 1's value on the device, behind the store's back.
        with open(store_path, "r+b") as f:
            at = SUPERBLOCK_BYTES + BLOCK_BYTES + OBJECT_HEADER_BYTES + 1000
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert read(store, key(1)) is None
        assert store.status_counts()["checksum_mismatch"] == 1
        assert store.exists([key(1), key(2)]) == [False, True], "a damaged object leaves the index"
        assert read(store, key(2)) == value(2)
    finally:
        store.close()


def test_peek_reads_the_prefix_only_and_get_still_verifies_the_whole(store_path: Path) -> None:
    store = open_store(store_path)
    try:
        store.put(key(1), [value(1, 40_000)])
        with open(store_path, "r+b") as f:  # Damage the value's last block only.
            f.seek(SUPERBLOCK_BYTES + BLOCK_BYTES + OBJECT_HEADER_BYTES + 39_000)
            f.write(b"\xff" * 8)
        prefix = bytearray(100)
        assert store.peek(key(1), memoryview(prefix)) == 100 and bytes(prefix) == value(1, 40_000)[:100]
        assert read(store, key(1)) is None
        assert store.peek(key(1), memoryview(prefix)) is None, "a failed get took it out of the index"
    finally:
        store.close()


def test_key_eviction_on_keeps_accepting_writes_and_drops_the_oldest_first(store_path: Path) -> None:
    store = open_store(store_path)
    try:
        written = 4 * REGIONS * (REGION_BYTES // 24_576)  # Four times the capacity.
        for n in range(written):
            store.put(key(n), [value(n)])
        assert read(store, key(written - 1)) == value(written - 1)
        assert read(store, key(0)) is None, "the oldest region went first"
        kept = [n for n in range(written) if store.exists([key(n)])[0]]
        assert kept == list(range(kept[0], written)), "FIFO: what is kept is the newest, contiguous"
        assert all(read(store, key(n)) == value(n) for n in kept)
        events = store.drain_events()
        assert events and {e.kind for e in events} == {DeviceEventKind.EVICTED}
        assert store.status_counts()["evicted_keys"] == written - len(kept)
        assert store.health().state is HealthState.OK
    finally:
        store.close()


def test_key_eviction_off_refuses_with_card_full_and_event_3002_once(store_path: Path) -> None:
    store = open_store(store_path, key_eviction=False)
    try:
        stored = 0
        with pytest.raises(DeviceFull, match="full and key eviction is off"):
            while True:
                store.put(key(stored), [value(stored)])
                stored += 1
        with pytest.raises(DeviceFull):
            store.put(key(10_000), [value(0)])
        assert all(read(store, key(n)) == value(n) for n in range(stored)), "a refusal changes nothing"
        assert [e.code for e in store.card_events()] == [3002], "one event per episode"
        assert [e.kind for e in store.drain_events()] == [DeviceEventKind.FULL]
        assert store.health().state is HealthState.DEGRADED
        assert store.card_status().capacity_usage.value == "CRITICAL"
        # Deleting everything in the oldest regions frees them, eviction still off.
        for n in range(stored):
            store.delete(key(n))
        store.put(key(20_000), [value(7)])
        assert read(store, key(20_000)) == value(7)
        store.set_key_eviction(True)
        assert [e.code for e in store.card_events()][-1] == 3010
    finally:
        store.close()


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A filesystem that refuses O_DIRECT (ramfs; tmpfs takes it since Linux 6.6), unmounted afterwards."""
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_filesystem_refusing_o_direct_falls_back_and_says_so_once(
    ramfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvharbor.hal.block"):
        store = open_store(ramfs / "card.blocks")
    try:
        assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1
        assert not store.direct_io
        for n in range(20):
            store.put(key(n), [value(n)])
        assert all(read(store, key(n)) == value(n) for n in range(20))
    finally:
        store.close()


def test_on_a_loop_block_device(loop_device: str) -> None:
    store = BlockStoreDevice("card", loop_device, VALUE_MAX_BYTES, region_bytes=REGION_BYTES)
    try:
        assert store.usage().capacity_bytes == REGIONS * REGION_BYTES
        assert store.direct_io, "a block device takes O_DIRECT"
        for n in range(40):
            store.put(key(n), [value(n)])
        store.delete(key(39))
    finally:
        store.close()
    store = BlockStoreDevice("card", loop_device, VALUE_MAX_BYTES, region_bytes=REGION_BYTES)
    try:
        kept = [n for n in range(39) if read(store, key(n)) == value(n)]
        assert kept == list(range(kept[0], 39)) and read(store, key(39)) is None
        assert store.card_status().paths == (loop_device,)
    finally:
        store.close()
    with open(loop_device, "rb") as raw:
        assert raw.read(8) == FORMAT_MAGIC


def test_a_used_block_device_of_another_format_is_refused(loop_device: str) -> None:
    with open(loop_device, "r+b") as raw:
        raw.write(b"\xeb\x3c\x90mkfs.fat")  # A FAT boot sector's first bytes.
    with pytest.raises(LayoutError, match=rf"{loop_device} belongs to another format"):
        BlockStoreDevice("card", loop_device, VALUE_MAX_BYTES, region_bytes=REGION_BYTES)


def test_values_of_several_chunks_in_odd_parts_come_back_whole(tmp_path: Path) -> None:
    # Past CHUNK_BYTES the I/O overlaps the copy and the checksum: chunk edges inside parts and blocks.
    big = 3 * CHUNK_BYTES + 12_345
    region_bytes = REGION_HEADER_BYTES + object_span(big)  # One value per region.
    path = str(tmp_path / "big.blocks")
    store = BlockStoreDevice("card", path, big, region_bytes=region_bytes, create_bytes=4096 + 2 * region_bytes)
    try:
        data = os.urandom(big)
        cuts = [0, 7, CHUNK_BYTES - 3, CHUNK_BYTES + 5000, 2 * CHUNK_BYTES + 1, big]
        store.put(key(1), [data[a:b] for a, b in itertools.pairwise(cuts)])
        into = memoryview(bytearray(big + 10))
        assert store.get(key(1), into) == big and bytes(into[:big]) == data
        slices: list[bytes] = []
        assert store.get_streamed(key(1), into, lambda piece: slices.append(bytes(piece))) == big
        assert b"".join(slices) == data
    finally:
        store.close()


def test_a_block_aligned_payload_is_written_where_it_lies_and_comes_back_whole(tmp_path: Path) -> None:
    """The tier's shape of a put: a cache header, then a payload the caller holds block-aligned
    (shared memory). The payload lands on the block edge after the object header's block, so
    that it is written from the caller's memory, and reads back whole after a reopen too."""
    header, data = os.urandom(100), os.urandom(IN_PLACE_MIN_BYTES + 3 * CHUNK_BYTES + 777)
    total = len(header) + len(data)
    # A split takes a block more here (a partial block at both ends): room for it.
    room = total + BLOCK_BYTES
    region_bytes = REGION_HEADER_BYTES + object_span(room)  # One value per region.
    path = str(tmp_path / "split.blocks")
    payload = AlignedBuffer(round_up(len(data)))
    payload.view[: len(data)] = data
    store = BlockStoreDevice("card", path, room, region_bytes=region_bytes, create_bytes=4096 + 2 * region_bytes)
    try:
        store.put(key(1), [header, payload.view[: len(data)]])
        store.put(key(2), [header, data])  # Read-only: copied, contiguous.
        with open(path, "rb") as f:
            f.seek(SUPERBLOCK_BYTES + REGION_HEADER_BYTES + BLOCK_BYTES)
            assert f.read(len(data)) == data
        store.close()
        store = BlockStoreDevice("card", path, room, region_bytes=region_bytes)
        into = memoryview(bytearray(total))
        for k in (key(1), key(2)):
            assert store.get(k, into) == total and bytes(into) == header + data
            slices: list[bytes] = []
            assert store.get_streamed(k, into, collector(slices)) == total
            assert b"".join(slices) == header + data
            assert store.peek(k, into[: len(header) + 10]) == len(header) + 10
            assert bytes(into[: len(header) + 10]) == header + data[:10]
    finally:
        store.close()
        payload.close()


def test_a_get_into_aligned_memory_reads_in_place_and_still_verifies(tmp_path: Path) -> None:
    """Where the caller's buffer puts the value's blocks at addresses O_DIRECT can read into
    (a payload page-aligned after its header, as a put takes it), they are read there, not
    copied; every destination gets the same bytes, and a damaged block read in place is a miss."""
    header, data = os.urandom(100), os.urandom(2 * CHUNK_BYTES + 777)
    total = len(header) + len(data)
    room = total + BLOCK_BYTES
    region_bytes = REGION_HEADER_BYTES + object_span(room)
    path = tmp_path / "in-place.blocks"
    payload = AlignedBuffer(round_up(len(data)))
    payload.view[: len(data)] = data
    dest = AlignedBuffer(round_up(total) + 2 * BLOCK_BYTES)
    split, contiguous = ValueLayout(total, len(header), BLOCK_BYTES), ValueLayout(total)
    # A payload on a page edge for the split object; block 1 of the object on one for the contiguous.
    destinations = {
        "payload page-aligned": (dest.view[BLOCK_BYTES - len(header) :], split),
        "block 1 page-aligned": (dest.view[OBJECT_HEADER_BYTES:], contiguous),
        "odd address": (dest.view[1:], None),
    }
    for name, (into, layout) in destinations.items():
        for candidate in (split, contiguous):
            run = in_place_run(candidate.ranges(), into, BLOCK_BYTES)
            assert (run is not None) == (candidate == layout), (name, candidate)
    store = BlockStoreDevice("card", str(path), room, region_bytes=region_bytes, create_bytes=4096 + 3 * region_bytes)
    try:
        store.put(key(1), [header, payload.view[: len(data)]])  # Split.
        store.put(key(2), [header, data])  # Contiguous.
        for name, (into, _) in destinations.items():
            for k in (key(1), key(2)):
                into[:total] = bytes(total)
                assert store.get(k, into) == total and bytes(into[:total]) == header + data, (name, k)
        with open(path, "r+b") as f:  # Key 1's payload block 2, which a get reads in place.
            at = SUPERBLOCK_BYTES + REGION_HEADER_BYTES + 3 * BLOCK_BYTES + 5
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert store.get(key(1), destinations["payload page-aligned"][0]) is None
        assert store.status_counts()["checksum_mismatch"] == 1
    finally:
        store.close()
        for view, _ in destinations.values():
            view.release()
        payload.close()
        dest.close()


def test_o_direct_reads_into_memory_aligned_as_the_kernel_states(store_path: Path) -> None:
    """The alignment `in_place_run` relies on (``statx``'s, here ext4's): a read into an address
    aligned to it and to nothing larger is accepted (too small a figure would be EINVAL)."""
    store_path.write_bytes(os.urandom(2 * BLOCK_BYTES))
    opened = open_direct(str(store_path))
    buffer = AlignedBuffer(3 * BLOCK_BYTES)
    try:
        align = opened.memory_align_bytes
        assert opened.direct and BLOCK_BYTES % align == 0
        at = align if align < BLOCK_BYTES else 0
        assert os.preadv(opened.fd, [buffer.view[at : at + BLOCK_BYTES]], BLOCK_BYTES) == BLOCK_BYTES
        assert bytes(buffer.view[at : at + BLOCK_BYTES]) == store_path.read_bytes()[BLOCK_BYTES:]
    finally:
        os.close(opened.fd)
        buffer.close()


def test_chunks_cover_a_span_exactly_small_at_both_ends() -> None:
    for nbytes in (BLOCK_BYTES, 3 * FIRST_CHUNK_BYTES, 32 << 20, (32 << 20) + 5 * BLOCK_BYTES):
        chunks = chunk_plan(BLOCK_BYTES, BLOCK_BYTES + nbytes)
        assert [lo for lo, _ in chunks[1:]] == [hi for _, hi in chunks[:-1]]
        assert chunks[0][0] == BLOCK_BYTES and chunks[-1][1] == BLOCK_BYTES + nbytes
        assert all((hi - lo) % BLOCK_BYTES == 0 and 0 < hi - lo <= CHUNK_BYTES for lo, hi in chunks)
    big = chunk_plan(0, 32 << 20)
    assert big[0][1] - big[0][0] == big[-1][1] - big[-1][0] == FIRST_CHUNK_BYTES


def test_a_cache_index_can_be_rebuilt_from_a_reopened_store(store_path: Path) -> None:
    """What a card tier in block mode needs after a gateway restart: the cache's own
    recovery (scan, then peek at each object's header) finds every value, fragments regrouped."""
    fingerprint = LayoutFingerprint(model_id="block-test", chunk_size=16).digest()
    payloads = {ChunkKey(os.urandom(16)): os.urandom(n) for n in (100, 30_000, 150_000)}
    store = open_store(store_path)
    for chunk, payload in payloads.items():
        for part in encode(chunk, fingerprint, payload, Codec.NONE, store.max_value_bytes):
            store.put(part.device_key, [part.header, part.payload])
    store.close()
    store = open_store(store_path)
    try:
        recovered = recover_entries(store)
        parts = {entry.key: entry.parts for entry in recovered.entries}
        assert recovered.dropped == 0 and set(parts) == {bytes(chunk) for chunk in payloads}
        assert max(parts.values()) > 1, "the largest value was stored in fragments"

        def read_part(device_key: ChunkKey) -> memoryview | None:
            buffer = memoryview(bytearray(VALUE_MAX_BYTES))
            got = store.get(device_key, buffer)
            return None if got is None else buffer[:got]

        for chunk, payload in payloads.items():
            value = decode(chunk, fingerprint, read_part)
            assert value is not None and bytes(value) == payload
    finally:
        store.close()


@contextlib.contextmanager
def store_with_aligned_payload(
    path: Path, header_bytes: int, data: bytes
) -> Iterator[tuple[BlockStoreDevice, memoryview]]:
    """A store with a region per value of a cache header and ``data``, and ``data`` in
    block-aligned memory (as a payload lies in shared memory), for puts that split."""
    room = header_bytes + len(data) + BLOCK_BYTES  # A split takes a block more.
    region_bytes = REGION_HEADER_BYTES + object_span(room)
    payload = AlignedBuffer(round_up(len(data)))
    payload.view[: len(data)] = data
    aligned = payload.view[: len(data)]
    store = BlockStoreDevice("card", str(path), room, region_bytes=region_bytes, create_bytes=4096 + 4 * region_bytes)
    try:
        yield store, aligned
    finally:
        store.close()
        aligned.release()
        payload.close()


def test_a_writers_checksum_of_an_in_place_payload_is_taken_and_a_wrong_one_is_a_miss(tmp_path: Path) -> None:
    """`put_checksummed`: a payload written from the caller's memory is not hashed again, so
    the checksum given is the one verified on every read (a wrong one: a counted miss); a value
    the store copies (contiguous) is hashed by the store whatever it is told."""
    header, data = os.urandom(100), os.urandom(IN_PLACE_MIN_BYTES + CHUNK_BYTES + 777)
    total = len(header) + len(data)
    with store_with_aligned_payload(tmp_path / "told.blocks", len(header), data) as (store, aligned):
        store.put_checksummed(key(1), [header, aligned], body_checksum(data))
        store.put_checksummed(key(2), [header, aligned], body_checksum(data) ^ 1)
        store.put_checksummed(key(3), [header, data], body_checksum(data) ^ 1)  # Contiguous: hashed here.
        into = memoryview(bytearray(total))
        assert store.get(key(1), into) == total and bytes(into) == header + data
        assert store.get(key(2), into) is None
        assert store.status_counts()["checksum_mismatch"] == 1
        assert store.get(key(3), into) == total and bytes(into) == header + data


def test_a_cache_part_hands_its_payload_checksum_to_a_device_that_takes_it(store_path: Path) -> None:
    """`EncodedPart.put_on`: the block store stores the checksum the part carries (the writer's,
    taken in its cache) rather than hashing the payload; the RAM device stores the bytes."""
    data = os.urandom(IN_PLACE_MIN_BYTES + BLOCK_BYTES)
    payload = AlignedBuffer(len(data))
    payload.view[:] = data
    fingerprint = LayoutFingerprint(model_id="block-test", chunk_size=16).digest()
    right, wrong = (
        encode(ChunkKey(key(n)), fingerprint, payload.view, value_checksum=body_checksum(data) ^ flip)[0]
        for n, flip in ((1, 0), (2, 1))
    )
    room = right.nbytes + BLOCK_BYTES
    region_bytes = REGION_HEADER_BYTES + object_span(room)
    store = BlockStoreDevice(
        "card", str(store_path), room, region_bytes=region_bytes, create_bytes=4096 + 3 * region_bytes
    )
    ram = RamDevice("ram", 4 * room)
    try:
        into = memoryview(bytearray(room))
        for part in (right, wrong):
            part.put_on(store)
            part.put_on(ram)
        assert store.get(right.device_key, into) == right.nbytes
        assert store.get(wrong.device_key, into) is None, "the part's own checksum was verified, and failed"
        assert ram.get(wrong.device_key, into) == wrong.nbytes
    finally:
        store.close()  # ``payload`` is unmapped when collected: the parts still view it.


@pytest.mark.parametrize("seed", range(5))
def test_segments_landed_in_any_order_give_the_bodys_checksum(seed: int) -> None:
    rng = random.Random(seed)
    body = memoryview(os.urandom(3 * SEGMENT_BYTES + rng.randrange(SEGMENT_BYTES)))
    cuts = sorted({0, body.nbytes, *(rng.randrange(body.nbytes) for _ in range(12))})
    pieces = list(itertools.pairwise(cuts))
    rng.shuffle(pieces)
    segments = _Segments(body)
    for lo, hi in pieces:
        with pytest.raises(AssertionError, match="never landed"):
            segments.digests()
        segments.landed(lo, hi)
    assert combine(segments.digests()) == body_checksum(body)
    with pytest.raises(AssertionError, match="landed twice"):
        segments.landed(*pieces[0])


class Recorded:
    """A `PieceConsumer` of a cache object's pieces that records how each came."""

    piece_base = HEADER_BYTES
    piece_bytes = SEGMENT_BYTES

    def __init__(self) -> None:
        self.pieces: dict[int, bytes] = {}
        self.digests: dict[int, tuple[int, int]] = {}
        self.slices: list[bytes] = []

    def __call__(self, data: memoryview) -> None:
        self.slices.append(bytes(data))

    def take(self, offset: int, data: memoryview) -> None:
        self.pieces[offset] = bytes(data)

    def take_digest(self, offset: int, nbytes: int, digest: int) -> None:
        self.digests[offset] = (nbytes, digest)


def test_a_streamed_get_hands_a_cache_payloads_segment_digests_and_never_a_damaged_value(tmp_path: Path) -> None:
    """The tier's read of a card object: the store verified the payload's segments as it read
    them, so it hands their digests (the cache's payload checksum comes out right without a
    second hash); a contiguous object, whose segments are not the cache's, is handed in order;
    a damaged one is handed nothing."""
    header, data = os.urandom(HEADER_BYTES), os.urandom(IN_PLACE_MIN_BYTES + 2 * SEGMENT_BYTES + 777)
    total = len(header) + len(data)
    path = tmp_path / "streamed.blocks"
    with store_with_aligned_payload(path, len(header), data) as (store, aligned):
        store.put(key(1), [header, aligned])  # Split: the payload is the body.
        store.put(key(2), [header, data])  # Contiguous.
        into = memoryview(bytearray(total))
        split = Recorded()
        assert store.get_streamed(key(1), into, split) == total and bytes(into) == header + data
        assert split.pieces == {0: header} and not split.slices
        segments = range(0, len(data), SEGMENT_BYTES)
        assert split.digests == {
            HEADER_BYTES + at: (len(data[at : at + SEGMENT_BYTES]), segment_digest(data[at : at + SEGMENT_BYTES]))
            for at in segments
        }
        payload_checksum = PayloadChecksum()
        assert store.get_streamed(key(1), into, payload_checksum) == total
        assert payload_checksum.intdigest() == body_checksum(data)
        contiguous = Recorded()
        assert store.get_streamed(key(2), into, contiguous) == total
        assert b"".join(contiguous.slices) == header + data and not contiguous.pieces and not contiguous.digests
        with open(path, "r+b") as f:  # One byte of key 1's payload, on the device.
            f.seek(SUPERBLOCK_BYTES + REGION_HEADER_BYTES + BLOCK_BYTES + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        damaged = Recorded()
        assert store.get_streamed(key(1), into, damaged) is None
        assert not (damaged.pieces or damaged.digests or damaged.slices)
