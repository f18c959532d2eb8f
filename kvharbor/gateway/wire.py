"""Framed message I/O over a stream socket, shared by gateway and client."""

from __future__ import annotations

import socket

from kvharbor.gateway.protocol import (
    FRAME_BYTES,
    ErrorCode,
    FrameHeader,
    Message,
    ProtocolError,
    decode_body,
    decode_frame_header,
    encode,
)


class PeerClosed(Exception):
    """The other side closed the connection."""


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise PeerClosed(f"connection closed after {got} of {size} bytes")
        got += n
    return buffer


def recv_frame(sock: socket.socket, body_bytes_max: int) -> tuple[FrameHeader, bytearray]:
    """One frame's header and raw body. A frame too large to read is refused here,
    before its body is read, and the stream cannot be resynchronised after it."""
    header = decode_frame_header(bytes(recv_exact(sock, FRAME_BYTES)), body_bytes_max)
    return header, recv_exact(sock, header.length)


def recv_message(sock: socket.socket, body_bytes_max: int) -> tuple[FrameHeader, Message]:
    header, body = recv_frame(sock, body_bytes_max)
    return header, decode_body(header.type, body)


def send_message(sock: socket.socket, message: Message, request_id: int) -> None:
    sock.sendall(encode(message, request_id))


__all__ = [
    "ErrorCode",
    "PeerClosed",
    "ProtocolError",
    "recv_exact",
    "recv_frame",
    "recv_message",
    "send_message",
]
