"""Read-only questions a tool asks a gateway without attaching: STATUS and LOCATE.

``kvharbor status`` and ``kvharbor doctor`` must not change what they look at: they
send no HELLO (so they are no client, keep no embedded gateway alive, map no shared
memory, and need the gateway's config digest no more than its release), and ask only
questions that change nothing (`kvharbor.gateway.server.READ_ONLY_QUERIES`).

When nothing answers as a gateway, `NoGateway` says what was found instead, as one of
the `Absence` kinds, for a tool to print and exit non-zero on.
"""

from __future__ import annotations

import enum
import socket
import stat
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from kvharbor.config import GatewaySection
from kvharbor.gateway import protocol as p
from kvharbor.gateway.access import denied_hint
from kvharbor.gateway.status import GatewayStatus
from kvharbor.gateway.wire import FrameReader, PeerClosed, send_message

_Reply = TypeVar("_Reply", bound=p.Message)


class Absence(enum.Enum):
    """Why no gateway answers at a socket path."""

    SOCKET_MISSING = "socket missing"
    NOT_A_SOCKET = "not a socket"
    REFUSED = "connection refused"
    ACCESS_DENIED = "access denied"
    NOT_A_GATEWAY = "not a gateway"
    NO_ANSWER = "no answer"
    OTHER_RELEASE = "another release"


class NoGateway(Exception):
    """No gateway of this release answers at the socket; ``absence`` says what was found."""

    def __init__(self, absence: Absence, text: str) -> None:
        super().__init__(f"{absence.value}: {text}")
        self.absence = absence
        self.text = text


class GatewayQuery:
    """One connection for read-only questions; use as a context manager."""

    def __init__(self, sock: socket.socket, section: GatewaySection) -> None:
        self._sock = sock
        self._section = section
        self._reader = FrameReader(sock, section.message_bytes_max)
        self._next_id = 1

    @classmethod
    def connect(cls, section: GatewaySection) -> GatewayQuery:
        """Connect to ``section.socket``; raises `NoGateway` saying why not."""
        path = Path(section.socket)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise NoGateway(
                Absence.SOCKET_MISSING, f"{path} does not exist: no gateway serves this gateway.socket"
            ) from None
        except PermissionError:
            raise NoGateway(Absence.ACCESS_DENIED, denied_hint("the gateway socket", path)) from None
        if not stat.S_ISSOCK(mode):
            raise NoGateway(Absence.NOT_A_SOCKET, f"{path} is not a Unix socket: check gateway.socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(section.connect_timeout_ms / 1000)
        try:
            sock.connect(str(path))
        except PermissionError:
            sock.close()
            raise NoGateway(Absence.ACCESS_DENIED, denied_hint("the gateway socket", path)) from None
        except ConnectionRefusedError:
            sock.close()
            raise NoGateway(
                Absence.REFUSED, f"nothing listens on {path}: a gateway that stopped without removing its socket"
            ) from None
        except OSError as err:
            sock.close()
            raise NoGateway(Absence.REFUSED, f"cannot connect to {path} ({err.strerror or err})") from None
        sock.settimeout(section.request_timeout_ms / 1000)
        return cls(sock, section)

    def __enter__(self) -> GatewayQuery:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def status(self) -> GatewayStatus:
        return self._ask(p.Status(), p.StatusOk).status

    def locate(self, keys: Sequence[bytes]) -> list[int]:
        """`p.LocateOk.holders` of ``keys``, asked in batches of `p.KEYS_PER_MESSAGE_MAX`."""
        return p.locate_all(
            keys, lambda question: self._ask(question, p.LocateOk), lambda why: NoGateway(Absence.NOT_A_GATEWAY, why)
        )

    def _ask(self, request: p.Message, expect: type[_Reply]) -> _Reply:
        path = self._section.socket
        request_id = self._next_id
        self._next_id += 1
        try:
            send_message(self._sock, request, request_id)
            frame, reply = self._reader.answer(request_id)
        except TimeoutError:
            raise NoGateway(
                Absence.NO_ANSWER,
                f"{path} did not answer {type(request).__name__} within {self._section.request_timeout_ms} ms "
                "(gateway.request_timeout_ms): a hung gateway, or another server's socket",
            ) from None
        except (OSError, PeerClosed) as err:
            raise NoGateway(Absence.NOT_A_GATEWAY, f"{path} hung up instead of answering ({err})") from None
        except p.ProtocolError as err:
            if err.code is p.ErrorCode.VERSION_MISMATCH:
                raise NoGateway(Absence.OTHER_RELEASE, f"the gateway at {path} is {err.message}") from None
            raise NoGateway(Absence.NOT_A_GATEWAY, f"{path} answered something that is no gateway's ({err})") from None
        if isinstance(reply, p.Error):
            if reply.code is p.ErrorCode.NOT_READY:
                raise NoGateway(
                    Absence.OTHER_RELEASE,
                    f"the gateway at {path} asks for a handshake first: a release before protocol 8, which "
                    "serves status only to attached engines",
                )
            if reply.code is p.ErrorCode.ACCESS_DENIED:
                raise NoGateway(Absence.ACCESS_DENIED, reply.text)
            raise NoGateway(Absence.NOT_A_GATEWAY, f"the gateway at {path} refused {type(request).__name__}: {reply}")
        if frame.request_id != request_id or not isinstance(reply, expect):
            raise NoGateway(
                Absence.NOT_A_GATEWAY,
                f"{path} answered {type(reply).__name__} (request {frame.request_id}) to {type(request).__name__} "
                f"(request {request_id})",
            )
        return reply
