"""``kvharbor status``: whether a gateway runs, and what it holds and how it does.

The gateway's socket is the one path asked (a read-only STATUS without a handshake,
`kvharbor.gateway.query`): it answers whatever the dashboard's settings are
(``dashboard.enabled: false`` changes nothing here), for any config digest, and the
question changes nothing in the gateway. ``--json`` prints the status's one JSON form
(`GatewayStatus.to_json`, the form the dashboard's ``/api/status`` serves).

When no gateway answers, it says why (`kvharbor.gateway.query.Absence`: socket missing,
connection refused, not a gateway's socket, no answer, another release, access denied),
still shows what the configured file tiers hold on disk (read-only), and exits 1.
Bad input (the config) exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvharbor.cli import Subparsers, add_config_argument, config_from_args

if TYPE_CHECKING:
    from kvharbor.config import Config
    from kvharbor.gateway.query import NoGateway

EXIT_NO_GATEWAY = 1


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show whether a gateway runs and what the cache holds",
        description="Ask the gateway at gateway.socket for its status (read-only, without attaching). "
        "When none answers, say why, show what the file tiers hold on disk, and exit 1.",
    )
    add_config_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the status as JSON (the dashboard's form)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvharbor.gateway.query import GatewayQuery, NoGateway

    config = config_from_args(args)
    try:
        with GatewayQuery.connect(config.gateway) as query:
            status = query.status()
    except NoGateway as err:
        return _absent(config, err, args.json)
    if args.json:
        print(status.to_json(indent=2))
    else:
        from kvharbor.ops.status_text import render_status

        print(render_status(status))
    return 0


def _absent(config: Config, err: NoGateway, as_json: bool) -> int:
    from kvharbor.ops.disk import NoGatewayReport, read_disk
    from kvharbor.ops.status_text import render_on_disk

    on_disk = read_disk(config)
    if as_json:
        report = NoGatewayReport(config.gateway.socket, err.absence.value, err.text, on_disk)
        print(report.to_json())
    else:
        print(render_on_disk(on_disk))
    print(f"kvharbor: no gateway answers at {config.gateway.socket}: {err}", file=sys.stderr)
    return EXIT_NO_GATEWAY
