"""The payload checksum of 1 MiB segments (`kvharbor.hal.checksum`), and `PayloadChecksum`
fed in order or in pieces: every way of taking it gives the one value its definition says."""

from __future__ import annotations

import itertools
import os
import random
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.cache.format import HEADER_BYTES, PayloadChecksum, encode, parse_header
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.hal.checksum import SEGMENT_BYTES, ChecksumStream, checksum, combine, copy_with_checksum

KEY = ChunkKey(bytes(range(16)))
FINGERPRINT = LayoutFingerprint(model_id="test/checksum", chunk_size=16).digest()
SIZES = [0, 1, SEGMENT_BYTES - 1, SEGMENT_BYTES, SEGMENT_BYTES + 1, 3 * SEGMENT_BYTES - 7]

untimed = settings(deadline=None)

# One random buffer, sliced by every test: random bytes of MiBs cost a test its speed.
DATA = os.urandom(3 * SEGMENT_BYTES + 4096)


def by_definition(data: bytes) -> int:
    """The module docstring's formula, written out with one-shot xxh3."""
    digests = [xxhash.xxh3_64_intdigest(data[i : i + SEGMENT_BYTES]) for i in range(0, len(data), SEGMENT_BYTES)]
    return xxhash.xxh3_64_intdigest(b"".join(struct.pack("<Q", d) for d in digests))


@pytest.mark.parametrize("nbytes", SIZES)
def test_the_checksum_is_its_definition(nbytes: int) -> None:
    data = DATA[:nbytes]
    assert checksum(data) == by_definition(data)
    assert checksum(memoryview(bytearray(data))) == checksum(data)


def test_the_checksum_of_nothing_is_the_hash_of_no_digests() -> None:
    assert checksum(b"") == combine([]) == xxhash.xxh3_64_intdigest(b"")


def test_a_changed_byte_or_two_segments_swapped_change_the_checksum() -> None:
    data = bytearray(DATA[: 2 * SEGMENT_BYTES])
    whole = checksum(data)
    swapped = data[SEGMENT_BYTES:] + data[:SEGMENT_BYTES]
    assert checksum(swapped) != whole
    data[SEGMENT_BYTES + 12345] ^= 1
    assert checksum(data) != whole


@untimed
@given(nbytes=st.sampled_from(SIZES), cuts=st.lists(st.integers(0, 3 * SEGMENT_BYTES), max_size=8))
def test_a_stream_fed_in_any_slices_gives_the_checksum(nbytes: int, cuts: list[int]) -> None:
    data = memoryview(DATA)[:nbytes]
    stream = ChecksumStream()
    for start, end in itertools.pairwise(sorted({0, nbytes, *(c for c in cuts if c <= nbytes)})):
        stream.update(data[start:end])
    assert stream.intdigest() == checksum(data)


@pytest.mark.parametrize("nbytes", SIZES)
def test_a_copy_with_its_checksum_copies_every_byte(nbytes: int) -> None:
    into = memoryview(bytearray(nbytes))
    assert copy_with_checksum(DATA[:nbytes], into) == checksum(DATA[:nbytes])
    assert into == DATA[:nbytes]
    with pytest.raises(ValueError, match=f"{nbytes} bytes into {nbytes + 1}"):
        copy_with_checksum(DATA[:nbytes], memoryview(bytearray(nbytes + 1)))


def object_of(nbytes: int) -> tuple[memoryview, int]:
    """An encoded object of an ``nbytes`` payload, and the checksum its header holds."""
    (part,) = encode(KEY, FINGERPRINT, DATA[:nbytes])
    whole = memoryview(bytearray(part.header) + part.payload)
    return whole, parse_header(whole).payload_checksum


def pieces_of(whole: memoryview) -> list[tuple[int, memoryview]]:
    bounds = [0, *range(PayloadChecksum.piece_base, whole.nbytes, PayloadChecksum.piece_bytes), whole.nbytes]
    return [(lo, whole[lo:hi]) for lo, hi in itertools.pairwise(bounds) if hi > lo]


@pytest.mark.parametrize("nbytes", SIZES)
def test_pieces_taken_in_any_order_on_several_threads_give_the_stored_checksum(nbytes: int) -> None:
    whole, stored = object_of(nbytes)
    assert stored == checksum(DATA[:nbytes])
    pieces = pieces_of(whole)
    random.Random(nbytes).shuffle(pieces)
    taken = PayloadChecksum()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda piece: taken.take(*piece), pieces))
    assert taken.intdigest() == stored
    in_order = PayloadChecksum()
    for start in range(0, whole.nbytes, 100_000):
        in_order(whole[start : start + 100_000])
    assert in_order.intdigest() == stored


def test_a_missing_piece_matches_no_checksum() -> None:
    whole, stored = object_of(3 * SEGMENT_BYTES - 7)
    taken = PayloadChecksum()
    for offset, piece in pieces_of(whole)[:-2] + pieces_of(whole)[-1:]:  # The middle segment's piece left out.
        taken.take(offset, piece)
    assert taken.intdigest() == -1 != stored


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(HEADER_BYTES + 1, 100), (HEADER_BYTES, SEGMENT_BYTES + 1), (100, 100), (HEADER_BYTES, 0)],
    ids=["off-the-edge", "longer-than-a-segment", "inside-the-header", "empty"],
)
def test_a_piece_that_is_not_one_is_refused(offset: int, nbytes: int) -> None:
    with pytest.raises(ValueError, match=f"a piece of {nbytes} bytes at {offset} is not one of the object's pieces"):
        PayloadChecksum().take(offset, memoryview(DATA)[offset : offset + nbytes])


def test_one_object_is_fed_one_way() -> None:
    whole, _ = object_of(SEGMENT_BYTES)
    taken = PayloadChecksum()
    taken.take(HEADER_BYTES, whole[HEADER_BYTES:])
    with pytest.raises(RuntimeError, match="fed in order after being given pieces"):
        taken(whole)
    fed = PayloadChecksum()
    fed(whole[: HEADER_BYTES + 10])
    with pytest.raises(ValueError, match="not one of the object's pieces"):
        fed.take(HEADER_BYTES, whole[HEADER_BYTES:])
