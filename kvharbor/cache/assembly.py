"""From a validated config to a running `TieredStore`: open, probe, index, clean.

Start-up is where misconfiguration is cheapest to explain. Each tier is opened
and probed (write, read back, delete a small object through the real object
format); a tier that fails is skipped with one log line that says why, and
the cache runs on the tiers that work. With no working tier the store is
empty and every lookup is a miss: the engine still serves.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES, Codec
from kvharbor.cache.index import MemoryIndex, TierIndex
from kvharbor.cache.keys import card_layout
from kvharbor.cache.probe import ProbeFailed, probe_device
from kvharbor.cache.store import TieredStore
from kvharbor.cache.tier import Tier
from kvharbor.config import MIB, Config, NvmeTierSection, TierSection
from kvharbor.hal.base import CardDevice, Device, DeviceError, PersistentDevice, SelfDescribingDevice
from kvharbor.hal.registry import open_device
from kvharbor.telemetry.log import get_logger
from kvharbor.telemetry.metrics import GatewayMetrics, TierMetrics

_log = get_logger("kvharbor.cache.assembly")


def open_index(device: Device, tier_name: str) -> TierIndex:
    if isinstance(device, PersistentDevice):
        from kvharbor.cache.manifest import open_manifest

        return open_manifest(device, tier_name)
    index = MemoryIndex()
    if isinstance(device, SelfDescribingDevice):
        from kvharbor.cache.recovery import recover_entries

        recovered = recover_entries(device)
        index.rebuild(recovered.entries)
        _log.info(
            "kvharbor: tier %s: %d values found on the device (%d objects scanned, %d damaged dropped, "
            "%d of another format version kept)",
            tier_name,
            len(recovered.entries),
            recovered.objects,
            recovered.dropped,
            recovered.foreign,
        )
    return index


def device_limit(section: TierSection, config: Config) -> int:
    """The largest object (header included) a tier's device must take."""
    value_max = config.card.fragment_bytes if section.type == "nvme" else config.storage.value_mb_max * MIB
    return value_max + HEADER_BYTES


def tier_capacity(section: TierSection, device: Device) -> int:
    """The tier's budget in bytes: its ``capacity_gb``, or for a card tier without one the
    device's capacity; raises ValueError for a card tier asking more than its device has."""
    if not isinstance(section, NvmeTierSection):
        return section.capacity_bytes
    device_bytes = device.usage().capacity_bytes
    if section.capacity_gb is None:
        return device_bytes
    if section.capacity_bytes > device_bytes:
        raise ValueError(
            f"tier '{section.name}': capacity_gb {section.capacity_gb:g} exceeds the device's capacity "
            f"({device_bytes / 2**30:g} GiB); leave capacity_gb out to use all of it"
        )
    return section.capacity_bytes


def open_tier(
    section: TierSection, config: Config, device: Device | None = None, metrics: TierMetrics | None = None
) -> Tier:
    """Open one configured tier, counting in ``metrics`` (see `Tier`); raises ValueError,
    DeviceError or ProbeFailed.

    A card device gets the `card` section's settings first: key eviction as
    configured, and its fragment size (its largest object) in the layout of
    everything the tier stores.
    """
    storage = config.storage
    if device is None:
        device = open_device(section, config.card, device_limit(section, config))
    codec = Codec.from_name(section.codec)
    is_card = isinstance(device, CardDevice)
    try:
        capacity_bytes = tier_capacity(section, device)
        if isinstance(device, CardDevice):
            device.set_key_eviction(config.card.key_eviction)
            if config.card.key_eviction and not device.evicts_on_its_own:
                _log.info(
                    "kvharbor: tier %s: the device has no key eviction of its own; card.key_eviction is done "
                    "by the tier (least recently used within its %g GiB)",
                    section.name,
                    capacity_bytes / 2**30,
                )
        if storage.probe:
            probe_device(device, codec)
        index = open_index(device, section.name)
    except BaseException:
        device.close()
        raise
    cb = storage.backpressure.circuit_breaker
    breaker = CircuitBreaker(
        BreakerSettings(cb.failure_ratio, cb.window, cb.cooldown_s, cb.probe_backoff_factor, cb.probe_interval_max_s)
    )
    reopen = (lambda: open_index(device, section.name)) if isinstance(device, PersistentDevice) else None
    return Tier(
        section.name,
        device,
        index,
        capacity_bytes,
        breaker,
        codec,
        section.type,
        reopen,
        layout=card_layout(device.max_value_bytes) if is_card else b"",
        device_evicts=isinstance(device, CardDevice) and device.evicts_on_its_own and config.card.key_eviction,
        metrics=metrics,
    )


def open_store(
    config: Config,
    start_clean: bool = False,
    devices: Mapping[str, Device] | None = None,
    metrics: GatewayMetrics | None = None,
) -> TieredStore:
    """Open every configured tier; ``devices`` supplies ready drivers by tier name
    (the gateway's shared-memory RAM tiers), the registry opens the rest. The store
    and its tiers count in ``metrics`` (the gateway's), or in a registry of their own."""
    metrics = metrics if metrics is not None else GatewayMetrics(hit_rate_window_s=config.telemetry.hit_rate_window_s)
    tiers: list[Tier] = []
    skipped: dict[str, str] = {}
    for section in config.storage.tiers:
        try:
            tier = open_tier(section, config, (devices or {}).get(section.name), metrics.tiers.tier(section.name))
        except ProbeFailed as err:
            _log.warning("kvharbor: tier %s failed its startup probe (%s); skipping", section.name, err)
            skipped[section.name] = f"probe failed at start: {err}"
            continue
        except (ValueError, DeviceError, OSError) as err:
            _log.warning("kvharbor: tier %s unavailable: %s; skipping", section.name, err)
            skipped[section.name] = f"unavailable: {err}"
            continue
        if start_clean:
            removed = tier.clear()
            _log.info(
                "kvharbor: tier %s emptied at start (--start-clean=1): %d objects removed",
                tier.name,
                removed,
            )
        tiers.append(tier)
    if not tiers:
        _log.error("kvharbor: no usable storage tier; every lookup is a miss until the tiers are fixed")
    else:
        _log.info(
            "kvharbor: storage ready: %s (%s)",
            ", ".join(f"{t.name}[{t.device_type}, {t.capacity_bytes / 2**30:g} GiB]" for t in tiers),
            config.storage.write_policy,
        )
    return TieredStore(tiers, config.storage.write_policy, metrics.hits, skipped)
