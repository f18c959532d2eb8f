"""The NVMe Key Value command set, encoded into `PassthruCmd64`, and what its commands return.

Source: NVM Express Key Value Command Set Specification 1.0. Every KV I/O
command carries the key in four dwords (bytes 0-7 in CDW2-3, bytes 8-15 in
CDW14-15, little endian, as the controller reads the submission entry), the
key length in CDW11 bits 7:0 and the command's options in CDW11 bits 15:8; a
command that moves a value names its size in CDW10 and the host buffer in
``addr``/``data_len``. An opcode's bits 1:0 give the data direction (01b host to
controller, 10b controller to host, 00b none).

The namespace's limits come from Identify (admin opcode 06h) with CNS 05h and
CSI 01h: the I/O command set specific Identify Namespace data structure for the
KV command set, whose KV format descriptors give the maximum key length,
maximum value length and maximum number of keys.

Every command's data transfer is also bounded by the controller's Maximum Data
Transfer Size (Identify Controller, CNS 01h, byte 77: a power of two in units of
the minimum memory page size, CAP.MPSMIN; 0: no limit); the base specification
aborts a command that exceeds it (Invalid Field in Command), and Linux refuses
such a passthrough before it reaches the controller (EINVAL). A KV Store carries
its whole value in one command (CDW10 is the value's size; the command set has
no offset and no append), and a Retrieve returns it whole into one host buffer,
so a value larger than MDTS can be neither stored nor read back in pieces: the
driver's largest value is capped at MDTS and the cache fragments to it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvharbor.hal.nvme.passthru import PassthruCmd64

KEY_BYTES_MAX = 16
"""The most a KV command carries in its four key dwords."""
IDENTIFY_BYTES = 4096


class KvOpcode(enum.IntEnum):
    STORE = 0x01
    RETRIEVE = 0x02
    LIST = 0x06
    DELETE = 0x10
    EXIST = 0x14


ADMIN_IDENTIFY = 0x06
CNS_CONTROLLER = 0x01
CNS_IO_COMMAND_SET_NAMESPACE = 0x05
CSI_KEY_VALUE = 0x01
MDTS_AT = 77
"""Byte of Identify Controller data holding MDTS."""
MEMORY_PAGE_BYTES_MIN = 4096
"""CAP.MPSMIN's smallest page, 2^(12 + 0): the unit MDTS is taken in. CAP is a controller register,
which no ioctl reads (nvme-cli's show-regs maps the PCI BAR); the smallest page the
specification allows gives a limit never above the true one."""


def _key_dwords(key: bytes) -> tuple[int, int, int, int]:
    """CDW2, CDW3, CDW14, CDW15 for ``key`` (zero padded to 16 bytes)."""
    if not 0 < len(key) <= KEY_BYTES_MAX:
        raise ValueError(f"a KV key is 1 to {KEY_BYTES_MAX} bytes, not {len(key)}")
    return struct.unpack("<4I", key.ljust(KEY_BYTES_MAX, b"\0"))


def kv_command(
    opcode: KvOpcode, nsid: int, key: bytes, addr: int = 0, data_len: int = 0, options: int = 0
) -> PassthruCmd64:
    """One KV I/O command for ``key`` on namespace ``nsid``.

    ``addr``/``data_len`` name the host buffer (the value to store, or room for
    what Retrieve or List returns); CDW10 carries ``data_len`` for the commands
    that move data (Store's value size, Retrieve's and List's host buffer size).
    """
    if not 0 <= options <= 0xFF:
        raise ValueError(f"KV command options are 8 bits, not {options:#x}")
    cdw2, cdw3, cdw14, cdw15 = _key_dwords(key)
    moves_data = opcode in (KvOpcode.STORE, KvOpcode.RETRIEVE, KvOpcode.LIST)
    return PassthruCmd64(
        opcode=int(opcode),
        nsid=nsid,
        cdw2=cdw2,
        cdw3=cdw3,
        addr=addr if moves_data else 0,
        data_len=data_len if moves_data else 0,
        cdw10=data_len if moves_data else 0,
        cdw11=(options << 8) | len(key),
        cdw14=cdw14,
        cdw15=cdw15,
    )


def identify_kv_namespace(nsid: int, addr: int) -> PassthruCmd64:
    """Identify (admin 06h), CNS 05h, CSI 01h, into the 4096 bytes at ``addr``."""
    return PassthruCmd64(
        opcode=ADMIN_IDENTIFY,
        nsid=nsid,
        addr=addr,
        data_len=IDENTIFY_BYTES,
        cdw10=CNS_IO_COMMAND_SET_NAMESPACE,
        cdw11=CSI_KEY_VALUE << 24,
    )


def identify_controller(addr: int) -> PassthruCmd64:
    """Identify (admin 06h), CNS 01h: the controller's data, into the 4096 bytes at ``addr``."""
    return PassthruCmd64(opcode=ADMIN_IDENTIFY, addr=addr, data_len=IDENTIFY_BYTES, cdw10=CNS_CONTROLLER)


def transfer_bytes_max(controller_data: bytes, page_bytes: int = MEMORY_PAGE_BYTES_MIN) -> int | None:
    """The most one command may transfer, from Identify Controller data (MDTS, byte 77, a power
    of two in pages of ``page_bytes``); None where the controller names no limit (MDTS 0)."""
    if len(controller_data) < IDENTIFY_BYTES:
        raise ValueError(f"Identify Controller data is {IDENTIFY_BYTES} bytes, got {len(controller_data)}")
    mdts = controller_data[MDTS_AT]
    return None if mdts == 0 else page_bytes << mdts


def encode_controller_identify(mdts: int) -> bytes:
    """Identify Controller data naming ``mdts`` (the rest zero): the stand-ins answer with it."""
    if not 0 <= mdts <= 0xFF:
        raise ValueError(f"MDTS is one byte, not {mdts}")
    data = bytearray(IDENTIFY_BYTES)
    data[MDTS_AT] = mdts
    return bytes(data)


def command_key(cmd: PassthruCmd64) -> bytes:
    """The key a KV command names (its length from CDW11 bits 7:0): the inverse of `kv_command`."""
    raw = struct.pack("<4I", cmd.cdw2, cmd.cdw3, cmd.cdw14, cmd.cdw15)
    return raw[: cmd.cdw11 & 0xFF]


@dataclass(frozen=True, slots=True)
class KvFormat:
    """One KV format descriptor (16 bytes: KML u16 @0, VML u32 @4, MNK u32 @8)."""

    key_bytes_max: int
    value_bytes_max: int
    keys_max: int
    """0: the controller names no limit."""


@dataclass(frozen=True, slots=True)
class KvNamespaceInfo:
    """The KV Identify Namespace data: NSZE u64 @0 and NUSE u64 @16 (bytes), NKVF u8 @25,
    the KV format descriptors from byte 72. ``formats`` is empty for a namespace without
    the KV command set (a controller that answers the Identify at all then reports none)."""

    size_bytes: int
    used_bytes: int
    formats: tuple[KvFormat, ...]

    @property
    def limits(self) -> KvFormat:
        """The format in use: descriptor 0 (the specification's namespaces have one format
        in effect; kvharbor takes the first, the smallest promise)."""
        if not self.formats:
            raise ValueError("the namespace reports no KV format")
        return self.formats[0]


_KV_FORMATS_AT = 72
_KV_FORMAT_BYTES = 16
_KV_FORMATS_MAX = 16


def parse_kv_identify(data: bytes) -> KvNamespaceInfo:
    """`KvNamespaceInfo` from the 4096 bytes Identify CNS 05h CSI 01h returned."""
    if len(data) < IDENTIFY_BYTES:
        raise ValueError(f"KV Identify data is {IDENTIFY_BYTES} bytes, got {len(data)}")
    (nsze,) = struct.unpack_from("<Q", data, 0)
    (nuse,) = struct.unpack_from("<Q", data, 16)
    count = min(data[25], _KV_FORMATS_MAX)
    formats = []
    for index in range(count):
        kml, vml, mnk = struct.unpack_from("<H2xII", data, _KV_FORMATS_AT + index * _KV_FORMAT_BYTES)
        formats.append(KvFormat(kml, vml, mnk))
    return KvNamespaceInfo(nsze, nuse, tuple(formats))


def encode_kv_identify(info: KvNamespaceInfo) -> bytes:
    """The Identify data for ``info``: the inverse of `parse_kv_identify` (stand-ins answer with it)."""
    data = bytearray(IDENTIFY_BYTES)
    struct.pack_into("<Q", data, 0, info.size_bytes)
    struct.pack_into("<Q", data, 16, info.used_bytes)
    data[25] = len(info.formats)
    for index, fmt in enumerate(info.formats):
        at = _KV_FORMATS_AT + index * _KV_FORMAT_BYTES
        struct.pack_into("<H2xII", data, at, fmt.key_bytes_max, fmt.value_bytes_max, fmt.keys_max)
    return bytes(data)


def parse_key_list(data: bytes | memoryview) -> list[bytes]:
    """The keys of a List command's data: the number of keys (u32 @0), then per key
    its length (u16) and its bytes, each entry padded to a multiple of 4 bytes.

    Raises ValueError when an entry runs past the data (a truncated answer)."""
    view = bytes(data)
    (count,) = struct.unpack_from("<I", view, 0)
    keys: list[bytes] = []
    at = 4
    for _ in range(count):
        if at + 2 > len(view):
            raise ValueError(f"List data ends inside entry {len(keys)} of {count}")
        (length,) = struct.unpack_from("<H", view, at)
        if at + 2 + length > len(view):
            raise ValueError(f"List data ends inside key {len(keys)} of {count}")
        keys.append(view[at + 2 : at + 2 + length])
        at += (2 + length + 3) & ~3
    return keys


def encode_key_list(keys: list[bytes], room_bytes: int) -> bytes:
    """List data holding as many of ``keys`` as fit ``room_bytes``: the inverse of `parse_key_list`."""
    body, count = bytearray(), 0
    for key in keys:
        entry = struct.pack("<H", len(key)) + key
        entry += b"\0" * (-len(entry) % 4)
        if 4 + len(body) + len(entry) > room_bytes:
            break
        body += entry
        count += 1
    return struct.pack("<I", count) + bytes(body)
