"""Running nvme-cli: ``nvme SUBCOMMAND [DEVICE] ... -o json``, bounded by a timeout.

Every failure is one `NvmeCliError` whose message names the command line and the
device: nvme-cli missing, a non-zero exit (with the first line it wrote to
stderr), a timeout, or output that is not a JSON object. Callers never see a
traceback for any of them.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

NVME_CLI_TIMEOUT_S = 10.0
"""Default bound of one nvme-cli call (an admin command on a healthy drive takes milliseconds)."""


class NvmeCliError(Exception):
    """nvme-cli could not answer; the message names the command and the device."""


@dataclass(frozen=True, slots=True)
class NvmeCli:
    binary: str = "nvme"
    """The nvme-cli executable: a name looked up on PATH, or a path."""
    timeout_s: float = NVME_CLI_TIMEOUT_S

    def json(self, *args: str) -> dict[str, Any]:
        """The JSON object ``binary ARGS -o json`` prints; raises `NvmeCliError`."""
        line = " ".join((self.binary, *args, "-o", "json"))
        try:
            done = subprocess.run(
                [self.binary, *args, "-o", "json"], capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except FileNotFoundError:
            raise NvmeCliError(
                f"`{line}`: nvme-cli is not installed ('{self.binary}' not found); install nvme-cli"
            ) from None
        except PermissionError:
            raise NvmeCliError(f"`{line}`: '{self.binary}' cannot be executed (permission denied)") from None
        except subprocess.TimeoutExpired:
            raise NvmeCliError(f"`{line}`: no answer within {self.timeout_s:g} s") from None
        if done.returncode != 0:
            # The first line is the reason; nvme-cli 2.3 follows a bad device path with its usage text.
            said = [text.strip() for text in done.stderr.splitlines() if text.strip()]
            raise NvmeCliError(f"`{line}` failed (exit {done.returncode}): {said[0] if said else 'no message'}")
        try:
            parsed = json.loads(done.stdout)
        except json.JSONDecodeError:
            raise NvmeCliError(f"`{line}` printed something that is not JSON: {done.stdout.strip()[:80]!r}") from None
        if not isinstance(parsed, dict):
            raise NvmeCliError(f"`{line}` printed JSON that is not an object: {type(parsed).__name__}")
        return parsed
