"""`NvmeKvDevice`: the device protocol over an NVMe Key Value namespace (``/dev/ngXnY``).

Every call is one or a few KV commands through `IoctlFn`; their statuses go
through the `StatusJudge` every KV card driver shares (a missing key is a
counted miss, never a log line; a full card is `DeviceFull`; a lost path
`TargetUnreachable`; every other code is said once, counted and raised typed).
A host-side failure of the ioctl itself is typed too: EINTR and its kin are
`DeviceTransient`, a vanished device `TargetUnreachable`, anything else
`DeviceError` naming the errno.

The namespace's largest value (KV Identify's maximum value length) and the
controller's largest transfer (MDTS, see `kvharbor.hal.nvme.kv_commands`) cap
``max_value_bytes``; the cache fragments larger values to it, and a put above
it is refused naming the limit that binds (one Store carries one whole value).

As a `CardDevice`, its health and aggregated status come from nvme-cli
(`kvharbor.hal.nvme.card_view`); the controller's error log is its event log.
The KV command set has no key eviction (`evicts_on_its_own` is False): with
``card.key_eviction`` on, the tier evicts instead, least recently used within its
capacity budget; the device only records the setting.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterator, Sequence

from kvharbor.hal.base import (
    Buffer,
    BufferTooSmall,
    CardDevice,
    CardEventRecord,
    CardStatus,
    Device,
    DeviceError,
    DeviceTransient,
    Health,
    HealthState,
    TargetUnreachable,
    Usage,
)
from kvharbor.hal.kv_judge import StatusJudge
from kvharbor.hal.kv_status import SUCCESS, KvStatus
from kvharbor.hal.nvme.card_view import capacity_usage, error_events, supercap_state
from kvharbor.hal.nvme.cli import NvmeCliError
from kvharbor.hal.nvme.drive_health import HEALTH_INTERVAL_S_DEFAULT, DriveHealth
from kvharbor.hal.nvme.health import NvmeAdmin
from kvharbor.hal.nvme.kv_commands import (
    IDENTIFY_BYTES,
    KEY_BYTES_MAX,
    KvNamespaceInfo,
    KvOpcode,
    identify_controller,
    identify_kv_namespace,
    kv_command,
    parse_key_list,
    parse_kv_identify,
    transfer_bytes_max,
)
from kvharbor.hal.nvme.passthru import NVME_IOCTL_ADMIN64_CMD, NVME_IOCTL_IO64_CMD, IoctlFn, PassthruCmd64, kernel_ioctl
from kvharbor.hal.posix import device_mode

NVME_IOCTL_ID = (ord("N") << 8) | 0x40
"""``_IO('N', 0x40)``: the namespace id of an NVMe block or generic char device."""

LIST_BUFFER_BYTES = 64 * 1024
"""Host buffer of one List command while scanning (less where MDTS is less)."""

_TRANSIENT_ERRNOS = frozenset({errno.EINTR, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT})
_GONE_ERRNOS = frozenset({errno.ENODEV, errno.ENXIO, errno.ENOTCONN, errno.ESHUTDOWN, errno.EIO})


def _address(view: memoryview) -> int:
    """The address of a writable contiguous buffer's first byte (0 for an empty one)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


DRIVER_NAME = "kvharbor-nvme-kv"


class NvmeKvDevice(Device, CardDevice):
    """A KV namespace opened by `open_kv_namespace`; keys are at most the namespace's
    maximum key length (16 bytes), values at most ``max_value_bytes``."""

    def __init__(
        self,
        name: str,
        path: str,
        fd: int,
        nsid: int,
        info: KvNamespaceInfo,
        max_value_bytes: int,
        ioctl: IoctlFn,
        admin: NvmeAdmin,
        health_interval_s: float = HEALTH_INTERVAL_S_DEFAULT,
        transfer_bytes_max: int | None = None,
    ) -> None:
        """``transfer_bytes_max``: the controller's MDTS in bytes (None: no limit)."""
        limits = info.limits
        bounds = [
            (max_value_bytes, f"max_value_bytes {max_value_bytes}"),
            (limits.value_bytes_max, f"the namespace's maximum value length {limits.value_bytes_max} (KV Identify)"),
        ]
        if transfer_bytes_max is not None:
            bounds.append((transfer_bytes_max, f"the controller's MDTS, {transfer_bytes_max} bytes per command"))
        value_bytes_max, self.value_limit = min(bounds)
        """The limit that binds ``max_value_bytes``, in words."""
        super().__init__(name, value_bytes_max)
        self.transfer_bytes_max = transfer_bytes_max
        self.path = path
        self.nsid = nsid
        self.key_bytes_max = min(limits.key_bytes_max, KEY_BYTES_MAX)
        self.keys_max = limits.keys_max
        self._fd = fd
        self._ioctl = ioctl
        self._admin = admin
        self._health = DriveHealth(admin, health_interval_s)
        self._judge = StatusJudge(name)
        self.key_eviction = False

    # -- the device protocol -----------------------------------------------------

    def check_value_size(self, parts: Sequence[Buffer]) -> int:
        """Total length of ``parts``; a value above ``max_value_bytes`` is refused naming the limit
        that binds: the KV command set stores a value in one command, never in pieces."""
        total = sum(memoryview(p).nbytes for p in parts)
        if total > self.max_value_bytes:
            raise ValueError(
                f"{self.name}: a value of {total} bytes is more than one KV Store may carry ({self.value_limit}); "
                "the cache layer fragments larger values"
            )
        return total

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        value = bytearray(total)  # One contiguous host buffer for the controller's DMA.
        at = 0
        for part in parts:
            view = memoryview(part).cast("B")
            value[at : at + view.nbytes] = view
            at += view.nbytes
        status, _ = self._submit(
            kv_command(KvOpcode.STORE, self.nsid, self._key(key), _address(memoryview(value)), total)
        )
        self._judge.judge(status, "store")

    def get(self, key: bytes, into: memoryview) -> int | None:
        """Retrieve into ``into`` directly; DW0 is the value's size even when the buffer is
        shorter (the controller then transfers only the buffer's length)."""
        view = into.cast("B") if into.format != "B" else into
        if self.transfer_bytes_max is not None:
            view = view[: self.transfer_bytes_max]  # A larger host buffer is refused (MDTS) with no answer.
        cmd = kv_command(KvOpcode.RETRIEVE, self.nsid, self._key(key), _address(view), view.nbytes)
        status, size = self._submit(cmd)
        if status != SUCCESS and not self._judge.judge(status, "retrieve"):
            return None
        if size > view.nbytes:
            raise BufferTooSmall(self.name, size, view.nbytes)
        return size

    def size(self, key: bytes) -> int | None:
        # A Retrieve with no host buffer answers the value's size in DW0.
        status, size = self._submit(kv_command(KvOpcode.RETRIEVE, self.nsid, self._key(key)))
        if status != SUCCESS and not self._judge.judge(status, "retrieve"):
            return None
        return size

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        # The command set's Exist names one key; a batch is one command per key.
        flags = []
        for key in keys:
            status, _ = self._submit(kv_command(KvOpcode.EXIST, self.nsid, self._key(key)))
            flags.append(status == SUCCESS or self._judge.judge(status, "exist"))
        return flags

    def delete(self, key: bytes) -> bool:
        status, _ = self._submit(kv_command(KvOpcode.DELETE, self.nsid, self._key(key)))
        return status == SUCCESS or self._judge.judge(status, "delete")

    def scan(self) -> Iterator[tuple[bytes, int]]:
        for key in self._list_keys():
            size = self.size(key)
            if size is not None:  # Deleted since it was listed.
                yield key, size

    def usage(self) -> Usage:
        """Used and total bytes from Identify (NUSE, NSZE); keys counted by listing them."""
        info = identify(self.name, self._fd, self.nsid, self._ioctl)
        return Usage(info.used_bytes, info.size_bytes, sum(1 for _ in self._list_keys()))

    def health(self) -> Health:
        """FAILED when the namespace does not answer Identify; else the SMART log's verdict
        (`DriveHealth`: read at most once per health interval). Without nvme-cli the
        namespace is OK as far as it answers, and the detail says why nothing more is known."""
        try:
            identify(self.name, self._fd, self.nsid, self._ioctl)
        except DeviceError as err:
            return Health(HealthState.FAILED, str(err))
        health = self._health.read()
        if health.state is HealthState.OK and health.detail:
            return Health(HealthState.OK, f"answers KV commands; {health.detail}")
        return health

    # -- card abilities ----------------------------------------------------------

    def card_status(self) -> CardStatus:
        """Raises `DeviceError` naming the nvme-cli command that could not answer."""
        try:
            ctrl, smart, ocp = self._admin.id_ctrl(), self._admin.smart_log(), self._admin.ocp_smart_log()
        except NvmeCliError as err:
            raise DeviceError(self.name, str(err)) from None
        usage = self.usage()
        return CardStatus(
            driver=DRIVER_NAME,
            service="running",
            firmware_version=ctrl.firmware,
            temperature_c=float(smart.temperature_c),
            supercap=supercap_state(smart, ocp),
            flash_spare_percent=float(smart.available_spare_percent),
            flash_wear_percent=float(smart.percent_used),
            capacity_usage=capacity_usage(usage.used_bytes, usage.capacity_bytes),
            used_bytes=usage.used_bytes,
            capacity_bytes=usage.capacity_bytes,
            keys=usage.keys,
            keys_max=self.keys_max,
            key_eviction=self.key_eviction,
            paths=(self.path,),
        )

    def card_events(self, since_seq: int = 0) -> list[CardEventRecord]:
        try:
            return error_events(self._admin.error_log(), since_seq)
        except NvmeCliError as err:
            raise DeviceError(self.name, str(err)) from None

    evicts_on_its_own = False
    """The KV command set refuses a store to a full namespace and never evicts."""

    def set_key_eviction(self, enabled: bool) -> None:
        """Records the setting (shown in `card_status`): the namespace never evicts, so key
        eviction on is the tier's own, least recently used within its capacity budget."""
        self.key_eviction = enabled

    def status_counts(self) -> dict[str, int]:
        """Answers other than success, by status code (misses included)."""
        return self._judge.counts()

    def wipe(self) -> int:
        """Delete every listed key (the KV command set has no format-like wipe); the keys are
        listed whole first, so that deleting does not disturb the List order walked."""
        return sum(self.delete(key) for key in list(self._list_keys()))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- internals ---------------------------------------------------------------

    def _key(self, key: bytes) -> bytes:
        if not 0 < len(key) <= self.key_bytes_max:
            raise ValueError(f"{self.name}: a key of {len(key)} bytes; this namespace takes 1 to {self.key_bytes_max}")
        return bytes(key)

    def _submit(self, cmd: PassthruCmd64) -> tuple[KvStatus, int]:
        """Issue ``cmd``: its decoded status and DW0; a host-side failure raises typed."""
        status = submit(self.name, self._fd, NVME_IOCTL_IO64_CMD, cmd, self._ioctl)
        return KvStatus.decode(status), int(cmd.result) & 0xFFFFFFFF

    def _list_keys(self) -> Iterator[bytes]:
        """Every key, by List commands: the first names the all-zero key (the controller
        answers from the start of its order when that key is absent); each next names the
        last key returned and drops it from the answer. The order is the controller's."""
        room = memoryview(bytearray(min(LIST_BUFFER_BYTES, self.transfer_bytes_max or LIST_BUFFER_BYTES)))
        start, first = bytes(self.key_bytes_max), True
        while True:
            cmd = kv_command(KvOpcode.LIST, self.nsid, start, _address(room), room.nbytes)
            status, _ = self._submit(cmd)
            if status != SUCCESS and not self._judge.judge(status, "list"):
                return
            try:
                keys = parse_key_list(room)
            except ValueError as err:
                raise DeviceError(self.name, f"List answered malformed data: {err}") from None
            if not first and keys and keys[0] == start:
                keys = keys[1:]
            if not keys:
                return
            yield from keys
            start, first = keys[-1], False


def submit(name: str, fd: int, request: int, cmd: PassthruCmd64, ioctl: IoctlFn) -> int:
    """``ioctl(fd, request, cmd)``, its ``OSError`` typed: transient, target gone, or other."""
    try:
        return ioctl(fd, request, cmd)
    except OSError as err:
        code = err.errno or 0
        detail = f"ioctl for opcode {cmd.opcode:#04x} failed: {os.strerror(code)} ({errno.errorcode.get(code, code)})"
        if err.errno in _TRANSIENT_ERRNOS:
            raise DeviceTransient(name, detail) from None
        if err.errno in _GONE_ERRNOS:
            raise TargetUnreachable(name, detail) from None
        raise DeviceError(name, detail) from None


def identify(name: str, fd: int, nsid: int, ioctl: IoctlFn) -> KvNamespaceInfo:
    """The namespace's KV Identify data; a status other than success raises `DeviceError`."""
    data = memoryview(bytearray(IDENTIFY_BYTES))
    status = submit(name, fd, NVME_IOCTL_ADMIN64_CMD, identify_kv_namespace(nsid, _address(data)), ioctl)
    if status != 0:
        decoded = KvStatus.decode(status)
        raise DeviceError(name, f"Identify (CNS 05h, CSI 01h) answered status {decoded.code} ({decoded.meaning})")
    return parse_kv_identify(bytes(data))


def transfer_limit(name: str, fd: int, ioctl: IoctlFn) -> int | None:
    """The controller's MDTS in bytes (None: no limit), from Identify Controller; a status other
    than success raises `DeviceError` (every controller answers it)."""
    data = memoryview(bytearray(IDENTIFY_BYTES))
    status = submit(name, fd, NVME_IOCTL_ADMIN64_CMD, identify_controller(_address(data)), ioctl)
    if status != 0:
        decoded = KvStatus.decode(status)
        raise DeviceError(name, f"Identify Controller (CNS 01h) answered status {decoded.code} ({decoded.meaning})")
    return transfer_bytes_max(bytes(data))


def open_kv_namespace(
    name: str,
    path: str,
    max_value_bytes: int,
    ioctl: IoctlFn = kernel_ioctl,
    admin: NvmeAdmin | None = None,
    health_interval_s: float = HEALTH_INTERVAL_S_DEFAULT,
) -> NvmeKvDevice:
    """Open the KV namespace at ``path`` (``/dev/ngXnY``) for tier ``name``.

    Raises ValueError naming the tier and the device when the path does not exist,
    is not a character device, is not an NVMe device (the kernel refuses the NVMe
    ioctl), or is an NVMe namespace without the Key Value command set. ``admin`` (default:
    nvme-cli on PATH for ``path``) answers health and status; its health is read at most
    once per ``health_interval_s``.
    """
    where = f"tier '{name}': device {path}"
    mode = device_mode(where, path)
    if not stat.S_ISCHR(mode):
        raise ValueError(f"{where} is not a character device; a KV namespace is its generic device /dev/ngXnY")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as err:
        raise ValueError(f"{where} cannot be opened for reading and writing: {err.strerror}") from None
    try:
        try:
            nsid = ioctl(fd, NVME_IOCTL_ID, PassthruCmd64())
        except OSError as err:
            raise ValueError(f"{where} is not an NVMe device (the NVMe ioctl is refused: {err.strerror})") from None
        try:
            info = identify(name, fd, nsid, ioctl)
        except DeviceError as err:
            raise ValueError(f"{where} is an NVMe namespace without the Key Value command set ({err})") from None
        if not info.formats:
            raise ValueError(
                f"{where} is an NVMe namespace without the Key Value command set (Identify reports no KV format)"
            )
        try:
            transfer_max = transfer_limit(name, fd, ioctl)
        except DeviceError as err:
            raise ValueError(f"{where}: its controller does not answer Identify Controller ({err})") from None
        return NvmeKvDevice(
            name,
            path,
            fd,
            nsid,
            info,
            max_value_bytes,
            ioctl,
            admin or NvmeAdmin(path),
            health_interval_s,
            transfer_bytes_max=transfer_max,
        )
    except BaseException:
        os.close(fd)
        raise
