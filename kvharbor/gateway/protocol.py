"""The gateway wire protocol: small binary control messages over a Unix socket.

KV bytes never travel in these messages: they sit in the shared-memory segment,
and messages carry only keys, sizes and offsets into it. A frame is::

    length u32 (of the body that follows the frame header)
    type u16 | flags u16 | request id u64
    body (type-specific, little-endian)

Every decoder checks lengths before it reads, so a malformed, truncated or
hostile frame raises `ProtocolError` (with the code to answer) and never
reads past the frame or allocates more than the frame's own size.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

from kvharbor.cache.keys import KEY_BYTES, NAMESPACE_UNKNOWN
from kvharbor.cache.purge import PurgeFilter, PurgeReport
from kvharbor.config import ConfigDigest
from kvharbor.gateway.status import GatewayStatus, StatusFormError, peek_release

PROTOCOL_VERSION = 10
"""Bumped on any change to frames or message bodies, or to what their fields mean. 2:
PROGRESS. 4: PUT_COMMIT carries the writer's payload checksums. 5: HELLO carries the
client's `ConfigDigest`. 6: PUT_READY lends an area for completion marks. 7: LOOKUP checks
value sizes and answers which hits are resident; VERIFY and DROP. 8: STATUS_OK carries a
typed `GatewayStatus`; HELLO registers the client's layouts; STATUS and LOCATE need no
HELLO; PUT_PREPARE carries the writer's namespace tag; PURGE. 9: PUT_COMMIT's checksums
are object format 3's (`kvharbor.hal.checksum`). 10: PUT_READY says how many values found no
room (a saver counts them dropped; the others it skips are stored already)."""

FRAME = struct.Struct("<IHHQ")
FRAME_BYTES = FRAME.size
KEYS_PER_MESSAGE_MAX = 4096
"""A batch holds at most this many keys: 4096 chunks of 256 tokens is 1 M tokens."""
TEXT_BYTES_MAX = 4096
DIGEST_SECTIONS_MAX = 16
LAYOUTS_PER_HELLO_MAX = 256
"""Layouts one client may register at its handshake: one per rank it serves (TP x PP)."""
LAYOUT_BYTES_MAX = 64 * 1024
"""The longest canonical layout fingerprint (one descriptor per KV cache group in it)."""


class MessageType(enum.IntEnum):
    HELLO = 1
    HELLO_OK = 2
    ERROR = 3
    PROGRESS = 4
    LOOKUP = 10
    LOOKUP_OK = 11
    LOCATE = 16
    LOCATE_OK = 17
    VERIFY = 12
    VERIFY_OK = 13
    DROP = 14
    DROPPED = 15
    PUT_PREPARE = 20
    PUT_READY = 21
    PUT_COMMIT = 22
    PUT_DONE = 23
    GET = 30
    GET_READY = 31
    RELEASE = 32
    RELEASED = 33
    STATUS = 40
    STATUS_OK = 41
    PURGE = 50
    PURGED = 51


class ErrorCode(enum.IntEnum):
    MALFORMED = 1
    VERSION_MISMATCH = 2
    BAD_KEY = 3
    TOO_LARGE = 4
    BUSY = 5
    """The shared-memory ring has no room now; retry later or skip."""
    UNKNOWN_BATCH = 6
    NOT_READY = 7
    """A request before the handshake."""
    INTERNAL = 8
    CONFIG_MISMATCH = 9
    """The client's storage or card section is not the gateway's (HELLO)."""
    ACCESS_DENIED = 10
    """The client's user is not admitted by the gateway's ``gateway.access`` (at accept)."""
    STEPPING_ASIDE = 11
    """An idle embedded gateway that cannot serve this client (another release, its
    segment gone) exits instead; the client waits for its exit and starts its own."""


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# -- body helpers ----------------------------------------------------------


class _Reader:
    """Bounds-checked sequential reads from one message body.

    Numbers are read in place (``unpack_from``) and a list of keys with one copy,
    not one slice per field: decoding is most of a small request's cost here.
    """

    __slots__ = ("_at", "_body", "_size")

    def __init__(self, body: memoryview) -> None:
        self._body = body
        self._size = body.nbytes
        self._at = 0

    def _advance(self, size: int) -> int:
        """Where the next ``size`` bytes start; raises if the body ends before them."""
        at = self._at
        end = at + size
        if size < 0 or end > self._size:
            raise ProtocolError(ErrorCode.MALFORMED, f"body ends at {self._size} bytes, needed {end}")
        self._at = end
        return at

    def take(self, size: int) -> memoryview:
        at = self._advance(size)
        return self._body[at : at + size]

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack_from(self._body, self._advance(fmt.size))

    def u32(self) -> int:
        return int(_U32.unpack_from(self._body, self._advance(4))[0])

    def text(self) -> str:
        size = self.u32()
        if size > TEXT_BYTES_MAX:
            raise ProtocolError(ErrorCode.MALFORMED, f"text of {size} bytes exceeds {TEXT_BYTES_MAX}")
        try:
            return bytes(self.take(size)).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(ErrorCode.MALFORMED, "text is not UTF-8") from None

    def blob(self, size_max: int) -> bytes:
        size = self.u32()
        if size > size_max:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a field of {size} bytes exceeds {size_max}")
        return bytes(self.take(size))

    def key(self) -> bytes:
        return bytes(self.take(KEY_BYTES))

    def keys(self, n: int) -> list[bytes]:
        raw = bytes(self.take(n * KEY_BYTES))
        return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]

    def count(self) -> int:
        n = self.u32()
        if n > KEYS_PER_MESSAGE_MAX:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} entries exceed {KEYS_PER_MESSAGE_MAX} per message")
        return n

    def remaining(self) -> int:
        return self._size - self._at

    def entries(self, entry_bytes: int) -> int:
        """The count of a list of fixed-size entries that ends the body.

        Such a list must fill the rest of the body exactly; anything else means
        the sender's keys are not `KEY_BYTES` long, which is answered as
        ``BAD_KEY`` rather than the vaguer ``MALFORMED``.
        """
        n = self.count()
        if self.remaining() != n * entry_bytes:
            raise ProtocolError(
                ErrorCode.BAD_KEY,
                f"{n} entries of {entry_bytes} bytes need {n * entry_bytes} bytes, the message has "
                f"{self.remaining()}: a key is {KEY_BYTES} bytes",
            )
        return n

    def end(self) -> None:
        if self._at != self._size:
            raise ProtocolError(ErrorCode.MALFORMED, f"{self._size - self._at} trailing bytes")


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_KEY_SIZE = struct.Struct(f"<{KEY_BYTES}sQ")
_KEY_KEY = struct.Struct(f"<{KEY_BYTES}s{KEY_BYTES}s")
_OFFSET_LENGTH = struct.Struct("<QQ")


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > TEXT_BYTES_MAX:
        # Cut on a character boundary: a split UTF-8 sequence would make the
        # receiver refuse a valid message as malformed.
        raw = raw[:TEXT_BYTES_MAX].decode("utf-8", "ignore").encode("utf-8")
    assert len(raw) <= TEXT_BYTES_MAX
    return _U32.pack(len(raw)) + raw


def _check_key(key: bytes) -> bytes:
    if len(key) != KEY_BYTES:
        raise ProtocolError(ErrorCode.BAD_KEY, f"a key is {KEY_BYTES} bytes, got {len(key)}")
    return key


def _check_count(n: int) -> None:
    if n > KEYS_PER_MESSAGE_MAX:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} entries exceed {KEYS_PER_MESSAGE_MAX} per message")


def _keys(keys: Sequence[bytes]) -> bytes:
    _check_count(len(keys))
    return _U32.pack(len(keys)) + b"".join(_check_key(key) for key in keys)


def _read_keys(reader: _Reader) -> list[bytes]:
    return reader.keys(reader.entries(KEY_BYTES))


# -- messages --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[MessageType]

    def body(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def parse(cls, reader: _Reader) -> Message:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """The first message of every client. Its first four fields are frozen across
    protocols, and a HELLO of another protocol is read up to them (the rest ignored):
    a gateway must read any release's HELLO, to refuse it by name or to step aside for it."""

    TYPE: ClassVar[MessageType] = MessageType.HELLO
    protocol: int
    release: str
    pid: int
    client: str
    config_digest: ConfigDigest
    """What the client's config says the gateway must serve (its storage and card sections)."""
    layouts: tuple[bytes, ...] = ()
    """The canonical fingerprints (`LayoutFingerprint.canonical`) of the layouts the client
    stores and looks up under: the gateway's layout registry (`kvharbor.gateway.layouts`)."""

    def body(self) -> bytes:
        sections = self.config_digest.sections
        if len(sections) > DIGEST_SECTIONS_MAX:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(sections)} digest sections exceed {DIGEST_SECTIONS_MAX}")
        if len(self.layouts) > LAYOUTS_PER_HELLO_MAX:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(self.layouts)} layouts exceed {LAYOUTS_PER_HELLO_MAX}")
        for layout in self.layouts:
            if len(layout) > LAYOUT_BYTES_MAX:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"a layout of {len(layout)} bytes exceeds {LAYOUT_BYTES_MAX}")
        return (
            _U32.pack(self.protocol) + _text(self.release) + _U32.pack(self.pid) + _text(self.client)
            + _U32.pack(len(sections)) + b"".join(_text(name) + _text(digest) for name, digest in sections)
            + _U32.pack(len(self.layouts)) + b"".join(_U32.pack(len(layout)) + layout for layout in self.layouts)
        )  # fmt: skip

    @classmethod
    def parse(cls, reader: _Reader) -> Hello:
        protocol, release, pid, client = reader.u32(), reader.text(), reader.u32(), reader.text()
        if protocol != PROTOCOL_VERSION:
            # The fields after these four may differ in another protocol: keep what is needed
            # to refuse it as VERSION_MISMATCH (naming both), not as MALFORMED.
            reader.take(reader.remaining())
            return cls(protocol, release, pid, client, ConfigDigest(()))
        n = reader.u32()
        if n > DIGEST_SECTIONS_MAX:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} digest sections exceed {DIGEST_SECTIONS_MAX}")
        digest = ConfigDigest(tuple((reader.text(), reader.text()) for _ in range(n)))
        n = reader.u32()
        if n > LAYOUTS_PER_HELLO_MAX:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} layouts exceed {LAYOUTS_PER_HELLO_MAX}")
        return cls(protocol, release, pid, client, digest, tuple(reader.blob(LAYOUT_BYTES_MAX) for _ in range(n)))


@dataclass(frozen=True, slots=True)
class HelloOk(Message):
    TYPE: ClassVar[MessageType] = MessageType.HELLO_OK
    protocol: int
    release: str
    shm_path: str
    shm_bytes: int
    ring_bytes: int
    """Clients write only the segment's first ``ring_bytes``; they map the rest read-only."""
    gateway_pid: int

    def body(self) -> bytes:
        return (
            _U32.pack(self.protocol)
            + _text(self.release)
            + _text(self.shm_path)
            + _U64.pack(self.shm_bytes)
            + _U64.pack(self.ring_bytes)
            + _U32.pack(self.gateway_pid)
        )

    @classmethod
    def parse(cls, reader: _Reader) -> HelloOk:
        return cls(
            reader.u32(), reader.text(), reader.text(), reader.unpack(_U64)[0], reader.unpack(_U64)[0], reader.u32()
        )


@dataclass(frozen=True, slots=True)
class Error(Message):
    TYPE: ClassVar[MessageType] = MessageType.ERROR
    code: ErrorCode
    text: str

    def body(self) -> bytes:
        return _U32.pack(int(self.code)) + _text(self.text)

    @classmethod
    def parse(cls, reader: _Reader) -> Error:
        raw = reader.u32()
        try:
            code = ErrorCode(raw)
        except ValueError:
            code = ErrorCode.INTERNAL
        return cls(code, reader.text())


@dataclass(frozen=True, slots=True)
class Progress(Message):
    """Sent by the gateway during a long request (a large commit to a slow tier), so
    the client's ``request_timeout_ms`` bounds silence rather than the whole request:
    a busy gateway is not mistaken for a hung one, a hung one still is."""

    TYPE: ClassVar[MessageType] = MessageType.PROGRESS
    done: int
    """Items of the request completed so far."""

    def body(self) -> bytes:
        return _U32.pack(self.done)

    @classmethod
    def parse(cls, reader: _Reader) -> Progress:
        return cls(reader.u32())


@dataclass(frozen=True, slots=True)
class Lookup(Message):
    """How many leading keys are stored, as values of ``value_bytes`` each (0: any size)."""

    TYPE: ClassVar[MessageType] = MessageType.LOOKUP
    chunk_tokens: int
    keys: list[bytes]
    value_bytes: int = 0

    def body(self) -> bytes:
        return _U32.pack(self.chunk_tokens) + _U64.pack(self.value_bytes) + _keys(self.keys)

    @classmethod
    def parse(cls, reader: _Reader) -> Lookup:
        chunk_tokens, value_bytes = reader.u32(), reader.unpack(_U64)[0]
        return cls(chunk_tokens, _read_keys(reader), value_bytes)


@dataclass(frozen=True, slots=True)
class LookupOk(Message):
    TYPE: ClassVar[MessageType] = MessageType.LOOKUP_OK
    hits: int
    resident: int = 0
    """Of the hits, how many leading ones a memory tier holds: verified when they were
    written, where nothing outside the gateway can change them; the rest (on a tier that
    outlives the gateway, such as files) are verified with `Verify` before a promise."""

    def body(self) -> bytes:
        return _U32.pack(self.hits) + _U32.pack(self.resident)

    @classmethod
    def parse(cls, reader: _Reader) -> LookupOk:
        hits, resident = reader.u32(), reader.u32()
        if resident > hits:
            raise ProtocolError(ErrorCode.MALFORMED, f"LOOKUP_OK says {resident} resident of {hits} hits")
        return cls(hits, resident)


LOCATED_TIERS_MAX = 64
"""Tiers a `LocateOk` can name (a bit each in a u64)."""


@dataclass(frozen=True, slots=True)
class Locate(Message):
    """Which tiers hold each of ``keys`` (every key, not only a leading run): a read-only
    question for tools (``kvharbor doctor``), and for the connector's search of the last
    stored state among a prompt's chunk ends (a hybrid model's). It counts no lookup, moves nothing in any
    LRU order and reads no value. Allowed before HELLO, like `Status`."""

    TYPE: ClassVar[MessageType] = MessageType.LOCATE
    keys: list[bytes]

    def body(self) -> bytes:
        return _keys(self.keys)

    @classmethod
    def parse(cls, reader: _Reader) -> Locate:
        return cls(_read_keys(reader))


@dataclass(frozen=True, slots=True)
class LocateOk(Message):
    TYPE: ClassVar[MessageType] = MessageType.LOCATE_OK
    holders: list[int]
    """Per key, a bit per tier that holds it: bit i is the gateway's tier i, in the order
    of its status (`StoreStatus.tiers`); 0: no tier does. `LOCATED_TIERS_MAX` tiers at most."""

    def body(self) -> bytes:
        _check_count(len(self.holders))
        return _U32.pack(len(self.holders)) + b"".join(_U64.pack(h) for h in self.holders)

    @classmethod
    def parse(cls, reader: _Reader) -> LocateOk:
        n = reader.count()
        return cls([reader.unpack(_U64)[0] for _ in range(n)])


_Item = TypeVar("_Item")


def batches(items: Sequence[_Item]) -> Iterator[list[_Item]]:
    """``items`` in the parts one message carries: `KEYS_PER_MESSAGE_MAX` at most, in order."""
    for start in range(0, len(items), KEYS_PER_MESSAGE_MAX):
        yield list(items[start : start + KEYS_PER_MESSAGE_MAX])


def locate_all(keys: Sequence[bytes], ask: Callable[[Locate], LocateOk], fail: Callable[[str], Exception]) -> list[int]:
    """`LocateOk.holders` of every one of ``keys``, asked in `batches` (``ask`` sends one
    question and returns its answer); an answer naming another count of keys raises ``fail(why)``."""
    holders: list[int] = []
    for part in batches(keys):
        found = ask(Locate(part)).holders
        if len(found) != len(part):
            raise fail(f"LOCATE_OK names {len(found)} keys for {len(part)} asked")
        holders += found
    return holders


@dataclass(frozen=True, slots=True)
class Verify(Message):
    """Read back the values of ``items`` (fingerprint, key) in order, in full: how many
    leading ones are intact and ``value_bytes`` long (0: any size). A value that is not
    is dropped, as any damaged read is; a RAM tier above takes the intact ones on the
    way (a promotion), so the load that follows reads memory."""

    TYPE: ClassVar[MessageType] = MessageType.VERIFY
    value_bytes: int
    items: list[tuple[bytes, bytes]]

    def body(self) -> bytes:
        _check_count(len(self.items))
        return (
            _U64.pack(self.value_bytes)
            + _U32.pack(len(self.items))
            + b"".join(_KEY_KEY.pack(_check_key(f), _check_key(k)) for f, k in self.items)
        )

    @classmethod
    def parse(cls, reader: _Reader) -> Verify:
        value_bytes = reader.unpack(_U64)[0]
        n = reader.entries(_KEY_KEY.size)
        items = []
        for _ in range(n):
            fingerprint, key = reader.unpack(_KEY_KEY)
            items.append((bytes(fingerprint), bytes(key)))
        return cls(value_bytes, items)


@dataclass(frozen=True, slots=True)
class Count(Message):
    """A reply that only counts: values verified, keys dropped."""

    count: int

    def body(self) -> bytes:
        return _U32.pack(self.count)

    @classmethod
    def parse(cls, reader: _Reader) -> Count:
        return cls(reader.u32())


@dataclass(frozen=True, slots=True)
class VerifyOk(Count):
    TYPE: ClassVar[MessageType] = MessageType.VERIFY_OK


@dataclass(frozen=True, slots=True)
class Drop(Message):
    """Remove ``keys`` from every tier: values that must be stored anew (they lie behind
    a chunk that failed verification, so nothing reaches them until they are)."""

    TYPE: ClassVar[MessageType] = MessageType.DROP
    keys: list[bytes]

    def body(self) -> bytes:
        return _keys(self.keys)

    @classmethod
    def parse(cls, reader: _Reader) -> Drop:
        return cls(_read_keys(reader))


@dataclass(frozen=True, slots=True)
class Dropped(Count):
    TYPE: ClassVar[MessageType] = MessageType.DROPPED


@dataclass(frozen=True, slots=True)
class PutPrepare(Message):
    """Ask for room in shared memory for values the client will then copy in."""

    TYPE: ClassVar[MessageType] = MessageType.PUT_PREPARE
    fingerprint: bytes
    items: list[tuple[bytes, int]]
    """(key, value length in bytes)."""
    namespace: int = NAMESPACE_UNKNOWN
    """The writer's `kvharbor.cache.keys.namespace_tag`, recorded in the stored headers."""

    def body(self) -> bytes:
        # The fingerprint is not one of the batch's keys: a full batch has
        # KEYS_PER_MESSAGE_MAX items besides it.
        _check_count(len(self.items))
        return (
            _check_key(self.fingerprint)
            + _U64.pack(self.namespace)
            + _U32.pack(len(self.items))
            + b"".join(_KEY_SIZE.pack(_check_key(k), n) for k, n in self.items)
        )

    @classmethod
    def parse(cls, reader: _Reader) -> PutPrepare:
        fingerprint, namespace = reader.key(), reader.unpack(_U64)[0]
        n = reader.entries(_KEY_SIZE.size)
        items = []
        for _ in range(n):
            key, size = reader.unpack(_KEY_SIZE)
            items.append((bytes(key), int(size)))
        return cls(fingerprint, items, namespace)


SKIP = 2**64 - 1
"""Offset meaning: do not copy this value (already stored, or no room)."""


@dataclass(frozen=True, slots=True)
class PutReady(Message):
    TYPE: ClassVar[MessageType] = MessageType.PUT_READY
    batch: int
    offsets: list[int]
    """Where each value goes in shared memory, or `SKIP`."""
    marks: int = SKIP
    """Where the batch's completion marks lie in shared memory (`MARK_BYTES` per value of
    the PUT_PREPARE, in its order); `SKIP` when no value was lent."""
    no_room: int = 0
    """Of the `SKIP` offsets, those of values not stored that found no room by the request's
    deadline (``gateway.ring_wait_ms``); the others are stored already."""

    def body(self) -> bytes:
        return (
            _U64.pack(self.batch)
            + _U64.pack(self.marks)
            + _U32.pack(self.no_room)
            + _U32.pack(len(self.offsets))
            + b"".join(_U64.pack(o) for o in self.offsets)
        )

    @classmethod
    def parse(cls, reader: _Reader) -> PutReady:
        batch, marks, no_room = reader.unpack(_U64)[0], reader.unpack(_U64)[0], reader.u32()
        n = reader.count()
        offsets = [reader.unpack(_U64)[0] for _ in range(n)]
        skipped = offsets.count(SKIP)
        if no_room > skipped:
            raise ProtocolError(ErrorCode.MALFORMED, f"PUT_READY: {no_room} values without room, {skipped} skipped")
        return cls(batch, offsets, marks, no_room)


# -- completion marks --------------------------------------------------------------
#
# A put's values are written by the client into places the gateway lent, and stored
# when the client sends PUT_COMMIT. A client can die between the two (vLLM's default
# shutdown kills its engine at once); the completion marks let the gateway store what
# was finished anyway. After writing value i completely, the writer fills mark i in the
# area PUT_READY lent (in the ring, which every client maps writable):
#
#     place u64 | length u64 | checksum u64 | state u64
#
# ``state`` last, in a store of its own: a process dies between two instructions, never
# inside the program order of one thread, so a mark whose state is set was written
# whole, after the value's bytes. The gateway zeroes the area when it lends it and reads
# it only once the client is gone (the connection closed), so it never races a writer.


class MarkState(enum.IntEnum):
    """A mark's last field. Not 0/1: a stray byte must not pass for a mark."""

    UNMARKED = 0
    COMPLETE = 0x4B56_484D_0000_0001
    """The value's bytes are complete; the gateway takes their checksum."""
    COMPLETE_CHECKSUMMED = 0x4B56_484D_0000_0002
    """Complete, and ``checksum`` is the writer's checksum of them (taken while copying)."""


MARK = struct.Struct("<QQQQ")
MARK_BYTES = MARK.size
_MARK_HEAD = struct.Struct("<QQQ")
_MARK_STATE = struct.Struct("<Q")


class Mark(NamedTuple):
    place: int
    """The offset of the place the writer wrote (must be the one lent for this value)."""
    length: int
    checksum: int
    state: int
    """A `MarkState` when well formed; anything else is refused."""


def write_mark(area: memoryview, index: int, place: int, length: int, checksum: int | None) -> None:
    """Mark value ``index`` complete in a batch's mark ``area``: call it only once every
    byte of the value is written. The state goes last, in its own store (see above)."""
    at = index * MARK_BYTES
    _MARK_HEAD.pack_into(area, at, place, length, checksum or 0)
    state = MarkState.COMPLETE if checksum is None else MarkState.COMPLETE_CHECKSUMMED
    _MARK_STATE.pack_into(area, at + _MARK_HEAD.size, state)


def read_mark(area: memoryview, index: int) -> Mark:
    return Mark._make(MARK.unpack_from(area, index * MARK_BYTES))


@dataclass(frozen=True, slots=True)
class BatchRef(Message):
    """A message that only names a batch: commit or release it."""

    batch: int

    def body(self) -> bytes:
        return _U64.pack(self.batch)

    @classmethod
    def parse(cls, reader: _Reader) -> BatchRef:
        return cls(reader.unpack(_U64)[0])


@dataclass(frozen=True, slots=True)
class PutCommit(Message):
    TYPE: ClassVar[MessageType] = MessageType.PUT_COMMIT
    batch: int
    checksums: list[int] = field(default_factory=list)
    """The `kvharbor.hal.checksum.checksum` of each value written, in the batch's order
    (SKIPs left out), taken by the writer while the bytes were in its cache; empty: the
    gateway takes them."""

    def body(self) -> bytes:
        return _U64.pack(self.batch) + _U32.pack(len(self.checksums)) + b"".join(_U64.pack(c) for c in self.checksums)

    @classmethod
    def parse(cls, reader: _Reader) -> PutCommit:
        batch = reader.unpack(_U64)[0]
        n = reader.count()
        return cls(batch, [reader.unpack(_U64)[0] for _ in range(n)])


@dataclass(frozen=True, slots=True)
class Release(BatchRef):
    TYPE: ClassVar[MessageType] = MessageType.RELEASE


@dataclass(frozen=True, slots=True)
class Released(BatchRef):
    TYPE: ClassVar[MessageType] = MessageType.RELEASED


@dataclass(frozen=True, slots=True)
class PutDone(Message):
    TYPE: ClassVar[MessageType] = MessageType.PUT_DONE
    stored: int

    def body(self) -> bytes:
        return _U32.pack(self.stored)

    @classmethod
    def parse(cls, reader: _Reader) -> PutDone:
        return cls(reader.u32())


@dataclass(frozen=True, slots=True)
class Get(Message):
    TYPE: ClassVar[MessageType] = MessageType.GET
    fingerprint: bytes
    keys: list[bytes]

    def body(self) -> bytes:
        return _check_key(self.fingerprint) + _keys(self.keys)

    @classmethod
    def parse(cls, reader: _Reader) -> Get:
        return cls(reader.key(), _read_keys(reader))


@dataclass(frozen=True, slots=True)
class GetReady(Message):
    """The leading hits, each as (offset, length) of its value in shared memory."""

    TYPE: ClassVar[MessageType] = MessageType.GET_READY
    batch: int
    spans: list[tuple[int, int]]

    def body(self) -> bytes:
        return (
            _U64.pack(self.batch)
            + _U32.pack(len(self.spans))
            + b"".join(_OFFSET_LENGTH.pack(o, n) for o, n in self.spans)
        )

    @classmethod
    def parse(cls, reader: _Reader) -> GetReady:
        batch = reader.unpack(_U64)[0]
        n = reader.count()
        return cls(batch, [tuple(reader.unpack(_OFFSET_LENGTH)) for _ in range(n)])


@dataclass(frozen=True, slots=True)
class Status(Message):
    TYPE: ClassVar[MessageType] = MessageType.STATUS

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, reader: _Reader) -> Status:
        return cls()


@dataclass(frozen=True, slots=True)
class StatusOk(Message):
    """The gateway's `GatewayStatus`, in its JSON form (`GatewayStatus.to_json`)."""

    TYPE: ClassVar[MessageType] = MessageType.STATUS_OK
    status: GatewayStatus

    def body(self) -> bytes:
        raw = self.status.to_json().encode()
        return _U32.pack(len(raw)) + raw

    @classmethod
    def parse(cls, reader: _Reader) -> StatusOk:
        raw = bytes(reader.take(reader.u32()))
        try:
            return cls(GatewayStatus.from_json(raw))
        except StatusFormError as err:
            seen = peek_release(raw)
            if seen is not None and seen[1] != PROTOCOL_VERSION:
                raise ProtocolError(
                    ErrorCode.VERSION_MISMATCH,
                    f"release {seen[0]} protocol {seen[1]}, whose status this release (protocol "
                    f"{PROTOCOL_VERSION}) cannot read",
                ) from None
            raise ProtocolError(ErrorCode.MALFORMED, str(err)) from None


@dataclass(frozen=True, slots=True)
class Purge(Message):
    """Empty the part of the cache ``selection`` names, from every tier; with ``apply``
    False only say what would go. Answered `Purged`."""

    TYPE: ClassVar[MessageType] = MessageType.PURGE
    selection: PurgeFilter
    apply: bool

    def body(self) -> bytes:
        return _U32.pack(int(self.apply)) + _json(self.selection.to_json())

    @classmethod
    def parse(cls, reader: _Reader) -> Purge:
        apply = reader.u32()
        if apply not in (0, 1):
            raise ProtocolError(ErrorCode.MALFORMED, f"PURGE apply flag {apply} is neither 0 nor 1")
        return cls(_parse_json(reader, "PURGE", PurgeFilter.from_json), bool(apply))


@dataclass(frozen=True, slots=True)
class Purged(Message):
    """What a `Purge` removed (or would remove), per tier."""

    TYPE: ClassVar[MessageType] = MessageType.PURGED
    report: PurgeReport

    def body(self) -> bytes:
        return _json(self.report.to_json())

    @classmethod
    def parse(cls, reader: _Reader) -> Purged:
        return cls(_parse_json(reader, "PURGED", PurgeReport.from_json))


_Parsed = TypeVar("_Parsed")


def _json(document: str) -> bytes:
    raw = document.encode()
    return _U32.pack(len(raw)) + raw


def _parse_json(reader: _Reader, what: str, parse: Callable[[str], _Parsed]) -> _Parsed:
    """A length-prefixed JSON document parsed into its type; any mismatch is MALFORMED."""
    raw = reader.take(reader.u32())
    try:
        return parse(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as err:  # pydantic's ValidationError is a ValueError.
        raise ProtocolError(ErrorCode.MALFORMED, f"{what} body is not valid: {err}") from None


_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, HelloOk, Error, Progress, Lookup, LookupOk, Locate, LocateOk, Verify, VerifyOk, Drop, Dropped,
        PutPrepare, PutReady, PutCommit, PutDone, Get, GetReady, Release, Released, Status, StatusOk, Purge,
        Purged,
    )
}  # fmt: skip


def encode(message: Message, request_id: int) -> bytes:
    """The frame of ``message``; raises `ProtocolError` for a message that cannot be sent
    (a key of the wrong length, too many keys, a number out of its field's range)."""
    try:
        body = message.body()
    except struct.error as err:
        raise ProtocolError(ErrorCode.MALFORMED, f"{type(message).__name__}: a field is out of range ({err})") from None
    return FRAME.pack(len(body), int(message.TYPE), 0, request_id) + body


class FrameHeader(NamedTuple):
    """A tuple, not a dataclass: one is made per message, on the hot path (a third of
    a frozen dataclass's cost to build)."""

    length: int
    type: int
    flags: int
    request_id: int


def decode_frame_header(data: bytes | memoryview, body_bytes_max: int) -> FrameHeader:
    if len(data) != FRAME_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"frame header of {len(data)} bytes")
    header = FrameHeader._make(FRAME.unpack(data))
    if header.length > body_bytes_max:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {header.length} bytes exceeds {body_bytes_max}")
    return header


def decode_body(kind: int, body: bytes | bytearray | memoryview) -> Message:
    """Parse one message body; raises `ProtocolError` for anything malformed."""
    cls = _TYPES.get(kind)
    if cls is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown message type {kind}")
    reader = _Reader(memoryview(body))
    message = cls.parse(reader)
    reader.end()
    return message


def decode(data: bytes | bytearray | memoryview, body_bytes_max: int = 1 << 20) -> tuple[FrameHeader, Message]:
    """Decode one whole frame (header and body); raises only `ProtocolError`."""
    view = memoryview(data)
    header = decode_frame_header(view[:FRAME_BYTES], body_bytes_max)
    body = view[FRAME_BYTES:]
    if len(body) != header.length:
        raise ProtocolError(ErrorCode.MALFORMED, f"body of {len(body)} bytes, frame says {header.length}")
    return header, decode_body(header.type, body)
