"""The file driver beyond the shared contract: layout, crash safety, error mapping."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache import format
from kvharbor.cache.keys import ChunkKey
from kvharbor.config import FileTierSection
from kvharbor.hal import tempfiles
from kvharbor.hal.base import (
    DeviceCorrupt,
    DeviceError,
    DeviceFull,
    DeviceTransient,
    DeviceUnavailable,
    HealthState,
)
from kvharbor.hal.file import FileDevice, open_file_device

KEY = bytes.fromhex("abcd" + "11" * 14)
OTHER = bytes.fromhex("abce" + "22" * 14)


def open_device(root: Path, **options: Any) -> FileDevice:
    return FileDevice("local", str(root), 1 << 20, **options)


def read(device: FileDevice, key: bytes) -> bytes | None:
    buffer = memoryview(bytearray(1 << 20))
    n = device.get(key, buffer)
    return None if n is None else bytes(buffer[:n])


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + tempfiles.TEMP_SUFFIX))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def temp_name_of(pid: int, stem: str, monkeypatch: pytest.MonkeyPatch, machine: tempfiles.Machine | None = None) -> str:
    """A temp file name as the writer with ``pid`` on ``machine`` (default: this one) would make it."""
    with monkeypatch.context() as patch:
        patch.setattr(os, "getpid", lambda: pid)
        return tempfiles.temp_name(stem, machine or tempfiles.this_machine())


@pytest.mark.parametrize(
    ("levels", "relative"),
    [(0, KEY.hex()), (1, f"ab/{KEY.hex()}"), (2, f"ab/cd/{KEY.hex()}"), (3, f"ab/cd/11/{KEY.hex()}")],
)
def test_a_value_is_one_file_under_fanout_directories(tmp_path: Path, levels: int, relative: str) -> None:
    device = open_device(tmp_path, fanout_levels=levels)
    device.put(KEY, [b"head", b"payload"])
    assert (tmp_path / relative).read_bytes() == b"headpayload"
    assert dict(device.scan()) == {KEY: 11}


def test_overwrites_leave_no_temp_files(tmp_path: Path) -> None:
    device = open_device(tmp_path)
    for size in (10, 1000, 3):
        device.put(KEY, [b"x" * size])
    assert read(device, KEY) == b"xxx"
    assert temp_files(tmp_path) == []


def test_scan_lists_only_final_names_in_their_own_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = open_device(tmp_path)
    device.put(KEY, [b"value"])
    leaf = tmp_path / "ab" / "cd"
    (leaf / temp_name_of(os.getpid(), OTHER.hex(), monkeypatch)).write_bytes(b"in flight")
    (tmp_path / "manifest.sqlite").write_bytes(b"not a value")
    (tmp_path / "ab" / "ff").mkdir()
    (tmp_path / "ab" / "ff" / OTHER.hex()).write_bytes(b"under the wrong prefix")
    (tmp_path / "zz").mkdir()
    (leaf / ("ab" * 16)).mkdir()  # A directory with a key's name is no value either.
    assert dict(device.scan()) == {KEY: 5}


def test_open_removes_temp_files_of_dead_writers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = open_device(tmp_path)
    device.put(KEY, [b"committed"])
    leaf = tmp_path / "ab" / "cd"
    gone = dead_pid()
    crashed = leaf / temp_name_of(gone, KEY.hex(), monkeypatch)
    crashed.write_bytes(b"half-written new value")
    live = leaf / temp_name_of(os.getpid(), KEY.hex(), monkeypatch)
    live.write_bytes(b"a live writer's work")
    elsewhere = tempfiles.Machine("other-host.example", 1)
    remote = leaf / temp_name_of(gone, KEY.hex(), monkeypatch, elsewhere)  # That pid is not ours to judge.
    remote.write_bytes(b"another host's work")
    stray_old = leaf / "unknown.tmp"
    stray_old.write_bytes(b"")
    hours_ago = time.time() - 2 * 3600
    os.utime(stray_old, (hours_ago, hours_ago))
    stray_new = leaf / "recent.tmp"
    stray_new.write_bytes(b"")

    with caplog.at_level(logging.INFO, logger="kvharbor.hal.file"):
        reopened = open_device(tmp_path)

    assert not crashed.exists() and not stray_old.exists()
    assert live.exists() and remote.exists() and stray_new.exists()  # Their writers may live.
    assert read(reopened, KEY) == b"committed"
    assert [r.getMessage() for r in caplog.records] == [
        f"kvharbor: tier 'local': removed 2 temp files left by interrupted writes in {tmp_path}"
    ]


def test_a_failed_write_keeps_the_old_value_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = open_device(tmp_path)
    device.put(KEY, [b"old"])

    def no_space(fd: int, buffers: list[memoryview]) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", no_space)
    with pytest.raises(DeviceFull, match="No space left on device"):
        device.put(KEY, [b"new value"])
    assert read(device, KEY) == b"old"
    assert temp_files(tmp_path) == []


def test_a_failed_rename_keeps_the_old_value_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = open_device(tmp_path)
    device.put(KEY, [b"old"])

    def broken(src: str, dst: str) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "rename", broken)
    with pytest.raises(DeviceUnavailable):
        device.put(KEY, [b"new"])
    monkeypatch.undo()
    assert read(device, KEY) == b"old"
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (errno.ENOSPC, DeviceFull),
        (errno.EDQUOT, DeviceFull),
        (errno.EIO, DeviceUnavailable),
        (errno.ENOTCONN, DeviceUnavailable),
        (errno.ESTALE, DeviceUnavailable),
        (errno.EROFS, DeviceUnavailable),
        (errno.EACCES, DeviceUnavailable),
        (errno.EINTR, DeviceTransient),
        (errno.EAGAIN, DeviceTransient),
        (errno.ETIMEDOUT, DeviceTransient),
    ],
)
def test_os_errors_become_typed_device_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, error: type[DeviceError]
) -> None:
    device = open_device(tmp_path)
    device.put(KEY, [b"value"])

    def fail(*args: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "writev", fail)
    monkeypatch.setattr(os, "preadv", fail)
    with pytest.raises(error) as on_put:
        device.put(OTHER, [b"value"])
    with pytest.raises(error) as on_get:
        device.get(KEY, memoryview(bytearray(16)))
    assert on_put.value.device == on_get.value.device == "local"


def test_short_writes_and_reads_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = open_device(tmp_path)
    real_writev, real_preadv = os.writev, os.preadv

    def writev_7(fd: int, buffers: list[memoryview]) -> int:
        return real_writev(fd, [memoryview(buffers[0])[:7]])

    def preadv_5(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [memoryview(buffers[0])[:5]], offset)

    monkeypatch.setattr(os, "writev", writev_7)
    monkeypatch.setattr(os, "preadv", preadv_5)
    value = [bytes(range(50)), b"", bytes(range(50, 123))]
    device.put(KEY, value)
    assert read(device, KEY) == b"".join(value)
    head = bytearray(12)
    assert device.peek(KEY, memoryview(head)) == 12
    assert bytes(head) == bytes(range(12))
    slices: list[bytes] = []
    assert device.get_streamed(KEY, memoryview(bytearray(200)), lambda piece: slices.append(bytes(piece)), 64) == 123
    assert b"".join(slices) == b"".join(value) and max(map(len, slices)) <= 64


@pytest.mark.parametrize("streamed", [False, True])
def test_a_file_that_shrinks_while_read_is_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    device = open_device(tmp_path)
    device.put(KEY, [b"x" * 1000])
    path = tmp_path / "ab" / "cd" / KEY.hex()
    real_preadv = os.preadv

    def truncate_then_read(fd: int, buffers: list[memoryview], offset: int) -> int:
        os.truncate(path, 100)  # Someone outside kvharbor cuts the file short.
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", truncate_then_read)
    into = memoryview(bytearray(1000))
    with pytest.raises(DeviceCorrupt, match="shrank from 1000 to 100 bytes"):
        device.get_streamed(KEY, into, lambda _: None, slice_bytes=64) if streamed else device.get(KEY, into)


def test_a_truncated_object_decodes_as_corrupt(tmp_path: Path) -> None:
    device = open_device(tmp_path)
    fingerprint = b"\x07" * 16
    (part,) = format.encode(KEY, fingerprint, b"kv bytes " * 100)
    device.put(part.device_key, [part.header, part.payload])
    os.truncate(tmp_path / "ab" / "cd" / KEY.hex(), part.nbytes - 1)  # A torn copy.

    def read_part(device_key: ChunkKey) -> memoryview | None:
        size = device.size(device_key)
        if size is None:
            return None
        buffer = memoryview(bytearray(size))
        got = device.get(device_key, buffer)
        return None if got is None else buffer[:got]

    with pytest.raises(format.CorruptObject, match="header says"):
        format.decode(KEY, fingerprint, read_part)


def test_a_path_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    path.write_bytes(b"")
    with pytest.raises(DeviceUnavailable, match=f"local: path {path} is not a directory"):
        open_device(path)
    with pytest.raises(DeviceUnavailable, match=rf"path {path}/sub cannot be created \(Not a directory\)"):
        open_device(path / "sub")


def test_a_path_that_refuses_new_files_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def deny_creates(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", deny_creates)
    with pytest.raises(DeviceUnavailable, match=rf"local: path {tmp_path} is not writable \(Permission denied\)"):
        open_device(tmp_path)


def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        # Root writes through mode bits; a read-only mount stops it as it stops everyone.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], check=True)
        release = ["umount", str(target)]
    else:
        target.chmod(0o555)
        release = ["chmod", "755", str(target)]
    try:
        with pytest.raises(DeviceUnavailable, match=r"is not writable \((Permission denied|Read-only file system)\)"):
            open_device(target)
    finally:
        subprocess.run(release, check=True)


def test_a_vanished_root_is_unavailable_not_a_miss(tmp_path: Path) -> None:
    root = tmp_path / "mount"
    device = open_device(root)
    device.put(KEY, [b"value"])
    (root / "ab" / "cd" / KEY.hex()).unlink()
    for directory in (root / "ab" / "cd", root / "ab", root):
        directory.rmdir()
    gone = "is gone"
    calls: list[Callable[[], object]] = [
        lambda: device.get(KEY, memoryview(bytearray(16))),
        lambda: device.peek(KEY, memoryview(bytearray(16))),
        lambda: device.size(KEY),
        lambda: device.exists([KEY]),
        lambda: device.delete(KEY),
        lambda: list(device.scan()),
        lambda: device.put(KEY, [b"value"]),
    ]
    for call in calls:
        with pytest.raises(DeviceUnavailable, match=gone):
            call()
    assert not root.exists()  # A put never recreates the root (an empty mount point).
    assert device.health().state is HealthState.FAILED


def test_fsync_flushes_the_file_and_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    durable, fast = open_device(tmp_path / "durable"), open_device(tmp_path / "fast", fsync=False)
    durable.put(KEY, [b"first"])  # Creates the fan-out directories.
    fast.put(KEY, [b"first"])
    monkeypatch.setattr(os, "fsync", record)
    durable.put(KEY, [b"second"])
    assert synced == [False, True]  # The file, then the directory holding the rename.
    fast.put(KEY, [b"second"])
    assert synced == [False, True]


def test_a_put_that_makes_fanout_directories_flushes_each_entry_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    root = tmp_path / "durable"
    device = open_device(root)
    monkeypatch.setattr(os, "fsync", record)
    device.put(KEY, [b"first"])
    # The file; the directory holding the rename; then the directories that
    # gained a fan-out entry, deepest first. All before put returns.
    temp, *directories = synced
    assert temp.startswith(f"{root}/ab/cd/{KEY.hex()}.") and temp.endswith(tempfiles.TEMP_SUFFIX)
    assert directories == [str(root / "ab" / "cd"), str(root / "ab"), str(root)]
    synced.clear()
    device.put(OTHER, [b"second"])  # ab/ exists: only ab/ce is new.
    assert synced[1:] == [str(root / "ab" / "ce"), str(root / "ab")]


def test_health_degrades_when_the_filesystem_is_nearly_full(tmp_path: Path) -> None:
    # Thresholds on either side of the share this host's disk has free, whatever it is
    # (a CI machine's disk may itself be nearly full).
    vfs = os.statvfs(tmp_path)
    free = vfs.f_bavail / vfs.f_blocks
    assert 0 < free < 0.999, free
    assert open_device(tmp_path, free_ratio_degraded=free / 2).health().state is HealthState.OK
    health = open_device(tmp_path, free_ratio_degraded=(1 + free) / 2).health()
    assert health.state is HealthState.DEGRADED
    assert health.detail == f"{tmp_path}: {free:.1%} of the filesystem free"


def test_a_file_tiers_free_space_threshold_is_its_setting(tmp_path: Path) -> None:
    section = FileTierSection(name="local", path=str(tmp_path), capacity_gb=1, degraded_below_free_pct=99.9)
    assert open_file_device(section, 4096).free_ratio_degraded == pytest.approx(0.999)
    with pytest.raises(ValueError, match="degraded_below_free_pct"):
        FileTierSection(name="local", path=str(tmp_path), capacity_gb=1, degraded_below_free_pct=100)


def test_open_file_device_follows_its_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    section = FileTierSection(name="local", path="~/kv", capacity_gb=1, fanout_levels=0, fsync=False)
    device = open_file_device(section, 4096)
    assert (device.name, device.state_dir, device.max_value_bytes) == ("local", str(tmp_path / "kv"), 4096)
    device.put(KEY, [b"v"])
    assert (tmp_path / "kv" / KEY.hex()).read_bytes() == b"v"
    assert not device.fsync
