"""`RequestProgress`: PROGRESS frames only while a request is served, never half a frame,
never blocking the heartbeat on a client that stopped reading."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvharbor.gateway import protocol as p
from kvharbor.gateway.progress import RequestProgress
from kvharbor.gateway.wire import FrameReader

INTERVAL_S = 1.0
MAX_S = 10.0


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    gateway, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield gateway, client
    finally:
        gateway.close()
        client.close()


def pending(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def test_beats_go_out_only_while_a_request_is_served(pair: tuple[socket.socket, socket.socket]) -> None:
    gateway, client = pair
    progress = RequestProgress(gateway, INTERVAL_S, MAX_S)
    with progress.serving(7):
        progress(3)  # Not due yet: the first report is one interval after the start.
        assert pending(client) == b""
        progress.beat(_later(INTERVAL_S))
        frame, message = FrameReader(client, 1 << 16).message()
        assert (frame.request_id, message) == (7, p.Progress(3))
    progress.beat(_later(2 * INTERVAL_S))  # The request is answered: nothing follows it.
    assert pending(client) == b""


def test_no_beat_past_request_max(pair: tuple[socket.socket, socket.socket]) -> None:
    gateway, client = pair
    progress = RequestProgress(gateway, INTERVAL_S, MAX_S)
    with progress.serving(1):
        progress.beat(_later(MAX_S + INTERVAL_S))
        assert pending(client) == b""


def test_a_client_that_stopped_reading_does_not_block_the_heartbeat(pair: tuple[socket.socket, socket.socket]) -> None:
    gateway, client = pair
    gateway.setblocking(False)
    with pytest.raises(BlockingIOError):
        while True:  # Fill the client's receive buffer: it reads nothing.
            gateway.send(b"\0" * 65536)
    gateway.setblocking(True)
    progress = RequestProgress(gateway, INTERVAL_S, MAX_S)
    with progress.serving(2):
        progress.beat(_later(INTERVAL_S))  # Returns: the beat is skipped...
    drained = b""
    while chunk := pending(client):
        drained += chunk
    assert drained and drained.count(0) == len(drained), "...not half-sent behind the filler"


def _later(after_s: float) -> float:
    """A monotonic time at least ``after_s`` past the start of the request being served."""
    return time.monotonic() + after_s
