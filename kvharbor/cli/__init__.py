"""The ``kvharbor`` command: one argparse parser, one module per command group.

Adding a command group (``gateway``, ``status``, ``demo``, ...):

1. write ``kvharbor/cli/<group>.py`` with::

       def add_parser(subparsers: Subparsers) -> None:
           parser = subparsers.add_parser("name", help="one line", description="...")
           parser.add_argument(...)
           parser.set_defaults(run=run)

       def run(args: argparse.Namespace) -> int:
           ...  # the exit status

2. append its module name to `COMMAND_MODULES` below.

Every command module is imported to build the parser (``--help`` lists them
all), so keep a module's top-level imports light and import heavy things
(the gateway, an engine) inside ``run``.

Errors: a ``ValueError`` out of ``run`` — `kvharbor.config.ConfigError` is one,
and so is every bad-input error of the library (token ids, keys, codecs) —
is the user's to fix: it is printed as ``kvharbor: error: <message>`` on
stderr and the exit status is 2, the same as argparse's own usage errors. No
traceback: the message is the whole story. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TypeAlias

import kvharbor
from kvharbor.config import Config, load_config

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``add_parser`` of a command module receives."""

COMMAND_MODULES: tuple[str, ...] = (
    "kvharbor.cli.keys",
    "kvharbor.cli.gateway",
    "kvharbor.cli.demo",
    "kvharbor.cli.card",
    "kvharbor.cli.status",
    "kvharbor.cli.doctor",
    "kvharbor.cli.purge",
    "kvharbor.cli.plan",
    "kvharbor.cli.scenario",
)
"""Modules that each register one command group through ``add_parser(subparsers)``."""

PROG = "kvharbor"
EXIT_USAGE = 2
"""Exit status for bad input (argparse uses 2 for usage errors too)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="kvharbor: a persistent, tiered KV cache for LLM serving engines.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {kvharbor.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def add_config_argument(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    """The ``--config FILE`` option every command that reads the config shares."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (default: $KVHARBOR_CONFIG, else built-in defaults; "
        "KVHARBOR__SECTION__KEY variables override either)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """The validated config named by ``--config``; raises `ConfigError` (exit 2)."""
    return load_config(getattr(args, "config", None))


def error(message: str) -> int:
    """Print a user-facing error the way every kvharbor command does; returns `EXIT_USAGE`."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvharbor`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as err:
        return error(str(err))
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, what a shell reports for Ctrl-C.
    except BrokenPipeError:
        # The reader went away (``kvharbor keys | head -1``): not our failure.
        # Point stdout at /dev/null so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
