"""The stored object format: roundtrips, fragments, and that damage is never a wrong value."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.cache.format import (
    FRAGMENTS_MAX,
    HEADER_BYTES,
    Codec,
    CorruptObject,
    EncodedPart,
    ForeignFormat,
    Header,
    PayloadChecksum,
    ReadBack,
    ReadPart,
    decode,
    encode,
    parse_header,
)
from kvharbor.cache.keys import FORMAT_VERSION, LayoutFingerprint, fragment_key
from kvharbor.hal.checksum import checksum

# Hypothesis' per-example deadline is a timing assert; a loaded CI machine must
# not fail a property that holds.
untimed = settings(deadline=None)

KEY = bytes(range(16))
OTHER_KEY = bytes(range(16, 32))
FINGERPRINT = LayoutFingerprint(model_id="test/model", chunk_size=16).digest()
OTHER_FINGERPRINT = LayoutFingerprint(model_id="test/other", chunk_size=16).digest()


def kv_like(nbytes: int) -> bytes:
    """Half repetitive, half random: compressible, but not trivially."""
    half = nbytes // 2
    return (b"\x00\x3c\x12\xbf" * (half // 4 + 1))[:half] + os.urandom(nbytes - half)


def stored(parts: list[EncodedPart]) -> dict[bytes, bytearray]:
    """What a device holds after the writes: device key -> header + payload."""
    return {part.device_key: bytearray(part.header) + part.payload for part in parts}


def reader(objects: Mapping[bytes, bytearray]) -> ReadPart:
    return lambda device_key: memoryview(objects[device_key]) if device_key in objects else None


def read_back(parts: list[EncodedPart]) -> bytes:
    value = decode(KEY, FINGERPRINT, reader(stored(parts)))
    assert value is not None
    return bytes(value)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("nbytes", [0, 1, 4096, 1 << 20])
def test_roundtrip_each_codec(codec: Codec, nbytes: int) -> None:
    value = kv_like(nbytes)
    parts = encode(KEY, FINGERPRINT, value, codec)
    assert len(parts) == 1
    header = parse_header(parts[0].header)
    assert (header.key, header.fingerprint, header.codec, header.raw_length) == (
        KEY,
        FINGERPRINT,
        codec,
        nbytes,
    )
    assert read_back(parts) == value


def test_compression_stores_fewer_bytes() -> None:
    value = bytes(64 * 1024)
    sizes = {codec: encode(KEY, FINGERPRINT, value, codec)[0].nbytes for codec in Codec}
    assert sizes[Codec.LZ4] < sizes[Codec.NONE] and sizes[Codec.ZSTD] < sizes[Codec.NONE]


@st.composite
def sizes(draw: st.DrawFn) -> tuple[int, int]:
    """(value bytes, max object bytes): from 1-byte fragments up, at most ~256 of them."""
    payload = draw(st.integers(1, 9_000), label="fragment payload bytes")
    return draw(st.integers(0, min(20_000, 256 * payload)), label="value bytes"), HEADER_BYTES + payload


@untimed
@given(sizes(), st.sampled_from(list(Codec)))
def test_fragmented_roundtrip(size: tuple[int, int], codec: Codec) -> None:
    nbytes, max_object_bytes = size
    value = kv_like(nbytes)
    parts = encode(KEY, FINGERPRINT, value, codec, max_object_bytes)
    assert all(part.nbytes <= max_object_bytes for part in parts)
    assert [p.device_key for p in parts] == [KEY, *(fragment_key(KEY, i) for i in range(1, len(parts)))]
    assert all(len(p.device_key) == 16 for p in parts)
    stored_length = parse_header(parts[0].header).stored_length
    assert len(parts) == max(1, -(-stored_length // (max_object_bytes - HEADER_BYTES)))
    assert read_back(parts) == value


def test_fragmented_value_is_assembled_into_the_callers_buffer() -> None:
    value = kv_like(10_000)
    objects = stored(encode(KEY, FINGERPRINT, value, Codec.NONE, HEADER_BYTES + 3000))
    out = bytearray(12_000)
    got = decode(KEY, FINGERPRINT, reader(objects), memoryview(out))
    assert got is not None and got.obj is out and bytes(got) == value


def test_a_value_needing_too_many_fragments_is_refused() -> None:
    with pytest.raises(ValueError, match="fragments"):
        encode(KEY, FINGERPRINT, bytes(FRAGMENTS_MAX + 1), Codec.NONE, HEADER_BYTES + 1)


def test_a_missing_object_is_a_plain_miss() -> None:
    assert decode(KEY, FINGERPRINT, reader({})) is None


# ---- damage ---------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_every_single_byte_corruption_is_detected(codec: Codec) -> None:
    # Small enough to try every position of header and payload exhaustively.
    value = kv_like(200)
    (part,) = encode(KEY, FINGERPRINT, value, codec)
    good = bytearray(part.header) + part.payload
    for position in range(len(good)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(good)
            damaged[position] ^= flip
            with pytest.raises(CorruptObject):
                decode(KEY, FINGERPRINT, reader({KEY: damaged}))


@untimed
@given(
    position=st.integers(0, HEADER_BYTES + 64 * 1024 - 1),
    flip=st.integers(1, 255),
    codec=st.sampled_from(list(Codec)),
)
def test_sampled_corruption_of_a_large_object_is_detected(position: int, flip: int, codec: Codec) -> None:
    (part,) = encode(KEY, FINGERPRINT, _LARGE, codec)
    damaged = bytearray(part.header) + part.payload
    position %= len(damaged)
    damaged[position] ^= flip
    with pytest.raises(CorruptObject):
        decode(KEY, FINGERPRINT, reader({KEY: damaged}))


_LARGE = kv_like(64 * 1024)


def test_corruption_in_a_later_fragment_is_detected() -> None:
    objects = stored(encode(KEY, FINGERPRINT, kv_like(5000), Codec.NONE, HEADER_BYTES + 1000))
    objects[fragment_key(KEY, 3)][HEADER_BYTES + 10] ^= 0x40
    with pytest.raises(CorruptObject, match="checksum"):
        decode(KEY, FINGERPRINT, reader(objects))


@pytest.mark.parametrize("keep", [0, 1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 99])
def test_a_truncated_object_is_corrupt(keep: int) -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(100), Codec.NONE)
    whole = bytearray(part.header) + part.payload
    with pytest.raises(CorruptObject):
        decode(KEY, FINGERPRINT, reader({KEY: whole[:keep]}))


def test_trailing_bytes_make_an_object_corrupt() -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(100), Codec.NONE)
    with pytest.raises(CorruptObject, match="header says"):
        decode(KEY, FINGERPRINT, reader({KEY: bytearray(part.header) + part.payload + b"\0"}))


def test_an_object_under_the_wrong_key_is_corrupt() -> None:
    # Another key's bytes where this key's belong (a renamed file, a hash slip).
    objects = stored(encode(OTHER_KEY, FINGERPRINT, kv_like(100)))
    with pytest.raises(CorruptObject, match="expected"):
        decode(KEY, FINGERPRINT, reader({KEY: objects[OTHER_KEY]}))


def test_an_object_of_another_layout_is_corrupt() -> None:
    objects = stored(encode(KEY, OTHER_FINGERPRINT, kv_like(100)))
    with pytest.raises(CorruptObject, match="fingerprint"):
        decode(KEY, FINGERPRINT, reader(objects))


def test_a_missing_later_fragment_is_corrupt_not_a_short_value() -> None:
    objects = stored(encode(KEY, FINGERPRINT, kv_like(5000), Codec.NONE, HEADER_BYTES + 1000))
    del objects[fragment_key(KEY, 2)]
    with pytest.raises(CorruptObject, match="fragment 2 of 5 is missing"):
        decode(KEY, FINGERPRINT, reader(objects))


def test_a_fragment_of_another_key_swapped_in_is_corrupt() -> None:
    limit = HEADER_BYTES + 1000
    objects = stored(encode(KEY, FINGERPRINT, kv_like(5000), Codec.NONE, limit))
    other = stored(encode(OTHER_KEY, FINGERPRINT, kv_like(5000), Codec.NONE, limit))
    objects[fragment_key(KEY, 1)] = other[fragment_key(OTHER_KEY, 1)]
    with pytest.raises(CorruptObject, match="expected"):
        decode(KEY, FINGERPRINT, reader(objects))


def test_fragments_out_of_order_are_corrupt() -> None:
    objects = stored(encode(KEY, FINGERPRINT, kv_like(5000), Codec.NONE, HEADER_BYTES + 1000))
    one, two = fragment_key(KEY, 1), fragment_key(KEY, 2)
    objects[one], objects[two] = objects[two], objects[one]
    with pytest.raises(CorruptObject, match="found where"):
        decode(KEY, FINGERPRINT, reader(objects))


def _reheadered(part: EncodedPart, header: Header) -> bytearray:
    """The part with another, *consistent* header (valid checksum): it lies, but well."""
    return bytearray(header.pack()) + part.payload


def test_an_object_of_another_format_version_is_foreign_not_read() -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(100))
    newer = dataclasses.replace(parse_header(part.header), version=FORMAT_VERSION + 1)
    objects = {KEY: _reheadered(part, newer)}
    with pytest.raises(ForeignFormat, match=f"format version {FORMAT_VERSION + 1}"):
        decode(KEY, FINGERPRINT, reader(objects))


def test_the_payload_starts_on_a_page_edge() -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(100))
    assert len(part.header) == HEADER_BYTES and HEADER_BYTES % 4096 == 0


def test_a_header_that_lies_about_the_raw_length_is_corrupt() -> None:
    # Checksums intact, but an uncompressed value's raw and stored lengths disagree.
    (part,) = encode(KEY, FINGERPRINT, kv_like(100), Codec.NONE)
    with pytest.raises(CorruptObject):
        lying = dataclasses.replace(parse_header(part.header), raw_length=99)
        decode(KEY, FINGERPRINT, reader({KEY: _reheadered(part, lying)}))


def test_an_unknown_codec_is_corrupt() -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(100))
    damaged = bytearray(part.header) + part.payload
    damaged[6] = 9  # The codec byte; the header checksum then fails first.
    with pytest.raises(CorruptObject):
        decode(KEY, FINGERPRINT, reader({KEY: damaged}))


# ---- a checksum computed while reading -------------------------------------


@untimed
@given(nbytes=st.integers(0, 5000), cuts=st.lists(st.integers(0, HEADER_BYTES + 5000), max_size=8))
def test_the_payload_checksum_of_an_object_fed_in_any_slices_is_its_payloads(nbytes: int, cuts: list[int]) -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(nbytes))
    whole = memoryview(bytearray(part.header) + part.payload)
    streamed = PayloadChecksum()
    bounds = sorted({0, whole.nbytes, *(c for c in cuts if c <= whole.nbytes)})
    for start, end in itertools.pairwise(bounds):
        streamed(whole[start:end])  # Cuts fall inside the header too.
    assert streamed.intdigest() == checksum(part.payload) == parse_header(whole).payload_checksum


def test_a_checksum_brought_by_the_reader_is_the_one_verified() -> None:
    (part,) = encode(KEY, FINGERPRINT, kv_like(4096))
    data = memoryview(bytearray(part.header) + part.payload)
    right = checksum(part.payload)
    assert decode(KEY, FINGERPRINT, lambda _key: ReadBack(data, right)) is not None
    with pytest.raises(CorruptObject, match="payload checksum mismatch"):
        decode(KEY, FINGERPRINT, lambda _key: ReadBack(data, right ^ 1))


# ---- no copies --------------------------------------------------------------


def test_an_uncompressed_value_is_a_view_of_the_read_buffer() -> None:
    value = kv_like(4096)
    (part,) = encode(KEY, FINGERPRINT, value, Codec.NONE)
    assert part.payload.obj is memoryview(value).obj  # Encoding did not copy either.
    buffer = bytearray(part.header) + part.payload
    got = decode(KEY, FINGERPRINT, lambda _key: memoryview(buffer))
    assert got is not None and got.obj is buffer and bytes(got) == value
    buffer[HEADER_BYTES] ^= 0xFF  # Same memory: a change to the buffer shows through.
    assert got[0] == value[0] ^ 0xFF
