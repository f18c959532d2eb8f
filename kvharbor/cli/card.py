"""``kvharbor card``: what a card says about itself — status, usage, its event log.

    kvharbor card status|usage|events (--device SPEC | --config FILE) [--json]

``--device`` names a card as a tier's ``device:`` does (``sim``,
``sim:PARAMS.yaml``; ``file:PATH`` and device paths once their drivers exist);
``--config`` uses the configured card tier and the ``card`` section. ``wipe``
comes with the drivers whose contents outlive a process (a simulated card
starts empty in every process).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from kvharbor.cli import Subparsers, add_config_argument, config_from_args

VIEWS = ("status", "usage", "events")


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "card",
        help="show a card's status, usage or event log",
        description="Open a card (simulated now; NVMe later) and print what it reports: its aggregated "
        "status (driver, service, firmware, temperature, supercapacitor, flash spare and wear, "
        "CapacityUsage), its usage, or its numbered event log (3002: card full).",
    )
    parser.add_argument("view", choices=VIEWS)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--device", metavar="SPEC", help="a card as a tier names it: sim, sim:PARAMS.yaml")
    add_config_argument(where)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    device = _open(args)
    try:
        report = _report(device, args.view)
    finally:
        device.close()
    if args.json:
        print(json.dumps(report))
    else:
        for name, value in report.items():
            if isinstance(value, list):
                for item in value:
                    print(
                        f"{item['seq']:>6} {item['time_s']:>12.6f} s  {item['code']} {item['name']}: {item['message']}"
                    )
            else:
                print(f"{name:<20} {value}")
    return 0


def _open(args: argparse.Namespace) -> Any:
    """The card ``--device`` or the config names, opened as its tier would be (the registry,
    the ``card`` settings); raises ValueError for anything else."""
    from pydantic import ValidationError

    from kvharbor.cache.assembly import device_limit
    from kvharbor.config import CARD_DEVICE_FORMS, NvmeTierSection
    from kvharbor.hal.base import CardDevice
    from kvharbor.hal.registry import open_device

    config = config_from_args(args)
    if args.device is not None:
        try:
            section = NvmeTierSection(name="card", device=args.device)
        except ValidationError:
            raise ValueError(f"--device {args.device!r}: expected {CARD_DEVICE_FORMS}") from None
    else:
        cards = [t for t in config.storage.tiers if isinstance(t, NvmeTierSection)]
        if not cards:
            raise ValueError("the config has no card tier (storage.tiers: - {name: card, type: nvme, device: ...})")
        section = cards[0]
    device = open_device(section, device_limit(section, config))
    if not isinstance(device, CardDevice):
        device.close()
        raise ValueError(f"device {section.device!r} is not a card")
    device.set_key_eviction(config.card.key_eviction)
    return device


def _report(device: Any, view: str) -> dict[str, Any]:
    status = device.card_status()
    if view == "status":
        fields = asdict(status)
        fields["capacity_usage"] = status.capacity_usage.value
        fields["health"] = device.health().state.value
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
    return {"events": [asdict(event) for event in device.card_events()]}
