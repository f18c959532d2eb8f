"""Bad input on the wire, sent as raw frames to a real gateway: each message is refused
with its `ErrorCode`, counted in status, and the gateway keeps serving everyone."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_harness import (
    FINGERPRINT,
    GatewayProcess,
    closing_client,
    get_values,
    put_values,
    value_for,
    write_config,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvharbor import __version__
from kvharbor.config import GatewaySection, load_config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.client import GatewayClient, GatewayRefused
from kvharbor.gateway.protocol import FRAME, ErrorCode, MessageType
from kvharbor.gateway.server import Gateway
from kvharbor.gateway.wire import FrameReader, PeerClosed

pytestmark = pytest.mark.timeout(120)

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
TWO_SELECTIONS = b'{"namespace": "a", "layout": "abcdef"}'


class RawPeer:
    """A hand-driven connection: frames exactly as given, replies as decoded."""

    def __init__(self, section: GatewaySection) -> None:
        self.digest = section.config_digest
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(section.socket)
        self.reader = FrameReader(self.sock, 1 << 20)

    def send(self, kind: int, body: bytes, request_id: int = 7, length: int | None = None) -> None:
        self.sock.sendall(FRAME.pack(len(body) if length is None else length, kind, 0, request_id) + body)

    def reply(self) -> tuple[int, p.Message]:
        header, message = self.reader.message()
        return header.request_id, message

    def hello(self) -> None:
        self.send(MessageType.HELLO, p.Hello(p.PROTOCOL_VERSION, __version__, os.getpid(), "raw", self.digest).body())
        assert isinstance(self.reply()[1], p.HelloOk)

    def refused(self, kind: int, body: bytes, length: int | None = None) -> ErrorCode:
        self.send(kind, body, length=length)
        _, message = self.reply()
        assert isinstance(message, p.Error), message
        return message.code

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def gateway(started: Callable[..., GatewayProcess]) -> GatewayProcess:
    return started(ring_mb=8)


@pytest.fixture
def raw(gateway: GatewayProcess) -> Iterator[RawPeer]:
    peer = RawPeer(gateway.config.gateway)
    yield peer
    peer.close()


KEY = b"k" * 16


def lookup_body(count: int, key_bytes: int) -> bytes:
    return U32.pack(256) + struct.pack("<Q", 0) + U32.pack(count) + b"x" * key_bytes


def test_each_bad_message_gets_its_code_and_the_gateway_serves_on(gateway: GatewayProcess, raw: RawPeer) -> None:
    with closing_client(gateway.client("bystander")) as bystander:
        put_values(bystander, [(KEY, 5000)])
        assert raw.refused(MessageType.LOOKUP, lookup_body(1, 16)) is ErrorCode.NOT_READY
        raw.hello()
        cases = {
            "truncated body": (MessageType.LOOKUP, b"\x01\x00", ErrorCode.MALFORMED),
            "unknown type": (999, b"", ErrorCode.MALFORMED),
            "a reply as request": (MessageType.LOOKUP_OK, U32.pack(3), ErrorCode.MALFORMED),
            "key of 15 bytes": (MessageType.LOOKUP, lookup_body(2, 30), ErrorCode.BAD_KEY),
            "key of 17 bytes": (MessageType.GET, FINGERPRINT + U32.pack(1) + b"x" * 17, ErrorCode.BAD_KEY),
            "put item short": (
                MessageType.PUT_PREPARE,
                FINGERPRINT + U64.pack(0) + U32.pack(1) + b"x" * 20,  # Fingerprint, namespace tag, one item.
                ErrorCode.BAD_KEY,
            ),
            "purge of two selections": (
                MessageType.PURGE,
                U32.pack(1) + U32.pack(len(TWO_SELECTIONS)) + TWO_SELECTIONS,
                ErrorCode.MALFORMED,
            ),
            "too many keys": (MessageType.LOOKUP, lookup_body(p.KEYS_PER_MESSAGE_MAX + 1, 0), ErrorCode.TOO_LARGE),
            "value too large": (
                MessageType.PUT_PREPARE,
                p.PutPrepare(FINGERPRINT, [(KEY, 1 << 40)]).body(),
                ErrorCode.TOO_LARGE,
            ),
            "empty value": (MessageType.PUT_PREPARE, p.PutPrepare(FINGERPRINT, [(KEY, 0)]).body(), ErrorCode.TOO_LARGE),
            "commit unknown batch": (MessageType.PUT_COMMIT, p.PutCommit(12345).body(), ErrorCode.UNKNOWN_BATCH),
            "release unknown batch": (MessageType.RELEASE, p.Release(12345).body(), ErrorCode.UNKNOWN_BATCH),
            "bad UTF-8 text": (
                MessageType.HELLO,
                U32.pack(1) + U32.pack(2) + b"\xff\xfe" + b"\0" * 8,
                ErrorCode.MALFORMED,
            ),
            "trailing bytes": (MessageType.STATUS, b"\0", ErrorCode.MALFORMED),
            "a second HELLO": (
                MessageType.HELLO,
                p.Hello(p.PROTOCOL_VERSION, __version__, os.getpid(), "raw", raw.digest).body(),
                ErrorCode.MALFORMED,
            ),
        }
        for name, (kind, body, code) in cases.items():
            assert raw.refused(kind, body) is code, name
            # The same connection still works after every refusal.
            raw.send(MessageType.LOOKUP, p.Lookup(0, [KEY]).body())
            answer = raw.reply()[1]
            assert isinstance(answer, p.LookupOk) and answer.hits == 1, name
        # A put batch committed as a get batch is unknown as a get batch.
        raw.send(MessageType.PUT_PREPARE, p.PutPrepare(FINGERPRINT, [(b"n" * 16, 10)]).body())
        _, ready = raw.reply()
        assert isinstance(ready, p.PutReady)
        assert raw.refused(MessageType.RELEASE, p.Release(ready.batch).body()) is ErrorCode.UNKNOWN_BATCH
        # Two checksums for one value: refused, and the batch is given back, not stored.
        commit = p.PutCommit(ready.batch, [1, 2]).body()
        assert raw.refused(MessageType.PUT_COMMIT, commit) is ErrorCode.MALFORMED
        assert bystander.lookup([b"n" * 16]) == 0
        assert bystander.status().shm.in_place_bytes == 0
        # Oversized: answered, then the connection is closed (it cannot be resynchronised).
        assert raw.refused(MessageType.LOOKUP, b"", length=(1 << 20) + 1) is ErrorCode.TOO_LARGE
        with pytest.raises(PeerClosed):
            raw.reply()
        rejected = bystander.status().rejected
        assert rejected == {
            "NOT_READY": 1,
            "MALFORMED": 8,
            "BAD_KEY": 3,
            "TOO_LARGE": 4,
            "UNKNOWN_BATCH": 3,
        }
        assert get_values(bystander, [KEY]) == [value_for(KEY, 5000)]
        # The bad peer's open put batches were freed when it was hung up on.
        shm = bystander.status().shm
        assert shm.free_bytes == shm.ring_bytes and shm.in_place_bytes == 0


def test_read_only_queries_need_no_hello_and_a_layout_not_canonical_refuses_the_hello(
    gateway: GatewayProcess, raw: RawPeer
) -> None:
    raw.send(MessageType.STATUS, b"")
    status = raw.reply()[1]
    assert isinstance(status, p.StatusOk) and status.status.pid == gateway.pid
    raw.send(MessageType.LOCATE, p.Locate([KEY]).body())
    located = raw.reply()[1]
    assert isinstance(located, p.LocateOk) and located.holders == [0]
    assert raw.refused(MessageType.LOOKUP, lookup_body(1, 16)) is ErrorCode.NOT_READY, "the rest still needs HELLO"
    bad = p.Hello(p.PROTOCOL_VERSION, __version__, os.getpid(), "raw", raw.digest, (b'{"encoding":1}',))
    raw.send(MessageType.HELLO, bad.body())
    _, reply = raw.reply()
    assert isinstance(reply, p.Error) and reply.code is ErrorCode.MALFORMED
    assert "HELLO layout 0: not a canonical layout fingerprint" in reply.text
    with closing_client(gateway.client("bystander")) as bystander:
        seen = bystander.status()
    assert seen.layouts == [], "nothing registered from a refused HELLO"
    assert [c.name for c in seen.clients] == ["bystander"], "the raw peer never attached"


def test_truncated_frame_then_hang_up(gateway: GatewayProcess) -> None:
    for cut in (3, p.FRAME_BYTES, p.FRAME_BYTES + 5):
        peer = RawPeer(gateway.config.gateway)
        frame = p.encode(p.Lookup(0, [KEY, KEY]), 1)
        peer.sock.sendall(frame[:cut])
        peer.close()
    with closing_client(gateway.client()) as client:
        assert client.lookup([KEY]) == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from([*MessageType, 0, 77, 65535]), body=st.binary(max_size=200))
def test_random_frames_never_break_the_gateway(gateway: GatewayProcess, kind: int, body: bytes) -> None:
    """Arbitrary frames after the handshake: a reply for each (an answer or an ERROR),
    the connection still usable, and never a crash."""
    peer = RawPeer(gateway.config.gateway)
    try:
        peer.hello()
        peer.send(kind, body)
        _, message = peer.reply()
        peer.send(MessageType.LOOKUP, p.Lookup(0, [KEY]).body())
        _, answer = peer.reply()
        if isinstance(message, p.PutReady | p.GetReady) or isinstance(answer, p.LookupOk):
            assert isinstance(answer, p.LookupOk)
    finally:
        peer.close()
    assert gateway.process is not None and gateway.process.poll() is None


def test_a_bug_below_fails_one_request_not_the_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that raises (a bug, not a storage fault: those are misses) answers that one
    request with INTERNAL; the connection and the gateway serve on. In this process, so
    the store can be made to raise."""
    config_path = write_config(tmp_path)
    gateway = Gateway(load_config(config_path, environ={}))
    gateway.start()
    server = threading.Thread(target=gateway.serve_forever)
    server.start()
    try:
        client = GatewayClient.connect(gateway.config.gateway, "engine")
        assert gateway.store is not None
        monkeypatch.setattr(gateway.store, "probe", _raise_bug)
        with pytest.raises(GatewayRefused, match="INTERNAL: RuntimeError: a bug"):
            client.lookup([KEY])
        monkeypatch.undo()
        assert client.lookup([KEY]) == 0
        assert client.status().rejected == {"INTERNAL": 1}
        client.close()
    finally:
        gateway.stop()
        server.join(30)
    assert not server.is_alive()
    assert not list(Path(gateway.config.gateway.shm_dir).glob(f"{gateway.config.gateway.shm_name}.*"))


def _raise_bug(*_args: object) -> int:
    raise RuntimeError("a bug")
