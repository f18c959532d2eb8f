"""The KV command set's encoding, byte for byte, against the kernel's struct layout.

The expected bytes are built independently of `PassthruCmd64`: each field packed at
its offset in ``struct nvme_passthru_cmd64`` as ``include/uapi/linux/nvme_ioctl.h``
lays it out (opcode@0 flags@1 rsvd1@2 nsid@4 cdw2@8 cdw3@12 metadata@16 addr@24
metadata_len@32 data_len@36 cdw10@40 .. cdw15@60 timeout_ms@64 rsvd2@68 result@72).
"""

from __future__ import annotations

import ctypes
import struct

import pytest

from kvharbor.hal.kv_status import KvStatus
from kvharbor.hal.nvme.kv_commands import (
    KvFormat,
    KvNamespaceInfo,
    KvOpcode,
    command_key,
    encode_controller_identify,
    encode_key_list,
    encode_kv_identify,
    identify_controller,
    identify_kv_namespace,
    kv_command,
    parse_key_list,
    parse_kv_identify,
    transfer_bytes_max,
)
from kvharbor.hal.nvme.passthru import NVME_IOCTL_ADMIN64_CMD, NVME_IOCTL_IO64_CMD, PassthruCmd64

# fmt: off
KERNEL_LAYOUT = {
    "opcode": (0, "B"), "flags": (1, "B"), "rsvd1": (2, "H"), "nsid": (4, "I"), "cdw2": (8, "I"), "cdw3": (12, "I"),
    "metadata": (16, "Q"), "addr": (24, "Q"), "metadata_len": (32, "I"), "data_len": (36, "I"),
    "cdw10": (40, "I"), "cdw11": (44, "I"), "cdw12": (48, "I"), "cdw13": (52, "I"),
    "cdw14": (56, "I"), "cdw15": (60, "I"),
    "timeout_ms": (64, "I"), "rsvd2": (68, "I"), "result": (72, "Q"),
}
# fmt: on

KEY = bytes(range(0x10, 0x20))  # 10 11 .. 1f: each byte says where it belongs.


def kernel_bytes(**fields: int) -> bytes:
    raw = bytearray(80)
    for name, value in fields.items():
        offset, code = KERNEL_LAYOUT[name]
        struct.pack_into("<" + code, raw, offset, value)
    return bytes(raw)


def test_struct_is_the_kernels() -> None:
    assert ctypes.sizeof(PassthruCmd64) == 80
    for name, (offset, code) in KERNEL_LAYOUT.items():
        assert getattr(PassthruCmd64, name).offset == offset, name
        assert getattr(PassthruCmd64, name).size == struct.calcsize(code), name
    # _IOWR('N', 0x48 / 0x47, struct nvme_passthru_cmd64): read|write, 80 bytes, type 'N'.
    assert (NVME_IOCTL_IO64_CMD, NVME_IOCTL_ADMIN64_CMD) == (0xC0504E48, 0xC0504E47)


KEY_DWORDS = {"cdw2": 0x13121110, "cdw3": 0x17161514, "cdw14": 0x1B1A1918, "cdw15": 0x1F1E1D1C}


@pytest.mark.parametrize(
    ("opcode", "moves_data"),
    [
        (KvOpcode.STORE, True),
        (KvOpcode.RETRIEVE, True),
        (KvOpcode.LIST, True),
        (KvOpcode.DELETE, False),
        (KvOpcode.EXIST, False),
    ],
)
def test_each_kv_command_byte_for_byte(opcode: KvOpcode, moves_data: bool) -> None:
    cmd = kv_command(opcode, nsid=7, key=KEY, addr=0x7F00_0000_1000, data_len=4096, options=0x02)
    data = {"addr": 0x7F00_0000_1000, "data_len": 4096, "cdw10": 4096} if moves_data else {}
    # Key length 16 in CDW11[7:0], options in CDW11[15:8].
    assert bytes(cmd) == kernel_bytes(opcode=int(opcode), nsid=7, cdw11=0x0210, **KEY_DWORDS, **data)
    assert command_key(cmd) == KEY


def test_a_short_key_is_zero_padded_with_its_length() -> None:
    cmd = kv_command(KvOpcode.EXIST, nsid=1, key=b"\x01\x02\x03")
    assert bytes(cmd) == kernel_bytes(opcode=0x14, nsid=1, cdw2=0x030201, cdw11=3)
    assert command_key(cmd) == b"\x01\x02\x03"


@pytest.mark.parametrize("key", [b"", bytes(17)])
def test_keys_outside_1_to_16_bytes_are_refused(key: bytes) -> None:
    with pytest.raises(ValueError, match="a KV key is 1 to 16 bytes"):
        kv_command(KvOpcode.STORE, 1, key)


def test_identify_kv_namespace_byte_for_byte() -> None:
    cmd = identify_kv_namespace(nsid=3, addr=0x1000)
    # Admin Identify 06h, CNS 05h in CDW10[7:0], CSI 01h in CDW11[31:24], 4096 bytes.
    assert bytes(cmd) == kernel_bytes(opcode=0x06, nsid=3, addr=0x1000, data_len=4096, cdw10=0x05, cdw11=0x0100_0000)


def test_identify_controller_byte_for_byte_and_mdts() -> None:
    cmd = identify_controller(addr=0x2000)
    # Admin Identify 06h, CNS 01h in CDW10[7:0], no namespace, 4096 bytes.
    assert bytes(cmd) == kernel_bytes(opcode=0x06, addr=0x2000, data_len=4096, cdw10=0x01)
    data = bytearray(4096)
    data[77] = 5  # MDTS: 2^5 pages of CAP.MPSMIN.
    assert transfer_bytes_max(bytes(data)) == 32 * 4096
    assert transfer_bytes_max(bytes(data), page_bytes=16384) == 32 * 16384
    assert transfer_bytes_max(encode_controller_identify(0)) is None, "MDTS 0: no limit"
    assert encode_controller_identify(5) == bytes(data)
    with pytest.raises(ValueError, match="4096 bytes, got 100"):
        transfer_bytes_max(bytes(100))


def test_kv_identify_layout() -> None:
    data = bytearray(4096)
    struct.pack_into("<Q", data, 0, 1 << 40)  # NSZE
    struct.pack_into("<Q", data, 16, 12345)  # NUSE
    data[25] = 2  # NKVF
    struct.pack_into("<HxxII", data, 72, 16, 1 << 20, 1000)  # KV format 0: KML, VML, MNK
    struct.pack_into("<HxxII", data, 88, 8, 4096, 0)
    info = parse_kv_identify(bytes(data))
    assert info == KvNamespaceInfo(1 << 40, 12345, (KvFormat(16, 1 << 20, 1000), KvFormat(8, 4096, 0)))
    assert info.limits == KvFormat(16, 1 << 20, 1000)
    assert encode_kv_identify(info) == bytes(data)


def test_key_list_layout_and_truncation() -> None:
    data = encode_key_list([b"abc", KEY, b"\x01"], room_bytes=4096)
    # count, then (u16 length, key) padded to 4 bytes: 2+3 -> 8, 2+16 -> 20, 2+1 -> 4.
    assert data[:4] == struct.pack("<I", 3) and len(data) == 4 + 8 + 20 + 4
    assert data[4:9] == b"\x03\x00abc"
    assert parse_key_list(data) == [b"abc", KEY, b"\x01"]
    assert parse_key_list(encode_key_list([KEY] * 10, room_bytes=4 + 2 * 20)) == [KEY, KEY]
    with pytest.raises(ValueError, match="List data ends inside key 1 of 3"):
        parse_key_list(data[:20])


def test_status_field_decoding_ignores_crd_more_dnr() -> None:
    # DNR (bit 14), More (bit 13), CRD (bits 12:11) set around SCT 1h / SC 87h.
    assert KvStatus.decode((1 << 14) | (1 << 13) | (3 << 11) | 0x187) == KvStatus(1, 0x87)
