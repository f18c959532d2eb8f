"""The wheel works as the README's install line says: built with ``pip wheel --no-deps .``
(or the one CI built, ``$KVHARBOR_WHEEL``), installed into a fresh venv, its ``kvharbor``
command runs from there, and it holds every file of the package, not only the modules."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.support.wheel import ROOT


def package_files() -> set[str]:
    """Every file git tracks under kvharbor/ that is not a module (page, chart library, ...)."""
    listed = subprocess.run(
        ["git", "ls-files", "kvharbor"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {path for path in listed if not path.endswith(".py")}


def test_the_wheel_installs_into_a_fresh_venv_and_its_command_runs(tmp_path: Path, wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert package_files() <= names, sorted(package_files() - names)
    assert "kvharbor = kvharbor.cli:main" in entry_points
    assert "[vllm.general_plugins]" in entry_points  # KVHARBOR=1 finds the connector through it.

    # Nothing of the checkout on the path: pip would take a kvharbor found there as installed.
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVHARBOR_CONFIG")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, timeout=300, env=environ
    )
    # --no-deps: then the dependencies come from this environment's site-packages, put behind
    # the venv's own (a path in a .pth file; the editable install of the checkout there is not run).
    venv_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            env=environ,
        ).stdout.strip()
    )
    (venv_site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    ran = subprocess.run(
        [str(venv / "bin" / "kvharbor"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environ,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "usage: kvharbor" in ran.stdout and "purge" in ran.stdout and "gateway" in ran.stdout
    where = subprocess.run(
        [str(python), "-c", "import kvharbor; print(kvharbor.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environ,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv_site), where  # The installed copy, not the checkout.
