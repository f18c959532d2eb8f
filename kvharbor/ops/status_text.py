"""The human form of ``kvharbor status``: a `GatewayStatus`, or what the disk holds when
no gateway answers. Section titles in the left column, one fact per line."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvharbor.cache.tier import TierStatus
from kvharbor.gateway.status import GatewayStatus, HitRate, RegisteredLayout
from kvharbor.hal.base import CardStatus
from kvharbor.ops.disk import TierOnDisk

_TITLE = 9
"""Width of the section column."""


def mib(nbytes: int | None) -> str:
    if nbytes is None or nbytes < 0:
        return "?"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def when(at_s: float, now_s: float | None = None) -> str:
    """A wall-clock time in UTC, with how long ago."""
    now_s = time.time() if now_s is None else now_s
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at_s))
    ago = max(0.0, now_s - at_s)
    return f"{stamp} ({ago:.0f} s ago)" if ago < 120 else f"{stamp} ({ago / 60:.0f} min ago)"


def _lines(title: str, lines: Sequence[str]) -> list[str]:
    out = []
    for i, line in enumerate(lines or ["-"]):
        out.append(f"{(title if i == 0 else ''):<{_TITLE}}{line}")
    return out


def _rate(hits: int, asked: int, rate: float | None) -> str:
    return "no lookups" if rate is None else f"{100 * rate:.1f}% ({hits} of {asked} tokens)"


def hit_rate_text(rate: HitRate) -> list[str]:
    return [
        f"recent {rate.window_s:g} s: {_rate(rate.recent_hit_tokens, rate.recent_lookup_tokens, rate.recent)}",
        f"total: {_rate(rate.hit_tokens, rate.lookup_tokens, rate.total)}, {rate.lookups} lookups",
    ]


def layout_text(layout: RegisteredLayout, served: bool = True) -> str:
    """``served``: the layout is one a running gateway lists (it then says whether it was
    registered in its run); else one read from a tier's registry file."""
    seen = (", this run" if layout.this_run else ", before this run") if served else ""
    return f"{layout.short}: by {layout.registered_by!r} {when(layout.registered_at_s)}{seen}"


def layouts_text(status: GatewayStatus) -> list[str]:
    """Each registered layout with its objects per tier, then the objects of digests that
    no registered layout explains, per tier (`TierStatus.layouts`)."""
    tiers = status.store.tiers
    registered = {layout.digest for layout in status.layouts}
    lines = []
    for layout in status.layouts:
        held = [f"{tier.name} {tier.layouts[layout.digest]}" for tier in tiers if layout.digest in tier.layouts]
        lines.append(f"{layout_text(layout)}; objects: {', '.join(held) if held else 'none'}")
    unexplained = []
    for tier in tiers:
        counts = [objects for digest, objects in tier.layouts.items() if digest not in registered]
        if counts:
            digests = f"{len(counts)} digest{'s' if len(counts) > 1 else ''}"
            unexplained.append(f"{tier.name} {sum(counts)} ({digests})")
    if unexplained:
        lines.append(f"unregistered: objects: {', '.join(unexplained)}")
    return lines or ["none registered"]


def card_text(name: str, card: CardStatus) -> str:
    temperature = "?" if math.isnan(card.temperature_c) else f"{card.temperature_c:.0f} C"
    return (
        f"{name}: {card.driver}, service {card.service}, firmware {card.firmware_version}, temperature "
        f"{temperature}, supercap {card.supercap}, CapacityUsage {card.capacity_usage.value}, "
        f"{mib(card.used_bytes)} of {mib(card.capacity_bytes)}, keys {card.keys} of {card.keys_max}, "
        f"key eviction {'on' if card.key_eviction else 'off'}"
    )


def fill_text(tier: TierStatus) -> str:
    """How full a tier is: what its objects take of its budget and, where the device's
    allocation adds to their bytes (whole pages, slab slots), their bytes and that overhead."""
    fill = f"{mib(tier.allocated_bytes)} of {mib(tier.capacity_bytes)}"
    if tier.allocated_bytes <= tier.used_bytes or tier.used_bytes <= 0:
        return fill
    overhead = tier.allocated_bytes / tier.used_bytes - 1
    return f"{fill} taken ({mib(tier.used_bytes)} in objects, +{100 * overhead:.1f}% allocation)"


def write_queue_text(tier: TierStatus) -> str | None:
    """A tier's write queue in one line; None for a tier written at once."""
    queue, counts = tier.write_queue, tier.counters
    if queue is None:
        return None
    return (
        f"write queue: {queue.depth} of {queue.depth_max} writes, {mib(queue.nbytes)} of {mib(queue.bytes_max)} "
        f"({queue.workers} workers); {counts.async_flushed} written, {counts.async_dropped} dropped (queue full), "
        f"{counts.async_unflushed} lost at shutdown"
    )


def codec_text(tier: TierStatus) -> str | None:
    """What a tier's codec achieved in one line; None before it compressed anything."""
    codec = tier.counters.codec
    if codec.ratio is None:
        return None

    def speed(mb_per_s: float | None) -> str:
        return "-" if mb_per_s is None else f"{mb_per_s:.0f} MiB/s"

    return (
        f"codec {tier.codec}: ratio {codec.ratio:.2f} over {codec.encoded_values} values; "
        f"compresses at {speed(codec.encode_mb_per_s)}, decompresses at {speed(codec.decode_mb_per_s)}"
    )


def render_status(status: GatewayStatus) -> str:
    out = _lines(
        "gateway",
        [
            f"pid {status.pid}, release {status.release} (protocol {status.protocol}), serving {status.socket}",
            f"config {status.config_digest}, started {when(status.started_at_s)}, "
            f"start-clean={int(status.start_clean)}",
            f"dashboard {status.dashboard_url or 'not served'}; {status.access}",
        ],
    )
    clients = [f"{c.name!r} (pid {c.pid})" for c in status.clients]
    off = status.ranks_cache_off
    out += _lines(
        "clients",
        [
            f"{len(clients)} attached" + (": " + ", ".join(clients) if clients else ""),
            "ranks with the cache off: "
            + (", ".join(f"{d.name!r} (pid {d.pid}, since {when(d.at_s)})" for d in off) if off else "none seen"),
            f"({status.ranks_off_note})",
        ],
    )
    out += _lines("hit rate", hit_rate_text(status.hit_rate))
    tiers = []
    for tier in status.store.tiers:
        evictions, corrupt = tier.counters.evictions, tier.counters.corrupt
        tiers.append(
            f"{tier.name} [{tier.device_type}{', fallback' if tier.fallback else ''}]: "
            f"{status.tier_conditions()[tier.name]}; {fill_text(tier)}, {tier.keys} objects, "
            f"{evictions} evictions, {corrupt} corrupt"
        )
        tiers += [f"  {line}" for line in (write_queue_text(tier), codec_text(tier)) if line]
    tiers += [f"{name}: {why}" for name, why in status.store.skipped.items()]
    out += _lines("tiers", tiers)
    if status.cards:
        out += _lines("card", [card_text(name, card) for name, card in status.cards.items()])
    out += _lines("layouts", layouts_text(status))
    refill = status.refill
    out += _lines(
        "refill", [f"{refill.state}: {refill.objects} objects, {mib(refill.bytes)} in {refill.seconds:.1f} s"]
    )
    return "\n".join(out)


def render_on_disk(tiers: Sequence[TierOnDisk]) -> str:
    lines = []
    for tier in tiers:
        held = "?" if tier.objects is None else f"{tier.objects} objects, {mib(tier.used_bytes)}"
        lines.append(f"{tier.name} at {tier.path}: {held}" + (f" ({tier.problem})" if tier.problem else ""))
        lines += [f"  layout {layout_text(layout, served=False)}" for layout in tier.layouts]
    return "\n".join(_lines("on disk", lines or ["no file tier is configured"]))
