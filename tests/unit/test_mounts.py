"""The mount table as the kernel writes it: mountinfo lines and the pNFS layouts of mountstats."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvharbor.hal.mounts import PNFS_NOT_CONFIGURED, MountTable, MountTableError
from tests.support.mount_samples import MOUNT_NAMES, mount_files


def read_table(tmp_path: Path, points: dict[str, str]) -> MountTable:
    """The table read from files holding the kernel's text, as the tiers read /proc."""
    mountinfo, mountstats = mount_files(points)
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "mountstats").write_text(mountstats)
    return MountTable.read(str(tmp_path / "mountinfo"), str(tmp_path / "mountstats"))


@pytest.fixture
def points(tmp_path: Path) -> dict[str, str]:
    made = {name: tmp_path / "mnt" / name for name in MOUNT_NAMES}
    for path in made.values():
        path.mkdir(parents=True)
    return {name: str(path) for name, path in made.items()}


def test_each_mount_reads_with_its_type_version_and_transport(tmp_path: Path, points: dict[str, str]) -> None:
    mounts = read_table(tmp_path, points)
    seen = {name: mounts.at(path) for name, path in points.items()}
    shapes = {name: (m.fs_type, m.nfs_version, m.super_options.get("proto")) for name, m in seen.items() if m}
    assert shapes == {
        "ext4": ("ext4", (), None),
        "nfs3": ("nfs", (3,), "tcp"),
        "nfs41": ("nfs4", (4, 1), "tcp"),
        "pnfs_rdma": ("nfs4", (4, 1), "rdma"),
        "nfs3_rdma": ("nfs", (3,), "rdma"),
    }
    nfs3 = seen["nfs3"]
    assert nfs3 is not None and nfs3.is_nfs and nfs3.source == "192.168.1.10:/export/kv"
    assert nfs3.options == ("rw", "relatime") and nfs3.super_options["hard"] == ""
    assert seen["ext4"] is not None and not seen["ext4"].is_nfs


def test_pnfs_layouts_come_from_mountstats(tmp_path: Path, points: dict[str, str]) -> None:
    mounts = read_table(tmp_path, points)
    assert mounts.pnfs_layouts == {
        points["nfs41"]: PNFS_NOT_CONFIGURED,
        points["pnfs_rdma"]: "LAYOUT_NFSV4_1_FILES",
    }


def test_a_path_inside_a_mount_or_not_mounted_is_no_mount_point(tmp_path: Path, points: dict[str, str]) -> None:
    mounts = read_table(tmp_path, points)
    inside = Path(points["nfs41"]) / "kvharbor"
    inside.mkdir()
    assert mounts.at(str(inside)) is None
    assert mounts.at(str(tmp_path)) is None
    assert mounts.at("/") is not None  # The real root line of the sample.


def test_a_symlink_to_a_mount_point_resolves_to_it(tmp_path: Path, points: dict[str, str]) -> None:
    mounts = read_table(tmp_path, points)
    link = tmp_path / "cache"
    link.symlink_to(points["nfs3"])
    found = mounts.at(str(link))
    assert found is not None and found.mount_point == points["nfs3"]


def test_escaped_names_are_read_back(tmp_path: Path, points: dict[str, str]) -> None:
    spaced = tmp_path / "my share\\x"
    spaced.mkdir()
    mounts = read_table(tmp_path, {**points, "nfs41": str(spaced)})
    raw = (tmp_path / "mountinfo").read_text()
    assert "my\\040share\\134x" in raw  # As the kernel writes it.
    found = mounts.at(str(spaced))
    assert found is not None and found.fs_type == "nfs4"
    assert mounts.pnfs_layouts[str(spaced)] == PNFS_NOT_CONFIGURED


def test_the_last_mount_stacked_on_a_point_is_the_one_in_use(tmp_path: Path, points: dict[str, str]) -> None:
    mountinfo, _ = mount_files(points)
    over = f"60 44 0:50 / {points['nfs3']} rw,relatime shared:40 - tmpfs tmpfs rw\n"
    (tmp_path / "mountinfo").write_text(mountinfo + over)
    mounts = MountTable.read(str(tmp_path / "mountinfo"), str(tmp_path / "absent"))
    found = mounts.at(points["nfs3"])
    assert found is not None and found.fs_type == "tmpfs"
    assert mounts.pnfs_layouts == {}  # No mountstats: pNFS unknown, nothing else lost.


def test_a_line_not_in_the_kernels_form_is_named(tmp_path: Path) -> None:
    (tmp_path / "mountinfo").write_text("22 1 259:2 / / rw,relatime\n")
    with pytest.raises(MountTableError, match=r"mountinfo line 1 is not a mountinfo line"):
        MountTable.read(str(tmp_path / "mountinfo"))


def test_this_process_mount_table_reads() -> None:
    mounts = MountTable.read()
    root = mounts.at("/")
    assert root is not None and root.mount_point == "/"
