"""Client rules against scripted gateways (a socket thread in this process): what the
client accepts, how long it waits, and that it stays down once the gateway failed."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_harness import FINGERPRINT, GatewayProcess, closing_client, put_values

from kvharbor import __version__
from kvharbor.config import GatewaySection, load_config
from kvharbor.gateway import protocol as p
from kvharbor.gateway.client import (
    GatewayClient,
    GatewayRefused,
    GatewayUnavailable,
    PutBatch,
    VersionMismatch,
)
from kvharbor.gateway.wire import FrameReader, send_message

pytestmark = pytest.mark.timeout(60)

Script = Callable[[socket.socket, FrameReader, threading.Event], None]


class ScriptedGateway:
    """Answers HELLO like a gateway (with a real segment file), then runs ``script``."""

    def __init__(self, tmp_path: Path, script: Script, release: str = __version__) -> None:
        self.section = load_config(
            environ={},
            overrides={
                "gateway": {
                    "socket": str(tmp_path / "gw.sock"),
                    "request_timeout_ms": 1000,
                    "progress_interval_ms": 50,
                    "ring_wait_ms": 50,
                }
            },
        ).gateway
        self.segment = tmp_path / "segment"
        self.segment.write_bytes(b"\0" * 4096)
        self.release = release
        self.script = script
        self.done = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.section.socket)
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            reader = FrameReader(conn, 1 << 20)
            header, _ = reader.message()
            hello = p.HelloOk(p.PROTOCOL_VERSION, self.release, str(self.segment), 4096, 4096, os.getpid())
            send_message(conn, hello, header.request_id)
            with contextlib.suppress(OSError):  # The client hung up, as some scripts expect.
                self.script(conn, reader, self.done)
            self.done.wait(30)

    def close(self) -> None:
        self.done.set()
        self.thread.join(30)
        self.listener.close()


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Callable[..., ScriptedGateway]]:
    made: list[ScriptedGateway] = []

    def make(script: Script, **kw: str) -> ScriptedGateway:
        made.append(ScriptedGateway(tmp_path, script, **kw))
        return made[-1]

    yield make
    for gateway in made:
        gateway.close()


def connect(section: GatewaySection) -> GatewayClient:
    return GatewayClient.connect(section, "engine")


def test_progress_keeps_a_long_request_alive(scripted: Callable[..., ScriptedGateway]) -> None:
    """A commit that takes longer than request_timeout_ms (here 4 x 35% of it), with a
    PROGRESS between each part, succeeds: the timeout bounds silence, not duration."""

    def slow_commit(conn: socket.socket, reader: FrameReader, done: threading.Event) -> None:
        header, _ = reader.message()
        for i in range(4):
            done.wait(0.35)  # 35% of the 1000 ms timeout: time must pass for this test.
            send_message(conn, p.Progress(i), header.request_id)
        send_message(conn, p.PutDone(7), header.request_id)

    gateway = scripted(slow_commit)
    client = connect(gateway.section)
    try:
        assert client.commit_put(PutBatch(1, [], [])) == 7
    finally:
        client.close()


def test_silence_past_request_timeout_is_a_hang(scripted: Callable[..., ScriptedGateway]) -> None:
    def silent(conn: socket.socket, reader: FrameReader, done: threading.Event) -> None:
        reader.message()  # And never answer.

    gateway = scripted(silent)
    client = connect(gateway.section)
    try:
        with pytest.raises(GatewayUnavailable, match="within 1000 ms"):
            client.lookup([b"k" * 16])
        with pytest.raises(GatewayUnavailable, match="does not reconnect"):
            client.lookup([b"k" * 16])
    finally:
        client.close()


def test_a_reply_for_another_request_is_incoherence(scripted: Callable[..., ScriptedGateway]) -> None:
    def confused(conn: socket.socket, reader: FrameReader, done: threading.Event) -> None:
        header, _ = reader.message()
        send_message(conn, p.LookupOk(0), header.request_id + 1)

    gateway = scripted(confused)
    client = connect(gateway.section)
    try:
        with pytest.raises(GatewayUnavailable, match="came for request"):
            client.lookup([b"k" * 16])
        assert client.down is not None
    finally:
        client.close()


def test_a_span_outside_the_segment_is_refused(scripted: Callable[..., ScriptedGateway]) -> None:
    def wild(conn: socket.socket, reader: FrameReader, done: threading.Event) -> None:
        header, _ = reader.message()
        send_message(conn, p.GetReady(1, [(4000, 200)]), header.request_id)

    gateway = scripted(wild)
    client = connect(gateway.section)
    try:
        with pytest.raises(GatewayUnavailable, match="outside the 4096-byte segment"):
            client.get(FINGERPRINT, [b"k" * 16])
    finally:
        client.close()


def test_gateway_of_another_release_is_refused_by_the_client(scripted: Callable[..., ScriptedGateway]) -> None:
    """A gateway that answered HELLO_OK for a release it should have refused."""
    gateway = scripted(lambda conn, reader, done: None, release="0.0.1")
    with pytest.raises(VersionMismatch, match=rf"client is release {__version__}.*release 0\.0\.1"):
        connect(gateway.section)


def test_a_bad_request_is_refused_before_sending_and_the_client_stays_up(
    started: Callable[..., GatewayProcess],
) -> None:
    gateway = started()
    with closing_client(gateway.client()) as client:
        with pytest.raises(GatewayRefused, match="BAD_KEY"):
            client.lookup([b"short"])
        with pytest.raises(GatewayRefused, match="TOO_LARGE"):
            client.get(FINGERPRINT, [b"k" * 16] * (p.KEYS_PER_MESSAGE_MAX + 1))
        assert client.down is None
        assert client.lookup([b"k" * 16]) == 0


def test_a_full_batch_commits_within_a_short_request_timeout(started: Callable[..., GatewayProcess]) -> None:
    """The largest batch the protocol allows, against a 300 ms request timeout: however
    long the store takes, the gateway's progress keeps the client waiting for it."""
    gateway = started(request_timeout_ms=300, progress_interval_ms=50, ring_wait_ms=100)
    items = [(i.to_bytes(16, "little"), 256) for i in range(p.KEYS_PER_MESSAGE_MAX)]
    with closing_client(gateway.client()) as client:
        assert put_values(client, items) == len(items)
        assert client.lookup([k for k, _ in items]) == len(items)
