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
import importlib.abc
import importlib.util
import os
import sys
from types import CodeType

ENV = "KVHARBOR_TEST_AS_USER"
"""A worker that finds this variable (``UID:GID:GIDS``) calls `become` with it itself."""

PRELOAD = (
    "kvharbor.gateway.process",
    "kvharbor.gateway.embedded",
    "kvharbor.hal.file",
    "logging.handlers",
)
"""Modules a gateway or client imports lazily, beyond the CLI parser (`become` builds it):
read while the files are still readable."""


def spec(uid: int, gid: int, groups: list[int]) -> str:
    return f"{uid}:{gid}:{','.join(map(str, groups))}"


def become(text: str) -> None:
    """Drop to the user of ``text`` (`spec`'s form) for good; only root may."""
    uid, gid, groups = text.split(":")
    from kvharbor.cli import build_parser

    build_parser()  # Every command's `add_parser`, and what each imports to build it.
    for name in PRELOAD:
        importlib.import_module(name)
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(int(gid))
    os.setuid(int(uid))
    assert (os.getuid(), os.geteuid()) == (int(uid), int(uid))


def main_code(module: str) -> tuple[CodeType, dict[str, object]]:
    """What ``python -m module`` runs (a package's ``__main__``) and the globals it runs in,
    read now: after `become` the checkout may be unreadable (a clone in a 0700 directory)."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{module}.__main__")
    loader = spec.loader if spec is not None else None
    code = loader.get_code(spec.name) if spec is not None and isinstance(loader, importlib.abc.InspectLoader) else None
    if spec is None or code is None:
        raise SystemExit(f"as_user: no module {module} to run")
    return code, {"__name__": "__main__", "__spec__": spec, "__file__": spec.origin, "__package__": spec.parent}


def main(argv: list[str]) -> None:
    text, separator, _python, flag, module, *args = argv
    if separator != "--" or flag != "-m":
        raise SystemExit(f"usage: {__doc__}")
    code, namespace = main_code(module)
    become(text)
    sys.argv = [module, *args]
    exec(code, {**namespace, "__builtins__": __builtins__})


if __name__ == "__main__":
    main(sys.argv[1:])
