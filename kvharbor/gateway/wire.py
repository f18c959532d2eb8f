"""Framed message I/O over a stream socket, shared by gateway and client.

Reads go through `FrameReader`, one reusable buffer per connection: a small
message (the common case: a lookup, a commit) arrives in one ``recv`` together
with its header instead of two, and no buffer is allocated per message. Only a
frame larger than the buffer gets a buffer of its own.
"""

from __future__ import annotations

import socket

from kvharbor.gateway.protocol import (
    FRAME_BYTES,
    ErrorCode,
    FrameHeader,
    Message,
    Progress,
    ProtocolError,
    decode_body,
    decode_frame_header,
    encode,
)

READ_BUFFER_BYTES = 64 * 1024
"""Per-connection read buffer; larger frames get a one-off buffer."""


class PeerClosed(Exception):
    """The other side closed the connection."""


class FrameReader:
    """Whole frames from one socket. A body returned by `frame` is a view into
    the reader's buffer, valid until the next call: decode it before reading on."""

    def __init__(self, sock: socket.socket, body_bytes_max: int) -> None:
        assert body_bytes_max > 0
        self._sock = sock
        self._body_bytes_max = body_bytes_max
        self._buffer = bytearray(READ_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0  # First unconsumed byte.
        self._end = 0  # One past the last received byte.

    def frame(self) -> tuple[FrameHeader, memoryview]:
        """The next frame's header and body. A frame too large is refused (`ProtocolError`)
        before its body is read; the stream cannot be resynchronised after that."""
        self._fill(FRAME_BYTES)
        header = decode_frame_header(self._view[self._start : self._start + FRAME_BYTES], self._body_bytes_max)
        self._start += FRAME_BYTES
        if header.length > len(self._buffer):
            return header, self._oversized(header.length)
        self._fill(header.length)
        body = self._view[self._start : self._start + header.length]
        self._start += header.length
        return header, body

    def _fill(self, size: int) -> None:
        """Make ``size`` unconsumed bytes available, receiving as much as the socket has."""
        assert size <= len(self._buffer)
        if self._end - self._start >= size:
            return
        if self._start == self._end:
            self._start = self._end = 0  # All consumed: start over at the front, no copy.
        if self._start + size > len(self._buffer):
            # Move the unconsumed tail to the front; it is shorter than one frame header
            # or one body, so this copy is small.
            tail = self._end - self._start
            self._buffer[:tail] = self._buffer[self._start : self._end]
            self._start, self._end = 0, tail
        while self._end - self._start < size:
            n = self._sock.recv_into(self._view[self._end :])
            if n == 0:
                raise PeerClosed(f"connection closed after {self._end - self._start} of {size} bytes")
            self._end += n

    def _oversized(self, length: int) -> memoryview:
        body = bytearray(length)
        have = self._end - self._start
        body[:have] = self._view[self._start : self._end]
        self._start = self._end = 0
        view = memoryview(body)
        while have < length:
            n = self._sock.recv_into(view[have:])
            if n == 0:
                raise PeerClosed(f"connection closed after {have} of {length} bytes")
            have += n
        return view

    def message(self) -> tuple[FrameHeader, Message]:
        header, body = self.frame()
        return header, decode_body(header.type, body)

    def answer(self, request_id: int) -> tuple[FrameHeader, Message]:
        """The next message that is not a PROGRESS report on ``request_id``: each report
        restarts the socket's timeout, which so bounds the gateway's silence, not a long
        request's duration (`kvharbor.gateway.progress`)."""
        header, message = self.message()
        while isinstance(message, Progress) and header.request_id == request_id:
            header, message = self.message()
        return header, message


def send_message(sock: socket.socket, message: Message, request_id: int) -> None:
    sock.sendall(encode(message, request_id))


__all__ = [
    "ErrorCode",
    "FrameReader",
    "PeerClosed",
    "ProtocolError",
    "send_message",
]
