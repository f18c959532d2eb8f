"""Run a real process as another local user, from an interpreter that root started.

    python as_user.py UID:GID:GID,GID... -- PYTHON -m MODULE ARGS...

`subprocess`'s ``user=`` switches user before ``exec``, and cannot be used where
the interpreter itself is not readable by that user (this machine's Python
lives under /root, mode 0700). So the process starts as root, imports what it
needs (`PRELOAD`), then drops to the user for good (`become`: groups, gid,
uid, in that order) before it does anything the test looks at. From then on
the kernel sees only that user: its socket credentials, its file access.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

ENV = "KVHARBOR_TEST_AS_USER"
"""A worker that finds this variable (``UID:GID:GIDS``) calls `become` with it itself."""

PRELOAD = (
    "kvharbor.cli",
    "kvharbor.cli.gateway",
    "kvharbor.gateway.process",
    "kvharbor.gateway.embedded",
    "kvharbor.hal.file",
    "logging.handlers",
)
"""Modules a gateway or client imports lazily: read while the files are still readable."""


def spec(uid: int, gid: int, groups: list[int]) -> str:
    return f"{uid}:{gid}:{','.join(map(str, groups))}"


def become(text: str) -> None:
    """Drop to the user of ``text`` (`spec`'s form) for good; only root may."""
    uid, gid, groups = text.split(":")
    for name in PRELOAD:
        importlib.import_module(name)
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(int(gid))
    os.setuid(int(uid))
    assert (os.getuid(), os.geteuid()) == (int(uid), int(uid))


def main(argv: list[str]) -> None:
    text, separator, _python, flag, module, *args = argv
    if separator != "--" or flag != "-m":
        raise SystemExit(f"usage: {__doc__}")
    become(text)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
