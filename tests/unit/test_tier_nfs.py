"""The nfs and ontap tiers: opened only on the NFS mount their config names, then file tiers.

The mount table is the kernel's text (tests/support/mount_samples.py) in files the
tiers read in place of /proc/self/mountinfo and /proc/self/mountstats; the mount
points are real directories, so a tier that opens stores real files there. One test
reads this process's real mount table, where no NFS is mounted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache.assembly import open_store
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.store import TieredStore
from kvharbor.config import validate_config
from kvharbor.hal import mounts
from tests.support.mount_samples import MOUNT_NAMES, mount_files

FINGERPRINT = LayoutFingerprint("m", 16).digest()
PNFS_LACKS = "protocol=pnfs_rdma requested but mount"


@pytest.fixture
def points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A directory per sample mount, and the sample mount table naming them, read in place of /proc's."""
    made = {name: tmp_path / "mnt" / name for name in MOUNT_NAMES}
    for path in made.values():
        path.mkdir(parents=True)
    mountinfo, mountstats = mount_files({name: str(path) for name, path in made.items()})
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "mountstats").write_text(mountstats)
    monkeypatch.setattr(mounts, "MOUNTINFO_PATH", str(tmp_path / "mountinfo"))
    monkeypatch.setattr(mounts, "MOUNTSTATS_PATH", str(tmp_path / "mountstats"))
    return made


def store_of(tmp_path: Path, *tiers: dict[str, Any]) -> TieredStore:
    storage = {"tiers": [{"capacity_gb": 0.01, "fsync": False, **tier} for tier in tiers]}
    return open_store(validate_config({"storage": {**storage, "fallback_path": str(tmp_path / "fallback")}}))


def stores_and_reads(store: TieredStore) -> bool:
    key, value = os.urandom(16), os.urandom(10_000)
    got = store.put(key, FINGERPRINT, value) and store.get(key, FINGERPRINT)
    return got is not None and bytes(got) == value


@pytest.mark.parametrize("mount", ["nfs3", "nfs41", "pnfs_rdma"])
def test_an_nfs_tier_on_an_nfs_mount_point_is_a_file_tier_there(
    tmp_path: Path, points: dict[str, Path], mount: str
) -> None:
    store = store_of(tmp_path, {"name": "shared", "type": "nfs", "path": str(points[mount])})
    try:
        assert [(t.name, t.device_type, t.fallback) for t in store.tiers] == [("shared", "nfs", False)]
        assert stores_and_reads(store)
        assert list(points[mount].glob("*/*/*")), "the value is a file on the mount"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("ext4", "path {path} is a ext4 mount, not NFS"),
        ("inside", "path {path} is not a mount point (not in {mountinfo}); mount the export before starting"),
        ("unmounted", "path {path} is not a mount point"),
    ],
)
def test_an_nfs_tier_anywhere_else_is_skipped_and_writes_nothing(
    tmp_path: Path, points: dict[str, Path], where: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = {"ext4": points["ext4"], "inside": points["nfs41"] / "kv", "unmounted": tmp_path / "mnt" / "gone"}[where]
    path.mkdir(exist_ok=True)
    with caplog.at_level(logging.WARNING):
        store = store_of(tmp_path, {"name": "shared", "type": "nfs", "path": str(path)})
    try:
        detail = said.format(path=path, mountinfo=tmp_path / "mountinfo")
        assert f"tier shared unavailable: nfs tier 'shared': {detail}" in caplog.text
        assert "shared" in store.skipped and [t.name for t in store.tiers] == ["fallback"]
        assert list(path.iterdir()) == [], "nothing is written where the export is not mounted"
    finally:
        store.close()


def test_on_this_host_no_path_is_an_nfs_mount(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real code path: /proc/self/mountinfo of this process (which has no NFS client)."""
    (tmp_path / "nfs").mkdir()
    with caplog.at_level(logging.WARNING):
        store = store_of(tmp_path, {"name": "shared", "type": "nfs", "path": str(tmp_path / "nfs")})
    try:
        said = f"path {tmp_path / 'nfs'} is not a mount point (not in /proc/self/mountinfo)"
        assert f"tier shared unavailable: nfs tier 'shared': {said}" in caplog.text
    finally:
        store.close()


def test_an_ontap_tier_keeps_its_files_in_path_on_the_mount(tmp_path: Path, points: dict[str, Path]) -> None:
    mount = points["pnfs_rdma"]
    ontap = {"name": "filer", "type": "ontap", "mount": str(mount), "path": str(mount / "kv" / "cache")}
    store = store_of(tmp_path, {**ontap, "protocol": "pnfs_rdma", "strict_protocol": True})
    try:
        assert [(t.name, t.device_type) for t in store.tiers] == [("filer", "ontap")]
        assert stores_and_reads(store)
        assert list((mount / "kv" / "cache").glob("*/*/*"))
    finally:
        store.close()


def test_pnfs_rdma_on_a_pnfs_rdma_mount_says_nothing(
    tmp_path: Path, points: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        store = store_of(
            tmp_path, {"name": "filer", "type": "ontap", "mount": str(points["pnfs_rdma"]), "protocol": "pnfs_rdma"}
        )
    store.close()
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("mount", "lacks"),
    [
        ("nfs41", ["pnfs=not configured", "proto=tcp, not rdma"]),
        ("nfs3_rdma", ["vers=3, pNFS needs 4.1 or later", "no pNFS layout in /proc/self/mountstats"]),
        ("nfs3", ["vers=3, pNFS needs 4.1 or later", "proto=tcp, not rdma"]),
    ],
)
def test_pnfs_rdma_on_a_plain_nfs_mount_is_said_once_and_served_as_nfs(
    tmp_path: Path, points: dict[str, Path], caplog: pytest.LogCaptureFixture, mount: str, lacks: list[str]
) -> None:
    with caplog.at_level(logging.WARNING):
        store = store_of(
            tmp_path, {"name": "filer", "type": "ontap", "mount": str(points[mount]), "protocol": "pnfs_rdma"}
        )
    try:
        said = [r.getMessage() for r in caplog.records if PNFS_LACKS in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].startswith(f"kvharbor: ontap tier 'filer': {PNFS_LACKS} {points[mount]} is not pNFS-capable (")
        assert all(lack in said[0] for lack in lacks) and "continuing with plain NFS file I/O" in said[0]
        assert [t.name for t in store.tiers] == ["filer"] and stores_and_reads(store)
    finally:
        store.close()


def test_strict_protocol_makes_a_plain_nfs_mount_unavailable(
    tmp_path: Path, points: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ontap = {"name": "filer", "type": "ontap", "mount": str(points["nfs41"]), "protocol": "pnfs_rdma"}
    with caplog.at_level(logging.WARNING):
        store = store_of(tmp_path, {**ontap, "strict_protocol": True})
    try:
        assert "tier filer unavailable: ontap tier 'filer': protocol=pnfs_rdma requested but mount" in caplog.text
        assert "strict_protocol: true refuses plain NFS" in caplog.text
        assert [t.name for t in store.tiers] == ["fallback"] and list(points["nfs41"].iterdir()) == []
    finally:
        store.close()


def test_an_ontap_mount_that_is_not_nfs_is_named_by_its_key(
    tmp_path: Path, points: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        store_of(tmp_path, {"name": "filer", "type": "ontap", "mount": str(points["ext4"])}).close()
    assert f"tier filer unavailable: ontap tier 'filer': mount {points['ext4']} is a ext4 mount, not NFS" in caplog.text
