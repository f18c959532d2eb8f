"""Admin and health through nvme-cli: every release's JSON shape, and nvme-cli that is
missing, fails, or prints something unexpected.

A real subprocess runs a stand-in ``nvme`` (a shell script: there is no NVMe device
here) that records its arguments and prints a fixture written from the field names
of nvme-cli's source (each fixture's first line names the function and release).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvharbor.hal.nvme.cli import NvmeCli, NvmeCliError
from kvharbor.hal.nvme.health import NvmeAdmin

FIXTURES = Path(__file__).parent / "fixtures" / "nvme_cli"
DEVICE = "/dev/ng0n1"


def fake_nvme(tmp_path: Path, body: str) -> tuple[NvmeCli, Path]:
    """An ``nvme`` executable running ``body`` after recording its arguments in ``args``."""
    script, args = tmp_path / "nvme", tmp_path / "args"
    script.write_text(f'#!/bin/sh\necho "$@" > {args}\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return NvmeCli(str(script), timeout_s=30), args


def printing(tmp_path: Path, fixture: str) -> tuple[NvmeAdmin, Path]:
    cli, args = fake_nvme(tmp_path, f"grep -v '^//' {FIXTURES / fixture}")
    return NvmeAdmin(DEVICE, cli), args


@pytest.mark.parametrize(
    ("fixture", "warning", "temperature_c", "supercap_failed"),
    [
        ("smart_log_v2.3.jsonc", 16, 45, True),
        ("smart_log_v2.7.jsonc", 0, 40, False),
        ("smart_log_v2.12.jsonc", 18, 57, True),
    ],
)
def test_smart_log_of_every_release(
    tmp_path: Path, fixture: str, warning: int, temperature_c: int, supercap_failed: bool
) -> None:
    admin, args = printing(tmp_path, fixture)
    smart = admin.smart_log()
    assert args.read_text().split() == ["smart-log", DEVICE, "-o", "json"]
    assert (smart.critical_warning, smart.temperature_c, smart.supercap_failed) == (
        warning,
        temperature_c,
        supercap_failed,
    )
    assert smart.spare_threshold_percent == 10 and 0 < smart.available_spare_percent <= 100


def test_list_flat_and_verbose(tmp_path: Path) -> None:
    (old,) = printing(tmp_path, "list_v2.3_flat.jsonc")[0].namespaces()
    assert (old.device_path, old.generic_path, old.nsid) == ("/dev/nvme0n1", "", 1)
    assert (old.model, old.serial, old.sector_bytes) == ("Samsung SSD 990 PRO 2TB", "S6B0NL0W123456F", 512)
    (new,) = printing(tmp_path, "list_v2.12_flat.jsonc")[0].namespaces()
    assert new.generic_path == "/dev/ng0n1" and new.size_bytes == 1 << 30
    local, remote = printing(tmp_path, "list_v2.12_verbose.jsonc")[0].namespaces()
    assert (local.device_path, local.generic_path, local.model, local.firmware) == (
        "/dev/nvme0n1", "/dev/ng0n1", "KV Card A100", "1.2.3"
    )  # fmt: skip
    assert (remote.device_path, remote.generic_path, remote.serial) == ("/dev/nvme1n1", "/dev/ng1n1", "REMOTE01")


def test_ocp_capacitor_health_in_both_formats(tmp_path: Path) -> None:
    first = printing(tmp_path, "ocp_smart_add_log_format1.jsonc")
    assert first[0].ocp_smart_log().capacitor_health_percent == 97  # type: ignore[union-attr]
    assert first[1].read_text().split()[:3] == ["ocp", "smart-add-log", DEVICE]
    second = printing(tmp_path, "ocp_smart_add_log_format2.jsonc")[0].ocp_smart_log()
    assert second is not None and second.capacitor_health_percent is None  # 0xFFFF: no capacitor.


def test_ocp_log_is_none_where_unsupported(tmp_path: Path) -> None:
    cli, _ = fake_nvme(tmp_path, "echo 'Invalid Log Page' >&2; exit 1")
    assert NvmeAdmin(DEVICE, cli).ocp_smart_log() is None


def test_id_ctrl_id_ns_error_log_fw_log(tmp_path: Path) -> None:
    ctrl = printing(tmp_path, "id_ctrl.jsonc")[0].id_ctrl()
    assert (ctrl.serial, ctrl.model, ctrl.firmware, ctrl.vendor_id) == (
        "S6B0NL0W123456F", "Samsung SSD 990 PRO 2TB", "4B2QJXD7", 0x144D
    )  # fmt: skip
    ns = printing(tmp_path, "id_ns.jsonc")[0].id_ns()
    assert (ns.size_blocks, ns.used_blocks, ns.block_bytes) == (3907029168, 2579200, 4096)
    (error,) = printing(tmp_path, "error_log.jsonc")[0].error_log()
    assert (error.error_count, error.cmdid, error.status_field, error.nsid) == (7, 42, 0x4187, 1)
    fw = printing(tmp_path, "fw_log.jsonc")[0].fw_log()
    assert fw.active_slot == 1 and fw.revisions == ((1, "4B2QJXD7"), (2, "5B2QJXD7"))


def test_missing_nvme_cli_is_a_clear_error(tmp_path: Path) -> None:
    admin = NvmeAdmin(DEVICE, NvmeCli(str(tmp_path / "no-such-nvme")))
    with pytest.raises(NvmeCliError, match=r"smart-log /dev/ng0n1 -o json`: nvme-cli is not installed"):
        admin.smart_log()


def test_failing_nvme_cli_names_command_device_and_message(tmp_path: Path) -> None:
    cli, _ = fake_nvme(tmp_path, "echo 'identify controller: Permission denied' >&2; exit 13")
    with pytest.raises(
        NvmeCliError, match=r"id-ctrl /dev/ng0n1 -o json` failed \(exit 13\): identify controller: Permission denied"
    ):
        NvmeAdmin(DEVICE, cli).id_ctrl()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("echo 'NVMe status: INVALID_NS'", "printed something that is not JSON: 'NVMe status: INVALID_NS'"),
        ("echo '[1, 2]'", "printed JSON that is not an object: list"),
        ("echo '{\"temperature\": 300}'", "/dev/ng0n1: nvme smart-log: field 'critical_warning' is missing"),
        ('echo \'{"critical_warning": "hot", "temperature": 1}\'', "field 'critical_warning' is not an integer"),
    ],
)
def test_unexpected_output_is_a_clear_error(tmp_path: Path, body: str, says: str) -> None:
    cli, _ = fake_nvme(tmp_path, body)
    with pytest.raises(NvmeCliError, match=says.replace("(", r"\(").replace(")", r"\)")):
        NvmeAdmin(DEVICE, cli).smart_log()


def test_wrong_list_shape_names_the_field(tmp_path: Path) -> None:
    cli, _ = fake_nvme(tmp_path, 'echo \'{"Devices": [{"DevicePath": "/dev/nvme0n1"}]}\'')
    with pytest.raises(NvmeCliError, match="nvme list: field 'NameSpace' is missing"):
        NvmeAdmin(DEVICE, cli).namespaces()


def test_a_hung_nvme_cli_is_bounded(tmp_path: Path) -> None:
    # The script waits on a FIFO nobody opens for writing: it never answers, without a sleep.
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    cli, _ = fake_nvme(tmp_path, f"read line < {fifo}")
    with pytest.raises(NvmeCliError, match=r"fw-log /dev/ng0n1 -o json`: no answer within 0.2 s"):
        NvmeAdmin(DEVICE, NvmeCli(cli.binary, timeout_s=0.2)).fw_log()


def test_a_failure_says_its_reason_not_the_usage_text_after_it(tmp_path: Path) -> None:
    # nvme-cli 2.3 on a device path that does not exist: the reason, then its usage on stderr.
    cli, _ = fake_nvme(
        tmp_path, "printf '/dev/ng9n1: No such file or directory\\nUsage: nvme smart-log <device>\\n' >&2; exit 1"
    )
    with pytest.raises(NvmeCliError, match=r"failed \(exit 1\): /dev/ng9n1: No such file or directory$"):
        NvmeAdmin("/dev/ng9n1", cli).smart_log()
