"""``kvharbor purge``: empty part of the cache — one namespace, one layout, or what is old.

    kvharbor purge (--namespace NS | --layout ID | --older-than DURATION) [--yes] [--json] [--config FILE]

Without ``--yes`` it only says what it would remove (values and bytes per tier) and
removes nothing. Where it works:

- a gateway answers on the config's socket: through it (PURGE), from every tier
  and index it serves, its RAM tiers included; a value a client is reading in place
  is unlinked at once and its bytes freed when the client lets go (the lending rule
  of `kvharbor.hal.base.SharedSpans`);
- nothing answers: on the persistent tiers directly, under the rules that let a
  gateway share them: a file tier's manifest admits one writer at a time (SQLite
  ``BEGIN IMMEDIATE``) and a block-mode card is opened with its exclusive lock, so a
  card a gateway holds is reported busy and left as it is. A RAM tier or a simulated
  card lives only in a gateway's memory: nothing of it outlives one, nothing to purge;
- a gateway answers but refuses this client (another release or storage config,
  access denied): an error naming why; nothing is touched, since that gateway's RAM
  tier would keep what the files lost.

Exit status: 0 when every configured tier that can hold anything was searched, 1 when
one could not be (its line says why; the others were still purged), 2 for bad input.

``--layout ID`` is the short fingerprint digest ``kvharbor status`` and the engine's
``cache tensors registered`` line show after ``#`` (or any longer prefix of the digest's
hex). ``--older-than`` takes ``30m``, ``2h``, ``7d``, ``1h30m`` (units s, m, h, d, w).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvharbor.cache.purge import PurgeFilter, PurgeReport, parse_duration
from kvharbor.cli import Subparsers, add_config_argument, config_from_args
from kvharbor.config import Config


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "purge",
        help="remove one namespace, one layout or old values from the cache",
        description="Remove the values of one key namespace, of one layout, or those unused for a while, "
        "from every tier: through the running gateway, else from the persistent tiers directly. "
        "Without --yes, only say what would be removed.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--namespace", metavar="NS", help="an engine.key_namespace")
    what.add_argument(
        "--layout", metavar="ID", help="a layout's short fingerprint digest, as status shows it after '#'"
    )
    what.add_argument(
        "--older-than", metavar="DURATION", help="values not used for this long: 30m, 2h, 7d, 1h30m (s, m, h, d, w)"
    )
    parser.add_argument("--yes", action="store_true", help="remove them (default: only say what would go)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_config_argument(parser)
    parser.set_defaults(run=run)


def selection_from_args(args: argparse.Namespace) -> PurgeFilter:
    """The filter the arguments name; raises ValueError naming a bad one."""
    if args.older_than is not None:
        return PurgeFilter(older_than_s=parse_duration(args.older_than))
    if args.layout is not None:
        return PurgeFilter.parse_layout(args.layout)
    if not args.namespace:
        raise ValueError("--namespace needs a name")
    return PurgeFilter(namespace=args.namespace)


def run(args: argparse.Namespace) -> int:
    selection = selection_from_args(args)
    config = config_from_args(args)
    report = _through_gateway(config, selection, args.yes)
    if report is None:
        report = _on_persistent_tiers(config, selection, args.yes)
    print(report.to_json() if args.json else render(report))
    return 1 if any(t.error for t in report.tiers) else 0


def _through_gateway(config: Config, selection: PurgeFilter, apply: bool) -> PurgeReport | None:
    """The gateway's report, or None when no gateway answers; raises ValueError when one
    answers and cannot do it."""
    from kvharbor.gateway.client import GatewayClient, GatewayError, GatewayNotRunning

    try:
        client = GatewayClient.connect(config.gateway, f"kvharbor purge (pid {os.getpid()})")
    except GatewayNotRunning:
        return None
    except GatewayError as err:
        raise ValueError(
            f"the gateway at {config.gateway.socket} cannot be asked to purge ({err}); nothing was removed"
        ) from None
    try:
        return client.purge(selection, apply)
    except GatewayError as err:
        raise ValueError(f"the gateway at {config.gateway.socket} failed the purge: {err}") from None
    finally:
        client.close()


def _on_persistent_tiers(config: Config, selection: PurgeFilter, apply: bool) -> PurgeReport:
    from kvharbor.cache.assembly import open_tier
    from kvharbor.cache.probe import ProbeFailed
    from kvharbor.cache.purge import TierPurge, purge
    from kvharbor.cache.tier import Tier
    from kvharbor.config import FileTierSection, NvmeTierSection, RamTierSection
    from kvharbor.hal.base import DeviceError, DeviceInUse

    # No start-up probe: a purge that only looks must write nothing, not even a probe object.
    quiet = config.model_copy(update={"storage": config.storage.model_copy(update={"probe": False})})
    tiers: list[Tier] = []
    failed: list[TierPurge] = []
    notes: list[str] = []
    for section in config.storage.tiers:
        if isinstance(section, RamTierSection) or (
            isinstance(section, NvmeTierSection) and section.device.split(":", 1)[0] == "sim"
        ):
            notes.append(f"tier '{section.name}' lives in a gateway's memory only; with none running it holds nothing")
            continue
        if isinstance(section, FileTierSection) and not Path(section.path).exists():
            notes.append(f"tier '{section.name}': {section.path} does not exist; it holds nothing")
            continue
        try:
            tiers.append(open_tier(section, quiet))
        except DeviceInUse as err:
            failed.append(TierPurge(section.name, 0, 0, error=f"{err}: a gateway holds it; left as it is"))
        except (ValueError, DeviceError, ProbeFailed, OSError) as err:
            failed.append(TierPurge(section.name, 0, 0, error=f"unavailable: {err}"))
    try:
        where = f"kvharbor purge (pid {os.getpid()}); no gateway answers at {config.gateway.socket}"
        report = purge(tiers, selection, apply, where, tuple(notes))
    finally:
        for tier in tiers:
            tier.close()
    order = [section.name for section in config.storage.tiers]
    parts = sorted(report.tiers + tuple(failed), key=lambda t: order.index(t.tier))
    return PurgeReport(report.selection, report.applied, tuple(parts), report.where, report.notes)


def render(report: PurgeReport) -> str:
    """The report as lines for a person."""
    verb = "removed" if report.applied else "would remove"
    lines = [f"purge {report.selection.describe()} via {report.where}"]
    for part in report.tiers:
        if part.error:
            lines.append(f"  tier {part.tier}: not searched: {part.error}")
            continue
        lines.append(f"  tier {part.tier}: {verb} {part.objects} values, {_size(part.nbytes)}")
        if part.namespace_unknown:
            lines.append(
                f"  tier {part.tier}: {part.namespace_unknown} values record no namespace "
                "(stored before namespace tags); kept"
            )
    lines.extend(f"  note: {note}" for note in report.notes)
    total = f"{verb} {report.objects} values, {_size(report.nbytes)} in all"
    lines.append(total if report.applied else f"{total}; nothing removed yet: pass --yes to remove them")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"
