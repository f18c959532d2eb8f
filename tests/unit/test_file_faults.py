"""The file tier's driver on a filesystem that fails: read-only, permission denied, full, vanishing.

Each fault is the fake filesystem's own answer (pyfakefs, tests/support/fakefs.py):
its permission checks, a mount point of a fixed size, EROFS on a mount made
read-only, directories removed by an outsider. What must hold: a fault is a typed
device error naming the path, never a traceback of another kind; no partial object
is ever visible under a final name; what was stored before stays readable.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from kvharbor.hal.base import DeviceFull, DeviceUnavailable
from kvharbor.hal.file import FileDevice
from kvharbor.hal.tempfiles import TEMP_SUFFIX
from tests.support.fakefs import FakeDisk, fake_disk

MOUNT = "/mnt/cache"
ROOT = f"{MOUNT}/kv"
KEY, OTHER = bytes(range(16)), bytes(range(16, 32))
VALUE_MAX = 1 << 20


@pytest.fixture
def disk() -> Iterator[FakeDisk]:
    with fake_disk() as made:
        made.fs.add_mount_point(MOUNT, total_size=256 * 1024)
        yield made


def read(device: FileDevice, key: bytes) -> bytes | None:
    buffer = memoryview(bytearray(VALUE_MAX))
    got = device.get(key, buffer)
    return None if got is None else bytes(buffer[:got])


def names_under(root: str) -> list[str]:
    return sorted(name for _, _, files in os.walk(root) for name in files)


def temp_files(root: str) -> list[str]:
    return [name for name in names_under(root) if name.endswith(TEMP_SUFFIX)]


def test_a_read_only_mount_refuses_the_tier_when_it_opens(disk: FakeDisk) -> None:
    os.makedirs(ROOT)
    disk.mount_read_only(MOUNT)
    with pytest.raises(DeviceUnavailable, match=f"path {ROOT} is not writable \\(Read-only file system\\)"):
        FileDevice("t", ROOT, VALUE_MAX)


def test_a_mount_gone_read_only_refuses_writes_and_still_serves_reads(disk: FakeDisk) -> None:
    device = FileDevice("t", ROOT, VALUE_MAX)
    device.put(KEY, [b"old" * 100])
    disk.mount_read_only(MOUNT)
    with pytest.raises(DeviceUnavailable, match="Read-only file system"):
        device.put(OTHER, [b"new" * 100])
    with pytest.raises(DeviceUnavailable, match="Read-only file system"):
        device.put(KEY, [b"new" * 100])
    assert read(device, KEY) == b"old" * 100 and read(device, OTHER) is None
    assert [key for key, _ in device.scan()] == [KEY] and temp_files(ROOT) == []


def test_permission_denied_at_open_names_the_path(disk: FakeDisk) -> None:
    disk.fs.create_dir(ROOT, perm_bits=0o555)
    with pytest.raises(DeviceUnavailable, match=f"path {ROOT} is not writable \\(Permission denied\\)"):
        FileDevice("t", ROOT, VALUE_MAX)


def test_a_root_that_cannot_be_created_names_the_path(disk: FakeDisk) -> None:
    os.chmod(MOUNT, 0o555)
    with pytest.raises(DeviceUnavailable, match=f"path {ROOT} cannot be created \\(Permission denied\\)"):
        FileDevice("t", ROOT, VALUE_MAX)


def test_permission_denied_on_one_directory_or_file_is_a_fault_not_a_miss(disk: FakeDisk) -> None:
    device = FileDevice("t", ROOT, VALUE_MAX)
    device.put(KEY, [b"v" * 100])
    device.put(OTHER, [b"w" * 100])
    leaf = os.path.dirname(device._path(KEY))
    os.chmod(leaf, 0o555)  # No new entries here: a put under this leaf is refused.
    with pytest.raises(DeviceUnavailable, match=f"put {device._path(KEY)}: Permission denied"):
        device.put(KEY, [b"x" * 100])
    assert read(device, KEY) == b"v" * 100  # The old value, whole.
    os.chmod(device._path(OTHER), 0o000)
    with pytest.raises(DeviceUnavailable, match=f"get {device._path(OTHER)}: Permission denied"):
        read(device, OTHER)
    assert temp_files(ROOT) == []


def test_enospc_in_the_middle_of_a_write_leaves_no_partial_object(disk: FakeDisk) -> None:
    device = FileDevice("t", ROOT, VALUE_MAX)
    device.put(KEY, [b"o" * 10_000])
    used = shutil.disk_usage(MOUNT).used
    # The first part fits, the second does not: the disk fills in the middle of the value.
    with pytest.raises(DeviceFull, match=f"put {device._path(OTHER)}: No space left on device"):
        device.put(OTHER, [b"a" * 200_000, b"b" * 100_000])
    with pytest.raises(DeviceFull):
        device.put(KEY, [b"n" * 200_000, b"m" * 100_000])  # An overwrite that does not fit.
    assert device.exists([KEY, OTHER]) == [True, False]
    assert read(device, KEY) == b"o" * 10_000 and read(device, OTHER) is None
    assert [key for key, _ in device.scan()] == [KEY] and temp_files(ROOT) == []
    assert shutil.disk_usage(MOUNT).used == used, "the partial temp file's space is given back"
    device.put(OTHER, [b"s" * 100_000])  # What fits is stored.
    assert read(device, OTHER) == b"s" * 100_000


def test_a_missing_root_is_made_at_open_and_fanout_directories_on_use(disk: FakeDisk) -> None:
    device = FileDevice("t", ROOT, VALUE_MAX)
    assert os.listdir(ROOT) == []
    device.put(KEY, [b"v"])
    os.remove(device._path(KEY))
    os.rmdir(os.path.dirname(device._path(KEY)))  # An outsider removes a fan-out directory.
    device.put(KEY, [b"again"])
    assert read(device, KEY) == b"again"


def test_a_root_removed_after_open_is_unavailable_and_not_made_again(disk: FakeDisk) -> None:
    device = FileDevice("t", ROOT, VALUE_MAX)
    device.put(KEY, [b"v"])
    disk.fs.remove_object(ROOT)  # Unmounted or deleted under the running tier.
    with pytest.raises(DeviceUnavailable, match=f"path {ROOT} is gone"):
        device.put(OTHER, [b"w"])
    with pytest.raises(DeviceUnavailable, match=f"path {ROOT} is gone"):
        read(device, KEY)
    with pytest.raises(DeviceUnavailable, match=f"path {ROOT} is gone"):
        device.exists([KEY])
    assert not os.path.exists(ROOT), "a vanished root is never recreated: it would be the wrong disk"
