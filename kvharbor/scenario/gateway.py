"""A real ``kvharbor gateway`` process for a scenario: started, stopped, killed, read.

Ready is the gateway's own word on its ready pipe; a gateway that refuses to start
(a ring that does not fit, a bad config) closes the pipe and exits, and its log says
why. Every wait is bounded by the scenario's ``setup.gateway_wait_s``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

LOG_TAIL_LINES = 20
"""How much of a gateway's log a failed wait quotes (what it was doing when the wait ran out)."""


class GatewayProcess:
    def __init__(self, config_path: Path, log_path: Path, wait_s: float) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.wait_s = wait_s
        """Bound on its start and its exit (``setup.gateway_wait_s``)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, start_clean: bool = False, release: str | None = None) -> bool:
        """Start it; True once it says ready, False when it exited instead (the log says why).
        ``release``: it says it is that release (``kvharbor gateway --as-release``)."""
        if self.running:
            raise RuntimeError("scenario gateway: already running")
        read_end, write_end = os.pipe()
        command = [sys.executable, "-m", "kvharbor", "gateway", "--config", str(self.config_path)]
        command += [f"--start-clean={int(start_clean)}", "--ready-fd", str(write_end)]
        command += ["--as-release", release] if release is not None else []
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, pass_fds=(write_end,), stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )
        os.close(write_end)
        self.starts += 1
        try:
            ready, _, _ = select.select([read_end], [], [], self.wait_s)
            answer = os.read(read_end, 16) if ready else b""
        finally:
            os.close(read_end)
        if answer == b"ready\n":
            return True
        if not ready:
            self.kill()
            tail = "\n".join(self.log().splitlines()[-LOG_TAIL_LINES:])
            raise RuntimeError(
                f"scenario gateway: not ready within {self.wait_s} s (setup.gateway_wait_s); "
                f"the last lines of its log {self.log_path}:\n{tail}"
            )
        self.process.wait(self.wait_s)
        return False

    def stop(self) -> int | None:
        """SIGTERM and wait for its exit; its exit status (None when it was not running)."""
        return self._end(signal.SIGTERM)

    def kill(self) -> int | None:
        """SIGKILL, as the OOM killer or a crash would end it."""
        return self._end(signal.SIGKILL)

    def _end(self, signum: int) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signum)
        status = self.process.wait(self.wait_s)
        self.process = None
        return status

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
