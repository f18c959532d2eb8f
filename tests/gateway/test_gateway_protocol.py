"""The wire protocol on its own: every message round-trips, and the decoder, fed
anything at all, only ever answers with a message or a `ProtocolError`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.config import ConfigDigest, GatewaySection
from kvharbor.gateway import protocol as p
from kvharbor.gateway.protocol import FRAME_BYTES, KEYS_PER_MESSAGE_MAX, ErrorCode, ProtocolError
from tests.support.status_sample import sample_status

keys = st.binary(min_size=16, max_size=16)
key_lists = st.lists(keys, max_size=40)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=60)
digests = st.builds(ConfigDigest, st.lists(st.tuples(text, text), max_size=p.DIGEST_SECTIONS_MAX).map(tuple))

messages = st.one_of(
    st.builds(
        p.Hello, st.just(p.PROTOCOL_VERSION), text, u32, text, digests, st.lists(st.binary(), max_size=4).map(tuple)
    ),
    # Another protocol's HELLO keeps only what its refusal names (the digest may have another form).
    st.builds(p.Hello, u32.filter(lambda v: v != p.PROTOCOL_VERSION), text, u32, text, st.just(ConfigDigest(()))),
    st.builds(p.HelloOk, u32, text, text, u64, u64, u32),
    st.builds(p.Error, st.sampled_from(ErrorCode), text),
    st.builds(p.Lookup, u32, key_lists, u64),
    u32.flatmap(lambda hits: st.builds(p.LookupOk, st.just(hits), st.integers(0, hits))),
    st.builds(p.Locate, key_lists),
    st.builds(p.LocateOk, st.lists(u64, max_size=40)),
    st.builds(p.Verify, u64, st.lists(st.tuples(keys, keys), max_size=40)),
    st.builds(p.VerifyOk, u32),
    st.builds(p.Drop, key_lists),
    st.builds(p.Dropped, u32),
    st.builds(p.PutPrepare, keys, st.lists(st.tuples(keys, u64), max_size=40)),
    # Some values skipped (stored, or no room): at most those found no room.
    st.lists(st.one_of(u64, st.just(p.SKIP)), max_size=40).flatmap(
        lambda offsets: st.builds(p.PutReady, u64, st.just(offsets), u64, st.integers(0, offsets.count(p.SKIP)))
    ),
    st.builds(p.PutCommit, u64, st.lists(u64, max_size=40)),
    st.builds(p.PutDone, u32),
    st.builds(p.Get, keys, key_lists),
    st.builds(p.GetReady, u64, st.lists(st.tuples(u64, u64), max_size=40)),
    st.builds(p.Release, u64),
    st.builds(p.Released, u64),
    st.builds(p.Status),
    st.builds(p.StatusOk, st.just(sample_status())),
)


@given(messages, u64)
def test_every_message_round_trips(message: p.Message, request_id: int) -> None:
    header, decoded = p.decode(p.encode(message, request_id))
    assert decoded == message
    assert header.request_id == request_id and header.type == message.TYPE


def decodes_or_refuses(data: bytes) -> None:
    try:
        p.decode(data)
    except ProtocolError as err:
        assert isinstance(err.code, ErrorCode)


@settings(max_examples=1000)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    decodes_or_refuses(data)


@settings(max_examples=1000)
@given(st.sampled_from([*p.MessageType, 0, 5, 65535]), st.binary(max_size=600))
def test_arbitrary_bodies_only_raise_protocol_error(kind: int, body: bytes) -> None:
    decodes_or_refuses(p.FRAME.pack(len(body), kind, 0, 1) + body)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame, then damaged: bytes flipped, cut short, extended, or a length
    field (frame or count) rewritten — each kept consistent with the frame header
    about half the time, so the damage reaches the body decoders."""
    frame = bytearray(p.encode(draw(messages), draw(u64)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "cut", "extend", "u32", "u64"]))
        if action == "flip" and frame:
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del frame[draw(st.integers(0, len(frame))) :]
        elif action == "extend":
            frame += draw(st.binary(min_size=1, max_size=64))
        elif len(frame) >= FRAME_BYTES + 8:
            width = 4 if action == "u32" else 8
            at = draw(st.integers(FRAME_BYTES, len(frame) - width))
            value = draw(st.sampled_from([0, 1, 2**31, 2**width * 8 - 1, KEYS_PER_MESSAGE_MAX + 1]))
            frame[at : at + width] = (value % 2 ** (width * 8)).to_bytes(width, "little")
        if draw(st.booleans()) and len(frame) >= FRAME_BYTES:
            frame[0:4] = (len(frame) - FRAME_BYTES).to_bytes(4, "little")
    return bytes(frame)


@settings(max_examples=2000)
@given(mutated_frames())
def test_mutated_frames_only_raise_protocol_error(data: bytes) -> None:
    decodes_or_refuses(data)


def test_deeply_nested_status_is_malformed_not_a_crash() -> None:
    """Found by the fuzzer's reasoning: json raises RecursionError, not ValueError."""
    raw = b"[" * 100_000
    body = len(raw).to_bytes(4, "little") + raw
    with pytest.raises(ProtocolError) as caught:
        p.decode(p.FRAME.pack(len(body), p.MessageType.STATUS_OK, 0, 1) + body)
    assert caught.value.code is ErrorCode.MALFORMED


def test_status_must_be_an_object() -> None:
    body = (2).to_bytes(4, "little") + b"[]"
    with pytest.raises(ProtocolError, match="not a gateway status of this release"):
        p.decode(p.FRAME.pack(len(body), p.MessageType.STATUS_OK, 0, 1) + body)


def test_long_text_is_cut_on_a_character_boundary() -> None:
    message = p.Error(ErrorCode.INTERNAL, "é" * p.TEXT_BYTES_MAX)  # 2 bytes each: cut mid-way.
    _, decoded = p.decode(p.encode(message, 1))
    assert isinstance(decoded, p.Error)
    assert decoded.text == "é" * (p.TEXT_BYTES_MAX // 2)


def test_more_resident_than_hits_is_malformed() -> None:
    body = (2).to_bytes(4, "little") + (3).to_bytes(4, "little")
    with pytest.raises(ProtocolError, match="3 resident of 2 hits"):
        p.decode_body(p.MessageType.LOOKUP_OK, body)


def test_frame_larger_than_the_limit_is_too_large() -> None:
    with pytest.raises(ProtocolError) as caught:
        p.decode(p.FRAME.pack(2000, p.MessageType.STATUS, 0, 1), body_bytes_max=1000)
    assert caught.value.code is ErrorCode.TOO_LARGE


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ProtocolError) as caught:
        p.encode(p.Lookup(0, [b"short"]), 1)
    assert caught.value.code is ErrorCode.BAD_KEY
    with pytest.raises(ProtocolError) as caught:
        p.encode(p.Get(b"f" * 16, [b"k" * 16] * (KEYS_PER_MESSAGE_MAX + 1)), 1)
    assert caught.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError, match="out of range"):
        p.encode(p.PutPrepare(b"f" * 16, [(b"k" * 16, -1)]), 1)
    # A full batch besides its fingerprint is legal.
    p.encode(p.PutPrepare(b"f" * 16, [(b"k" * 16, 1)] * KEYS_PER_MESSAGE_MAX), 1)


def test_a_put_ready_with_more_values_without_room_than_it_skipped_is_malformed() -> None:
    ready = p.PutReady(1, [p.SKIP, 4096, p.SKIP], 0, no_room=2)
    assert p.decode_body(p.MessageType.PUT_READY, ready.body()) == ready
    with pytest.raises(ProtocolError, match="3 values without room, 2 skipped"):
        p.decode_body(p.MessageType.PUT_READY, p.PutReady(1, [p.SKIP, 4096, p.SKIP], 0, no_room=3).body())


def test_a_full_batch_fits_the_smallest_message_limit() -> None:
    """gateway.message_bytes_max may not go below what the largest legal batch needs."""
    smallest = GatewaySection.model_fields["message_bytes_max"].metadata[0].ge
    full = [b"k" * 16] * KEYS_PER_MESSAGE_MAX
    largest = max(
        len(p.PutPrepare(b"f" * 16, [(k, 2**63) for k in full]).body()),
        len(p.GetReady(1, [(2**63, 2**63)] * KEYS_PER_MESSAGE_MAX).body()),
        len(p.PutReady(1, [2**63] * KEYS_PER_MESSAGE_MAX).body()),
        len(p.Lookup(0, full).body()),
    )
    assert largest <= smallest


def test_a_hello_of_another_protocol_is_read_up_to_its_frozen_fields() -> None:
    """A gateway must read any release's HELLO (to refuse it by name, or step aside for it):
    after its first four fields, one of another protocol may hold anything. Other messages stay strict."""
    hello = p.Hello(p.PROTOCOL_VERSION + 1, "9.9.9", 42, "engine", p.ConfigDigest(()))
    assert p.decode_body(p.MessageType.HELLO, hello.body() + b"fields of another protocol") == hello
    with pytest.raises(ProtocolError, match="trailing bytes"):
        p.decode_body(p.MessageType.STATUS, p.Status().body() + b"x")
