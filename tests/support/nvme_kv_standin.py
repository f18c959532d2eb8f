"""A stand-in for an NVMe KV controller behind `IoctlFn`: the hardware is not here, so this
answers the kernel's passthrough as a KV namespace does (NVM Express Key Value Command
Set Specification 1.0), and records every command it was given, byte for byte.

Everything above the ioctl (encoding, status decoding, buffers, fragment limits) is
the driver's real code. ``script`` makes the next commands answer a given status or
fail with an errno, as a card under faults would.
"""

from __future__ import annotations

import ctypes
import errno
from collections import deque
from dataclasses import dataclass, field

from kvharbor.hal.kv_status import CAPACITY_EXCEEDED, INVALID_VALUE_SIZE, KEY_NOT_FOUND, KvStatus
from kvharbor.hal.nvme.kv_commands import (
    ADMIN_IDENTIFY,
    CNS_CONTROLLER,
    MEMORY_PAGE_BYTES_MIN,
    KvFormat,
    KvNamespaceInfo,
    KvOpcode,
    command_key,
    encode_controller_identify,
    encode_key_list,
    encode_kv_identify,
)
from kvharbor.hal.nvme.kv_device import NVME_IOCTL_ID
from kvharbor.hal.nvme.passthru import NVME_IOCTL_ADMIN64_CMD, NVME_IOCTL_IO64_CMD, PassthruCmd64


@dataclass
class KvNamespaceStandIn:
    capacity_bytes: int = 1 << 24
    value_bytes_max: int = 64 * 1024
    keys_max: int = 1024
    nsid: int = 1
    kv: bool = True
    """False: a namespace without the KV command set (Identify CNS 05h CSI 01h finds no format)."""
    mdts: int = 0
    """The controller's MDTS (0: no limit): a command moving more than ``4096 << mdts`` bytes
    fails with EINVAL, as Linux refuses such a passthrough before the controller sees it."""
    values: dict[bytes, bytes] = field(default_factory=dict)
    commands: list[bytes] = field(default_factory=list)
    """Every command, as the 80 bytes the kernel would have read."""
    script: deque[KvStatus | int] = field(default_factory=deque)
    """Answers for the next I/O commands: a status, or an errno the ioctl fails with."""

    def __call__(self, fd: int, request: int, cmd: PassthruCmd64) -> int:
        if request == NVME_IOCTL_ID:
            return self.nsid
        self.commands.append(bytes(cmd))
        if request == NVME_IOCTL_ADMIN64_CMD and cmd.opcode == ADMIN_IDENTIFY:
            return self._identify(cmd)
        assert request == NVME_IOCTL_IO64_CMD, hex(request)
        if self.mdts and cmd.data_len > MEMORY_PAGE_BYTES_MIN << self.mdts:
            raise OSError(errno.EINVAL, f"{cmd.data_len} bytes exceed MDTS")
        if self.script:
            answer = self.script.popleft()
            if isinstance(answer, int):
                raise OSError(answer, errno.errorcode[answer])
            return answer.encode()
        return self._io(cmd)

    def _identify(self, cmd: PassthruCmd64) -> int:
        if cmd.cdw10 & 0xFF == CNS_CONTROLLER:
            ctypes.memmove(cmd.addr, encode_controller_identify(self.mdts), cmd.data_len)
            return 0
        formats = (KvFormat(16, self.value_bytes_max, self.keys_max),) if self.kv else ()
        used = sum(map(len, self.values.values()))
        ctypes.memmove(cmd.addr, encode_kv_identify(KvNamespaceInfo(self.capacity_bytes, used, formats)), cmd.data_len)
        return 0

    def _io(self, cmd: PassthruCmd64) -> int:
        key, op = command_key(cmd), KvOpcode(cmd.opcode)
        if op is KvOpcode.STORE:
            if cmd.cdw10 > self.value_bytes_max:
                return INVALID_VALUE_SIZE.encode()
            used = sum(len(v) for k, v in self.values.items() if k != key)
            if used + cmd.cdw10 > self.capacity_bytes or (key not in self.values and len(self.values) >= self.keys_max):
                return CAPACITY_EXCEEDED.encode()
            self.values[key] = ctypes.string_at(cmd.addr, cmd.cdw10)
            return 0
        if op is KvOpcode.LIST:
            ordered = sorted(self.values)  # This controller's order: byte order.
            listed = encode_key_list([k for k in ordered if k >= key], cmd.data_len)
            ctypes.memmove(cmd.addr, listed, len(listed))
            return 0
        if key not in self.values:
            return KEY_NOT_FOUND.encode()
        if op is KvOpcode.RETRIEVE:
            value = self.values[key]
            if cmd.data_len:
                ctypes.memmove(cmd.addr, value, min(len(value), cmd.data_len))
            cmd.result = len(value)
        elif op is KvOpcode.DELETE:
            del self.values[key]
        return 0
