"""A fork server for engine processes: torch and vLLM imported once, each engine a forked child.

An end-to-end test's engine process (`tests/e2e/driver.py`) took about 8 s on a 2-vCPU CI
machine, 5-6 s of it importing torch and vLLM before vLLM's first log line; the suite starts
about 60 of them. `Zygote` starts one process per test session that imports the modules named
(and nothing else: no engine is built, no thread runs, which it checks before its first fork)
and forks a child per run. The child is a new process with its own environment, working
directory, arguments and log, running the script as ``__main__`` as ``python SCRIPT ARGS`` would;
it shares nothing with any other run but the modules imported before the fork (copied, not
shared). So a test's "fresh engine" is still a fresh process: a restart test's second engine
knows nothing the first one did.

The wire, JSON lines on two pipes of the server's own (its stdout and stderr are its log, where
vLLM's import-time lines go):

- request ``{"run": n, "argv": [...], "env": {...}, "cwd": str, "log": str}``;
- answer ``{"run": n, "pid": p}`` once forked, or ``{"run": n, "error": str}``;
- ``{"pid": p, "returncode": rc}`` when a child ends (``rc < 0``: killed by signal ``-rc``,
  as `subprocess.Popen` says).

    python -m tests.support.zygote REQUESTS_FD ANSWERS_FD MODULE...   # the server (`Zygote` runs it)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0
"""Bound on the server's imports (torch and vLLM: 5-6 s on two idle cores, more beside a test)."""
SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1"}
"""The server's own environment beside the caller's: numpy's OpenBLAS starts a thread pool when
it loads (torch imports numpy), and a process with threads is not safe to fork; with one thread
it starts none. (vLLM's compute is torch's, not numpy's: the children lose nothing measurable.)"""


class ZygoteError(RuntimeError):
    """The fork server did not start, or went away: the message says why."""


class Child:
    """One forked run, waited for like a `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        return self._zygote._returncode(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises `subprocess.TimeoutExpired` after ``timeout`` seconds."""
        return self._zygote._wait(self.pid, timeout)

    def kill(self) -> None:
        """SIGKILL, unless it has ended (its pid may then be another process's)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """The client side: `start` the server, `spawn` runs, `close` it (its children run on)."""

    def __init__(self, process: subprocess.Popen[bytes], requests: IO[bytes], answers: IO[bytes]) -> None:
        self._process = process
        self._requests = requests
        self._answers = answers
        self._changed = threading.Condition()
        self._forked: dict[int, dict[str, Any]] = {}
        self._ended: dict[int, int] = {}
        self._gone: str | None = None
        self._runs = 0
        self._reader = threading.Thread(target=self._read, name="zygote-answers", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, modules: Sequence[str], env: Mapping[str, str], log: Path) -> Zygote:
        """A server that has imported ``modules`` under ``env``; its own output goes to ``log``."""
        path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.zygote", str(requests_read), str(answers_write), *modules],
                pass_fds=(requests_read, answers_write),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**env, **SERVER_ENV, "PYTHONPATH": path},
                cwd=REPO,
            )  # fmt: skip
        os.close(requests_read)
        os.close(answers_write)
        zygote = cls(process, os.fdopen(requests_write, "wb", buffering=0), os.fdopen(answers_read, "rb"))
        zygote._await_ready(log)
        return zygote

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> Child:
        """``python argv[0] argv[1:]`` with ``env`` in ``cwd``, stdout and stderr appended to ``log``."""
        with self._changed:
            self._runs += 1
            run = self._runs
        request = {"run": run, "argv": list(argv), "env": dict(env), "cwd": str(cwd), "log": str(log)}
        self._requests.write((json.dumps(request) + "\n").encode())
        with self._changed:
            self._changed.wait_for(lambda: run in self._forked or self._gone is not None, READY_TIMEOUT_S)
            answer = self._forked.pop(run, None)
        if answer is None or "error" in answer:
            raise ZygoteError(f"run {argv} not forked: {answer['error'] if answer else self._gone or 'no answer'}")
        return Child(self, answer["pid"])

    def close(self) -> None:
        """Stops the server (its end of the requests pipe closes); runs still going go on."""
        self._requests.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _await_ready(self, log: Path) -> None:
        with self._changed:
            self._changed.wait_for(lambda: 0 in self._forked or self._gone is not None, READY_TIMEOUT_S)
            ready = self._forked.pop(0, None)
        if ready is None or "error" in ready:
            self.close()
            why = ready["error"] if ready else self._gone or f"not ready in {READY_TIMEOUT_S} s"
            raise ZygoteError(f"the fork server did not start: {why}; its log: {log}")

    def _read(self) -> None:
        for line in self._answers:
            answer = json.loads(line)
            with self._changed:
                if "returncode" in answer:
                    self._ended[answer["pid"]] = answer["returncode"]
                else:
                    self._forked[answer["run"]] = answer
                self._changed.notify_all()
        with self._changed:
            self._gone = f"the fork server exited ({self._process.wait()})"
            self._changed.notify_all()

    def _returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._ended.get(pid)

    def _wait(self, pid: int, timeout: float | None) -> int:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended or self._gone is not None, timeout)
            if pid in self._ended:
                return self._ended[pid]
        if self._gone is not None:
            raise ZygoteError(f"pid {pid}: {self._gone} before it ended")
        raise subprocess.TimeoutExpired([str(pid)], timeout or 0.0)


# -- the server ------------------------------------------------------------------------------


def serve(requests_fd: int, answers_fd: int, modules: Sequence[str]) -> int:
    """Imports ``modules``, then forks a child per request until the requests pipe closes."""

    def answer(record: dict[str, Any]) -> None:
        os.write(answers_fd, (json.dumps(record) + "\n").encode())

    for name in modules:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # A fork copies only the forking thread: a lock another one held stays held.
        answer({"run": 0, "error": f"{len(threads)} threads after importing {', '.join(modules)}: not fork-safe"})
        return 1
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    answer({"run": 0, "pid": os.getpid()})
    pending = b""
    while True:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([requests_fd, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(answer)
        if requests_fd not in ready:
            continue
        chunk = os.read(requests_fd, 1 << 16)
        if not chunk:
            return 0  # The client closed its end: no more runs.
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            sys.stdout.flush()  # What the server printed is not the child's to write again.
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # The child leaves the loop and exits as `python SCRIPT` would, atexit and all.
                return _run_child(request, (requests_fd, answers_fd, wake_read, wake_write))
            answer({"run": request["run"], "pid": pid})


def _reap(answer: Callable[[dict[str, Any]], None]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        answer({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _run_child(request: dict[str, Any], server_fds: Sequence[int]) -> int:
    """In the forked child: run ``argv`` as ``python argv...`` would in the request's
    environment; its exit status (the server's caller exits with it)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # Chosen again from this run's TMPDIR.
    os.chdir(request["cwd"])
    argv = request["argv"]
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)  # What `python SCRIPT` puts first.
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        return _exit_code(exit.code)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_code(code: object) -> int:
    """What the interpreter's exit status is for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
