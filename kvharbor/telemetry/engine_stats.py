"""The engine's kvharbor stats, defined once: names, help, how ranks merge, how they are shown.

The engine side counts on vLLM's own stats path: workers and the scheduler count
each step's numbers in a dict keyed by these names (`KVHarborStats`), vLLM merges
them across workers and hands them to `KVHarborPromMetrics`, which keeps them as
``vllm:`` series in the engine's registry (where ``LLM.get_metrics()`` and vLLM's
``/metrics`` find them). Both classes, the docs test and the counters that feed
them read `ENGINE_STATS`; no other list of these names is kept by hand.

This module imports nothing of vLLM: the docs and their test read it anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "vllm:kvharbor_"


class Merge(enum.Enum):
    """How one stat of several workers (and steps) becomes one number."""

    SUM = "sum"
    """A count: summed; exported as a counter ``vllm:kvharbor_<name>_total``."""
    MAX = "max"
    """A state: the largest; exported as a gauge ``vllm:kvharbor_<name>``."""


class Shown(enum.Enum):
    """How a stat appears in vLLM's ``KV Transfer metrics:`` log line (`KVHarborStats.reduce`)."""

    COUNT = "count"
    MIB = "MiB"
    """Bytes as MiB, under ``<name less _bytes>_MiB``."""
    MS_AVERAGE = "ms_avg"
    """Seconds as milliseconds per event of ``per``, under ``<name less _seconds>_ms_avg``."""
    HIDDEN = "hidden"


@dataclass(frozen=True, slots=True)
class EngineStat:
    name: str
    help: str
    merge: Merge = Merge.SUM
    shown: Shown = Shown.COUNT
    per: str = ""
    """For `Shown.MS_AVERAGE`: the count stat the seconds are averaged over."""
    exported: bool = True

    @property
    def series(self) -> str:
        """The name of its series in the engine's ``/metrics``."""
        return f"{PREFIX}{self.name}_total" if self.merge is Merge.SUM else f"{PREFIX}{self.name}"

    @property
    def shown_as(self) -> str:
        """Its key in the log line's figures."""
        if self.shown is Shown.MIB:
            return self.name.removesuffix("_bytes") + "_MiB"
        if self.shown is Shown.MS_AVERAGE:
            return self.name.removesuffix("_seconds") + "_ms_avg"
        return self.name


ENGINE_STATS: tuple[EngineStat, ...] = (
    EngineStat("lookups", "Requests whose prompt chunks were looked up in kvharbor"),
    EngineStat("lookup_chunks", "Prompt chunks looked up in kvharbor"),
    EngineStat("hit_chunks", "Prompt chunks kvharbor promised: stored, and in RAM or read back intact"),
    EngineStat("verified_chunks", "Stored chunks outside RAM read back intact before they were promised"),
    EngineStat(
        "unverified_chunks",
        "Stored chunks not promised (damaged, of the wrong size, or not read back within engine.verify_wait_ms); "
        "recomputed",
    ),
    EngineStat(
        "read_back_skipped_chunks",
        "Stored chunks outside RAM not read back: reading them was predicted slower than recomputing them; recomputed",
    ),
    EngineStat(
        "stateless_chunks",
        "Stored chunks of a hybrid model past the last chunk end with a stored Mamba-type state: not restorable "
        "without it; recomputed",
    ),
    EngineStat("loaded_chunks", "Chunks restored from kvharbor into the KV cache"),
    EngineStat("loaded_states", "Mamba-type states restored from kvharbor (hybrid models; one per restore)"),
    EngineStat("loaded_bytes", "Bytes restored from kvharbor into the KV cache (chunks and states)", shown=Shown.MIB),
    EngineStat(
        "load_seconds",
        "Seconds spent restoring chunks (on the engine's critical path)",
        shown=Shown.MS_AVERAGE,
        per="loads",
    ),
    EngineStat("loads", "Steps that restored chunks", shown=Shown.HIDDEN),
    EngineStat("stored_chunks", "Chunks newly stored in kvharbor"),
    EngineStat("stored_states", "Mamba-type states at a chunk end newly stored in kvharbor (hybrid models)"),
    EngineStat("stored_bytes", "Bytes newly stored in kvharbor (chunks and states)", shown=Shown.MIB),
    EngineStat("save_seconds", "Seconds spent storing chunks (behind the engine)", shown=Shown.MS_AVERAGE, per="saves"),
    EngineStat("saves", "Steps whose chunks were stored", shown=Shown.HIDDEN),
    EngineStat(
        "load_errors",
        "Promised blocks that kvharbor could not deliver after all (recomputed; vLLM's own cached-token counts "
        "still include them)",
    ),
    EngineStat("unsalted_skipped", "Requests not cached because engine.require_cache_salt is on and they had no salt"),
    EngineStat("bad_salt_skipped", "Requests not cached because their cache_salt was not a string"),
    EngineStat("short_prompts", "Prompts shorter than one chunk (nothing to look up)"),
    EngineStat(
        "window_unsaved",
        "Chunks not saved because their blocks had left the sliding window (future misses)",
        shown=Shown.HIDDEN,
    ),
    EngineStat(
        "chose_recompute", "Requests whose stored prefix was recomputed because loading it was predicted slower"
    ),
    EngineStat("loads_cut", "Restores stopped part-way because the rest would arrive slower than it recomputes"),
    EngineStat(
        "save_dropped",
        "Chunks not saved because the saves fell behind the storage: the save queue (engine.save_queue_steps_max), "
        "the save staging (engine.save_staging_mb_max) or the gateway's room (gateway.ring_wait_ms) was full; "
        "future misses, the engine's steps never wait for them",
    ),
    EngineStat(
        "prefill_flops", "Prefill FLOPs of the timed forward passes (steps that loaded nothing)", shown=Shown.HIDDEN
    ),
    EngineStat(
        "prefill_seconds",
        "Seconds of the timed forward passes; prefill_flops / prefill_seconds is the measured rate",
        shown=Shown.HIDDEN,
    ),
    EngineStat(
        "cache_off",
        "1 when the external KV cache is off on some rank (the gateway failed); restart to turn it back on",
        merge=Merge.MAX,
    ),
    EngineStat(
        "saves_pending",
        "Saves some worker has not counted yet: it keeps the engine stepping until they are (see `worker`)",
        merge=Merge.MAX,
        shown=Shown.HIDDEN,
        exported=False,
    ),
)

BY_NAME = {stat.name: stat for stat in ENGINE_STATS}


def check_names(names: Iterable[str], where: str) -> None:
    """Raise if a counter that feeds the stats (``where``) has a name the table lacks: its
    numbers would reach no series and no log line."""
    unknown = sorted(set(names) - BY_NAME.keys())
    if unknown:
        raise ValueError(f"{where} counts {', '.join(unknown)}, not in kvharbor.telemetry.engine_stats.ENGINE_STATS")


def _check_table() -> None:
    if len(BY_NAME) != len(ENGINE_STATS):
        raise ValueError("ENGINE_STATS names a stat twice")
    for stat in ENGINE_STATS:
        if stat.shown is Shown.MS_AVERAGE and BY_NAME.get(stat.per) is None:
            raise ValueError(f"engine stat {stat.name} is averaged over {stat.per!r}, not a stat")


_check_table()
