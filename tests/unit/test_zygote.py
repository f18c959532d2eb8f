"""The fork server the end-to-end tests start their engines from (`tests/support/zygote.py`):
a forked run is the script as ``python SCRIPT ARGS`` runs it, and its end is reported as
`subprocess.Popen` reports it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.zygote import Zygote, ZygoteError

SCRIPT = """\
import atexit, json, os, sys, tempfile
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
                  "env": os.environ.get("ZYGOTE_TEST"), "main": __name__, "path0": sys.path[0]}), flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
if sys.argv[1] == "raise":
    raise ValueError("from the script")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    server = Zygote.start(["json"], dict(os.environ), tmp_path / "zygote.log")
    try:
        yield server
    finally:
        server.close()


def test_a_run_is_the_script_in_its_own_environment_directory_and_log(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "bin" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "run.log"
    env = {**os.environ, "ZYGOTE_TEST": "yes", "TMPDIR": str(work)}
    child = zygote.spawn([str(script), "3"], env, work, log)
    assert child.wait(30) == 3 and child.poll() == 3
    first, last = log.read_text().splitlines()
    assert json.loads(first) == {
        "argv": [str(script), "3"],
        "cwd": str(work),
        "tmp": str(work),
        "env": "yes",
        "main": "__main__",
        "path0": str(script.parent),
    }
    assert last == "atexit ran"  # It exits as an interpreter does: its exit handlers run.


def test_an_uncaught_exception_and_a_signal_are_reported_as_popen_reports_them(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    raised = zygote.spawn([str(script), "raise"], dict(os.environ), tmp_path, tmp_path / "raise.log")
    killed = zygote.spawn([str(script), "kill"], dict(os.environ), tmp_path, tmp_path / "kill.log")
    assert raised.wait(30) == 1
    assert "ValueError: from the script" in (tmp_path / "raise.log").read_text()
    assert killed.wait(30) == -signal.SIGKILL


def test_a_wait_is_bounded_and_a_child_can_be_killed(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import select\nselect.select([], [], [])\n")
    child = zygote.spawn([str(script)], dict(os.environ), tmp_path, tmp_path / "sleeper.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_a_server_whose_imports_fail_says_so(tmp_path: Path) -> None:
    with pytest.raises(ZygoteError, match="did not start"):
        Zygote.start(["no_such_module_here"], dict(os.environ), tmp_path / "zygote.log")
    assert "No module named 'no_such_module_here'" in (tmp_path / "zygote.log").read_text()
