"""``kvharbor card``: what a card says about itself — status, usage, its event log — and wipe.

    kvharbor card status|usage|events (--device SPEC | --config FILE) [--json]
    kvharbor card wipe (--device SPEC | --config FILE) [--yes] [--force] [--json]

``--device`` names a card as a tier's ``device:`` does (``sim``,
``sim:PARAMS.yaml``, ``file:PATH``, ``/dev/nvmeXnY``, ``/dev/ngXnY``);
``--config`` uses the configured card tier and the ``card`` section; while the
configured gateway serves it (it holds the card: a block store's lock, a simulated
card in its own memory), status, usage and events are the gateway's answer (its
status carries each card's newest events).

``wipe`` removes every key. It asks for confirmation (the word ``yes`` on
stdin) unless ``--yes``; with nothing to read on stdin it refuses. It refuses
while a gateway serves the card, unless ``--force``. How that is told:

- block mode (``file:PATH``, a block device): the store's exclusive ``flock``,
  held by the process that has it open. ``--force`` wipes beside it; that
  gateway keeps serving what it holds (its values stay whole: it never reads
  another store's objects) until it restarts, and then finds the card empty;
- every card, with ``--config``: the configured gateway's socket accepting a
  connection. A simulated card lives in the process that opened it, so
  ``--device sim`` wipes a card nobody else sees, and a KV namespace named by
  ``--device`` alone has no lock to tell by: name the config to be warned.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from dataclasses import asdict
from typing import Any

from kvharbor.cli import Subparsers, add_config_argument, config_from_args
from kvharbor.config import Config
from kvharbor.hal.base import CardEventRecord, CardStatus

VIEWS = ("status", "usage", "events", "wipe")


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "card",
        help="show a card's status, usage or event log, or wipe it",
        description="Open a card (simulated, block mode on a file or block device, an NVMe KV namespace) and "
        "print what it reports: its aggregated status (driver, service, firmware, temperature, "
        "supercapacitor, flash spare and wear, CapacityUsage), its usage, or its numbered event log "
        "(3002: card full); or wipe every key from it.",
    )
    parser.add_argument("view", choices=VIEWS)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--device", metavar="SPEC", help="a card as a tier names it: sim, sim:PARAMS.yaml, file:PATH, /dev/..."
    )
    add_config_argument(where)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    parser.add_argument("--yes", action="store_true", help="wipe: do not ask for confirmation")
    parser.add_argument("--force", action="store_true", help="wipe: even while a gateway serves the card")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.view != "wipe" and (args.yes or args.force):
        raise ValueError("--yes and --force apply to 'kvharbor card wipe' only")
    config = config_from_args(args)
    if args.view == "wipe":
        return _wipe(args, config)
    served = _from_gateway(args, config) if args.config is not None else None
    if served is not None:
        report = _report(*served, args.view)
    else:
        device = _open(args, config)
        try:
            report = _report(device.card_status(), device.health().state.value, device.card_events(), args.view)
        finally:
            device.close()
    _print(report, args.json)
    return 0


def _from_gateway(args: argparse.Namespace, config: Config) -> tuple[CardStatus, str, list[CardEventRecord]] | None:
    """The configured card as the gateway serving it reports it (it holds the card: a block
    store's lock, a simulated card in its memory), or None when no gateway answers there."""
    from kvharbor.gateway.query import GatewayQuery, NoGateway

    name = _section(args, config).name
    try:
        with GatewayQuery.connect(config.gateway) as query:
            status = query.status()
    except NoGateway:
        return None
    card = status.cards.get(name)
    if card is None:
        condition = status.tier_conditions().get(name, "not among its tiers")
        raise ValueError(f"the gateway at {status.socket} serves no answering card tier {name!r}: {condition}")
    (tier,) = [tier for tier in status.store.tiers if tier.name == name]
    return card, tier.health, status.card_events.get(name, [])


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    for name, value in report.items():
        if isinstance(value, list):
            for item in value:
                print(f"{item['seq']:>6} {item['time_s']:>12.6f} s  {item['code']} {item['name']}: {item['message']}")
        else:
            print(f"{name:<20} {value}")


def _open(args: argparse.Namespace, config: Config, exclusive: bool = True) -> Any:
    """The card ``--device`` or the config names, opened as its tier would be (the ``card``
    settings); raises ValueError for anything else, a device fault included."""
    from kvharbor.cache.assembly import device_limit
    from kvharbor.hal.base import CardDevice, DeviceError, DeviceInUse
    from kvharbor.hal.cards import open_card

    section = _section(args, config)
    try:
        device = open_card(section, config.card, device_limit(section, config), exclusive=exclusive)
    except DeviceInUse as err:
        hint = "; stop it first, or pass --force" if args.view == "wipe" else ""
        raise ValueError(f"{err}: a gateway is serving it{hint}") from None
    except DeviceError as err:
        raise ValueError(str(err)) from None
    if not isinstance(device, CardDevice):
        device.close()
        raise ValueError(f"device {section.device!r} is not a card")
    device.set_key_eviction(config.card.key_eviction)
    return device


def _section(args: argparse.Namespace, config: Any) -> Any:
    from pydantic import ValidationError

    from kvharbor.config import CARD_DEVICE_FORMS, NvmeTierSection

    if args.device is not None:
        try:
            return NvmeTierSection(name="card", device=args.device)
        except ValidationError:
            raise ValueError(f"--device {args.device!r}: expected {CARD_DEVICE_FORMS}") from None
    cards = [t for t in config.storage.tiers if isinstance(t, NvmeTierSection)]
    if not cards:
        raise ValueError("the config has no card tier (storage.tiers: - {name: card, type: nvme, device: ...})")
    return cards[0]


def _report(status: CardStatus, health: str, events: list[CardEventRecord], view: str) -> dict[str, Any]:
    if view == "status":
        fields = asdict(status)
        fields["capacity_usage"] = status.capacity_usage.value
        fields["health"] = health
        fields["paths"] = list(status.paths)
        return fields
    if view == "usage":
        return {
            "capacity_usage": status.capacity_usage.value,
            "used_bytes": status.used_bytes,
            "capacity_bytes": status.capacity_bytes,
            "keys": status.keys,
            "keys_max": status.keys_max,
            "key_eviction": status.key_eviction,
        }
    return {"events": [asdict(event) for event in events]}


# -- wipe ----------------------------------------------------------------------


def _wipe(args: argparse.Namespace, config: Config) -> int:
    from kvharbor.config import gateway_address

    spec = args.device
    if args.config is not None:
        spec = _section(args, config).device
        socket_path = str(gateway_address(config).socket)
        if not args.force and _answers(socket_path):
            raise ValueError(
                f"card {spec}: the gateway at {socket_path} is serving it; stop the gateway first, "
                "or pass --force to wipe beside it"
            )
    device = _open(args, config, exclusive=not args.force)
    try:
        keys = device.usage().keys
        if not args.yes and not _confirmed(spec, keys):
            print(f"kvharbor: card {spec} not wiped", file=sys.stderr)
            return 1
        removed = device.wipe()
    finally:
        device.close()
    _print({"wiped": spec, "keys_removed": removed}, args.json)
    return 0


def _confirmed(spec: str, keys: int) -> bool:
    """Whether the user typed ``yes``; raises ValueError when there is nothing to read."""
    print(f"wipe card {spec}: remove all of its {keys} keys? type 'yes' to confirm: ", end="", flush=True)
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except (OSError, ValueError):
        answer = ""
    if not answer:
        print(file=sys.stdout)
        raise ValueError(f"card {spec}: wipe needs a confirmation and stdin gives none; pass --yes to wipe")
    return answer.strip().lower() == "yes"


def _answers(socket_path: str) -> bool:
    """Whether something accepts connections on the gateway's Unix socket."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(socket_path)
    except OSError:
        return False
    finally:
        probe.close()
    return True
