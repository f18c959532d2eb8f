"""``kvharbor gateway``: run the gateway, the one process that owns the storage on a host.

    kvharbor gateway --config FILE [--start-clean=0|1]

``--start-clean=1`` empties every tier at start; ``0``, the default, keeps the
cache, so that an engine restarted alone finds its prefixes again. The
process serves until SIGTERM or SIGINT. ``--ready-fd``, ``--parent-fd`` and
``--embedded`` are internal: embedded mode (`kvharbor.gateway.embedded`) starts
the gateway with them to learn when it serves, to detach it from the engine
(`kvharbor.gateway.detach`) and to let its clients decide its life
(``gateway.linger_s``), or, at ``linger_s: 0``, to stop it when the engine exits.
``--as-release`` is internal too: the scenarios' gateway of another release says it is
that release (and so refuses engines of this one, VERSION_MISMATCH).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvharbor import __version__
from kvharbor.cli import Subparsers, add_config_argument, config_from_args
from kvharbor.config import ENV_CONFIG


def _zero_or_one(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
    return text == "1"


def _open_fd(text: str) -> int:
    """An inherited file descriptor number; refused unless it is open in this process."""
    try:
        fd = int(text)
        os.fstat(fd)
    except (ValueError, OSError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an open file descriptor") from None
    return fd


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run the gateway that serves the cache to engines on this host",
        description="Open the configured tiers and serve clients (engine ranks) over a Unix socket "
        "and shared memory until SIGTERM or SIGINT. A gateway restart needs an engine restart "
        "too: clients do not reconnect.",
    )
    add_config_argument(parser)
    parser.add_argument(
        "--start-clean",
        type=_zero_or_one,
        default=False,
        metavar="0|1",
        help="1: empty every tier at start; 0 (default): keep the cache",
    )
    # Internal, for embedded mode; not shown in --help.
    parser.add_argument("--ready-fd", type=_open_fd, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-fd", type=_open_fd, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--as-release", metavar="RELEASE", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # A bad config: ConfigError, printed as kvharbor: error: (exit 2).
    linger_s = 0.0
    if args.embedded:
        if args.ready_fd is None:
            raise SystemExit("kvharbor: error: --embedded needs --ready-fd")
        from kvharbor.gateway.detach import detach, log_path

        detach(args.ready_fd, log_path(Path(config.gateway.socket)))  # Returns in the gateway only.
        linger_s = config.gateway.linger_s
    from kvharbor.gateway.process import run_gateway  # Heavy: the store and its drivers.

    config_path = args.config or os.environ.get(ENV_CONFIG)
    return run_gateway(
        config,
        start_clean=args.start_clean,
        ready_fd=args.ready_fd,
        parent_fd=args.parent_fd,
        linger_s=linger_s,
        config_path=Path(config_path).resolve() if config_path else None,
        release=args.as_release or __version__,
    )
