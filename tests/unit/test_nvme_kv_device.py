"""`NvmeKvDevice` end to end above the ioctl: the real driver, opened on a real character
device, answered by a KV controller stand-in (the hardware is not here).

Bad input is tested on real paths with the real ioctl: a path that does not exist, a
regular file, and /dev/null (a character device that refuses the NVMe ioctl).
"""

from __future__ import annotations

import errno
import logging
import struct
from pathlib import Path

import pytest

from kvharbor.hal.base import BufferTooSmall, DeviceError, DeviceFull, DeviceTransient, HealthState, TargetUnreachable
from kvharbor.hal.kv_status import CAPACITY_EXCEEDED, HOST_PATHING_ERROR, INVALID_VALUE_SIZE, KvStatus
from kvharbor.hal.nvme import kv_device
from kvharbor.hal.nvme.kv_device import NvmeKvDevice, open_kv_namespace
from tests.support.nvme_kv_standin import KvNamespaceStandIn

CHAR_DEVICE = "/dev/null"
"""A character device every machine has; the stand-in answers the NVMe ioctls on it."""


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def opened(card: KvNamespaceStandIn, max_value_bytes: int = 1 << 20) -> NvmeKvDevice:
    return open_kv_namespace("card", CHAR_DEVICE, max_value_bytes, card)


def test_put_get_size_exists_delete_scan() -> None:
    card = KvNamespaceStandIn()
    device = opened(card)
    device.put(key(1), [b"head", memoryview(b"-payload")])
    device.put(key(2), [b"x" * 1000])
    into = memoryview(bytearray(2000))
    assert device.get(key(1), into) == 12 and bytes(into[:12]) == b"head-payload"
    assert device.size(key(2)) == 1000
    assert device.exists([key(1), key(3), key(2)]) == [True, False, True]
    assert sorted(device.scan()) == [(key(1), 12), (key(2), 1000)]
    assert device.delete(key(1)) is True and device.delete(key(1)) is False
    assert device.get(key(1), into) is None and device.size(key(1)) is None
    usage = device.usage()
    assert (usage.used_bytes, usage.capacity_bytes, usage.keys) == (1000, card.capacity_bytes, 1)
    assert device.health().state is HealthState.OK
    # Misses are counted by code (1/87h), never logged per key.
    assert device.status_counts() == {"1/87h": 4}
    device.close()


def test_values_are_capped_at_the_namespaces_maximum_value_size() -> None:
    device = opened(KvNamespaceStandIn(value_bytes_max=4096), max_value_bytes=1 << 20)
    assert device.max_value_bytes == 4096  # The cache fragments to it.
    with pytest.raises(ValueError, match=r"4097 bytes .* maximum value length 4096 \(KV Identify\)"):
        device.put(key(1), [bytes(4097)])
    assert opened(KvNamespaceStandIn(value_bytes_max=1 << 20), max_value_bytes=8192).max_value_bytes == 8192


def test_values_are_capped_at_what_one_command_may_transfer_mdts() -> None:
    """A Store carries its whole value in one command (no offset, no append), so a value above
    MDTS is refused naming it; a Retrieve's host buffer is never larger than MDTS either (the
    stand-in, like Linux, fails a larger transfer with EINVAL)."""
    card = KvNamespaceStandIn(value_bytes_max=1 << 20, mdts=2)  # 4 pages of 4 KiB.
    device = opened(card)
    assert device.max_value_bytes == 16384
    with pytest.raises(ValueError, match=r"16385 bytes .*the controller's MDTS, 16384 bytes per command"):
        device.put(key(1), [bytes(16385)])
    device.put(key(1), [b"m" * 16384])
    into = memoryview(bytearray(1 << 20))
    assert device.get(key(1), into) == 16384 and bytes(into[:16384]) == b"m" * 16384
    assert list(device.scan()) == [(key(1), 16384)]  # List's buffer too.
    assert opened(KvNamespaceStandIn(mdts=0)).max_value_bytes == KvNamespaceStandIn().value_bytes_max, "0: no limit"


def test_a_short_buffer_is_buffer_too_small_with_the_size_needed() -> None:
    device = opened(KvNamespaceStandIn())
    device.put(key(1), [bytes(300)])
    with pytest.raises(BufferTooSmall) as raised:
        device.get(key(1), memoryview(bytearray(100)))
    assert raised.value.needed == 300


def test_scan_pages_through_list_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_device, "LIST_BUFFER_BYTES", 4 + 3 * 20)  # Three keys per List.
    card = KvNamespaceStandIn()
    device = opened(card)
    for n in range(10):
        device.put(key(n), [bytes([n]) * (n + 1)])
    before = len(card.commands)  # Identify at open is admin opcode 06h too.
    assert sorted(device.scan()) == [(key(n), n + 1) for n in range(10)]
    lists = [c for c in card.commands[before:] if c[0] == 0x06]
    # Pages 0-2, 2-4, 4-6, 6-8, 8-9, then 9 alone (nothing new: done); each page after the first repeats its start.
    assert len(lists) == 6


def test_card_full_is_device_full_and_says_nothing_per_write(caplog: pytest.LogCaptureFixture) -> None:
    device = opened(KvNamespaceStandIn(capacity_bytes=1000))
    device.put(key(1), [bytes(900)])
    with (
        caplog.at_level(logging.INFO, logger="kvharbor"),
        pytest.raises(DeviceFull, match=r"store answered status 1/81h"),
    ):
        device.put(key(2), [bytes(200)])
    assert device.status_counts() == {CAPACITY_EXCEEDED.code: 1}


def test_other_statuses_are_said_once_per_code_counted_and_typed(caplog: pytest.LogCaptureFixture) -> None:
    card = KvNamespaceStandIn()
    device = opened(card)
    unknown = KvStatus(0x2, 0x99)
    card.script.extend([INVALID_VALUE_SIZE, INVALID_VALUE_SIZE, unknown, HOST_PATHING_ERROR])
    with caplog.at_level(logging.WARNING, logger="kvharbor"):
        for _ in range(2):
            with pytest.raises(DeviceError, match=r"invalid value size"):
                device.put(key(1), [b"v"])
        with pytest.raises(DeviceError, match=r"retrieve answered status 2/99h \(unknown status\)"):
            device.get(key(1), memoryview(bytearray(8)))
        with pytest.raises(TargetUnreachable):
            device.exists([key(1)])
    said = [r.getMessage() for r in caplog.records]
    assert sum("1/85h" in line for line in said) == 1 and sum("2/99h" in line for line in said) == 1
    assert device.status_counts() == {"1/85h": 2, "2/99h": 1, "3/70h": 1}


@pytest.mark.parametrize(
    ("failure", "raised"),
    [
        (errno.EINTR, DeviceTransient),
        (errno.EAGAIN, DeviceTransient),
        (errno.ENODEV, TargetUnreachable),
        (errno.EPERM, DeviceError),
    ],
)
def test_host_side_ioctl_failures_are_typed(failure: int, raised: type[DeviceError]) -> None:
    card = KvNamespaceStandIn()
    device = opened(card)
    card.script.append(failure)
    with pytest.raises(raised, match=errno.errorcode[failure]):
        device.delete(key(1))
    card.script.append(errno.ENODEV)
    assert device.health().state is HealthState.OK  # Health asks Identify (admin), which still answers.


def test_a_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"tier 'card': device {tmp_path}/ng9n1 does not exist"):
        open_kv_namespace("card", str(tmp_path / "ng9n1"), 4096)


def test_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(4096))
    with pytest.raises(ValueError, match=rf"device {path} is not a character device; a KV namespace is .*/dev/ngXnY"):
        open_kv_namespace("card", str(path), 4096)


def test_a_character_device_that_is_not_nvme() -> None:
    # The real kernel ioctl: /dev/null refuses NVME_IOCTL_ID.
    with pytest.raises(ValueError, match=r"device /dev/null is not an NVMe device \(the NVMe ioctl is refused"):
        open_kv_namespace("card", CHAR_DEVICE, 4096)


def test_an_nvme_namespace_without_the_kv_command_set() -> None:
    with pytest.raises(ValueError, match=r"device /dev/null is an NVMe namespace without the Key Value command set"):
        opened(KvNamespaceStandIn(kv=False))


def test_identify_refused_is_no_kv_command_set() -> None:
    class RefusesIdentify(KvNamespaceStandIn):
        def _identify(self, cmd: object) -> int:
            return 0x4002  # DNR | Invalid Field in Command: CSI 01h unknown to this controller.

    with pytest.raises(ValueError, match=r"without the Key Value command set \(.*status 0/02h"):
        opened(RefusesIdentify())


def test_store_sends_the_value_bytes_and_its_size() -> None:
    card = KvNamespaceStandIn()
    device = opened(card)
    device.put(key(5), [b"abc", b"defg"])
    store = card.commands[-1]
    assert store[0] == 0x01 and struct.unpack_from("<II", store, 36) == (7, 7)  # data_len, CDW10
    assert card.values[key(5)] == b"abcdefg"
