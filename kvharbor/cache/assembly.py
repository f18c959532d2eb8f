"""From a validated config to a running `TieredStore`: open, probe, index, clean.

Start-up is where misconfiguration is cheapest to explain. Each tier is opened
and probed (write, read back, delete a small object through the real object
format); a tier that fails is skipped with one log line that says why, and
the cache runs on the tiers that work. With no persistent tier working (or
none configured) writes go to a local fallback directory (`open_fallback`,
``storage.fallback_path``). With no working tier at all the store is empty and
every lookup is a miss: the engine still serves.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES, Codec
from kvharbor.cache.index import MemoryIndex, TierIndex
from kvharbor.cache.keys import card_layout
from kvharbor.cache.probe import ProbeFailed, probe_device
from kvharbor.cache.shared import SharedIndex, SharedSettings
from kvharbor.cache.store import AsyncWrites, TieredStore
from kvharbor.cache.tier import Tier
from kvharbor.cache.writequeue import WriteQueueSettings
from kvharbor.config import FALLBACK_TIER, MIB, Config, FileTierSection, NvmeTierSection, S3TierSection, TierSection
from kvharbor.hal.base import CardDevice, Device, DeviceError, PersistentDevice, SelfDescribingDevice, SharedDevice
from kvharbor.hal.file import FileDevice
from kvharbor.hal.registry import open_device
from kvharbor.telemetry.log import get_logger
from kvharbor.telemetry.metrics import GatewayMetrics, TierMetrics

_log = get_logger("kvharbor.cache.assembly")


def open_index(device: Device, tier_name: str, section: TierSection | None = None) -> TierIndex:
    """The index of ``device``: a shared tier's (``section`` gives its settings), a
    manifest beside a persistent device, or one in memory (rebuilt from a self-describing
    device's headers)."""
    if isinstance(device, SharedDevice):
        if not isinstance(section, S3TierSection):
            raise TypeError(f"tier '{tier_name}': a shared device needs its s3 tier section")
        return SharedIndex(device, section.name, SharedSettings.of(section))
    if isinstance(device, PersistentDevice):
        from kvharbor.cache.manifest import open_manifest

        manifest = open_manifest(device, tier_name)
        _forget_interrupted(manifest, device, tier_name)
        return manifest
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


def _forget_interrupted(index: TierIndex, device: Device, tier_name: str) -> None:
    """Drop the entries of writes whose writer died before the value was in place.

    A tier admits a value to its index before it writes it (admission reserves the
    room), so a writer killed mid-write leaves an entry whose file never appeared;
    its temp file, removed when the device opened, names the key. Only a dead
    writer's temp files are removed, and a key is admitted once, so no live
    writer's entry is dropped. (A writer killed between admission and creating its
    temp file leaves no trace: that entry goes at its first read, which misses.)
    """
    if not isinstance(device, FileDevice) or not device.interrupted_keys:
        return
    keys = device.interrupted_keys
    gone = [key for key, here in zip(keys, device.exists(keys), strict=True) if not here]
    if gone:
        index.remove(gone)
        _log.info(
            "kvharbor: tier %s: %d values whose write was interrupted (writer killed) dropped from its index",
            tier_name,
            len(gone),
        )


def _outlives_the_gateway(device: Device) -> bool:
    """A persistent tier's device: files (`PersistentDevice`), a card (`CardDevice`; in block
    mode its objects are found on it again when it opens, `SelfDescribingDevice`), or a
    store that hosts share (`SharedDevice`: an S3 bucket)."""
    return isinstance(device, (PersistentDevice, SelfDescribingDevice, SharedDevice, CardDevice))


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
    section: TierSection,
    config: Config,
    device: Device | None = None,
    metrics: TierMetrics | None = None,
    fallback: bool = False,
) -> Tier:
    """Open one configured tier, counting in ``metrics`` (see `Tier`); raises ValueError,
    DeviceError or ProbeFailed. ``fallback``: it is the store's fallback tier (`open_fallback`).

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
        index = open_index(device, section.name, section)
    except BaseException:
        device.close()
        raise
    cb = storage.backpressure.circuit_breaker
    breaker = CircuitBreaker(
        BreakerSettings(cb.failure_ratio, cb.window, cb.cooldown_s, cb.probe_backoff_factor, cb.probe_interval_max_s)
    )
    reopen = (lambda: open_index(device, section.name)) if isinstance(device, PersistentDevice) else None
    tier = Tier(
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
        fallback=fallback,
    )
    if isinstance(index, SharedIndex):
        index.count_evictions(tier.metrics.evicted)  # The shared budget's sweeps evict, not `Tier.drop`.
    return tier


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
            _empty_at_start(tier)
        tiers.append(tier)
    if config.storage.fallback_path is not None and not any(_outlives_the_gateway(t.device) for t in tiers):
        fallback = open_fallback(config, skipped, metrics, start_clean)
        if fallback is not None:
            tiers.append(fallback)
    if not tiers:
        _log.error("kvharbor: no usable storage tier; every lookup is a miss until the tiers are fixed")
    else:
        _log.info(
            "kvharbor: storage ready: %s (%s)",
            ", ".join(f"{t.name}[{t.device_type}, {t.capacity_bytes / 2**30:g} GiB]" for t in tiers),
            config.storage.write_policy,
        )
    return TieredStore(tiers, config.storage.write_policy, metrics.hits, skipped, async_writes(config))


def async_writes(config: Config) -> AsyncWrites:
    """The tiers written through a queue and the queues' limits, from ``storage``."""
    storage = config.storage
    return AsyncWrites(
        tiers=frozenset(section.name for section in storage.tiers if section.async_writes),
        queue=WriteQueueSettings(storage.async_queue_depth, storage.async_queue_mb * MIB, storage.async_workers),
        shutdown_deadline_s=storage.async_shutdown_deadline_s,
    )


def open_fallback(
    config: Config, skipped: Mapping[str, str], metrics: GatewayMetrics, start_clean: bool
) -> Tier | None:
    """The file tier at ``storage.fallback_path``, for a store that opened no persistent tier;
    None (said in the log) where it does not open either."""
    storage = config.storage
    assert storage.fallback_path is not None
    section = FileTierSection(name=FALLBACK_TIER, path=storage.fallback_path, capacity_gb=storage.fallback_capacity_gb)
    why = "skipped: " + ", ".join(skipped) if skipped else "none configured"
    try:
        tier = open_tier(section, config, None, metrics.tiers.tier(FALLBACK_TIER), fallback=True)
    except (ProbeFailed, ValueError, DeviceError, OSError) as err:
        _log.error(
            "kvharbor: no persistent tier available (%s), and the local fallback %s does not open either (%s); "
            "nothing outlives the gateway (storage.fallback_path)",
            why,
            storage.fallback_path,
            err,
        )
        return None
    if start_clean:
        _empty_at_start(tier)
    _log.warning(
        "kvharbor: no persistent tier available (%s); writing KV to local fallback %s (%g GiB, "
        "storage.fallback_path, storage.fallback_capacity_gb)",
        why,
        tier.device.state_dir if isinstance(tier.device, PersistentDevice) else storage.fallback_path,
        storage.fallback_capacity_gb,
    )
    return tier


def _empty_at_start(tier: Tier) -> None:
    removed = tier.clear()
    _log.info("kvharbor: tier %s emptied at start (--start-clean=1): %d objects removed", tier.name, removed)
