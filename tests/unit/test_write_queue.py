"""Asynchronous writes to a slow tier (`kvharbor.cache.writequeue`) through the real store.

The slow tier is a real `RamDevice` whose puts wait on an Event the test holds
(`GatedDevice`): a put of the store returns while the tier below has not been
written, and the test decides when it is. No sleeps: every wait is on the gate's
own events or the queue's `settle`, with a bound.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvharbor.cache.assembly import open_store
from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.format import HEADER_BYTES, Codec
from kvharbor.cache.index import MemoryIndex
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.cache.store import AsyncWrites, TieredStore, WritePolicy
from kvharbor.cache.tier import Tier
from kvharbor.cache.writequeue import WriteQueueSettings
from kvharbor.config import ConfigError, validate_config
from kvharbor.hal.base import Buffer
from kvharbor.hal.checksum import checksum
from kvharbor.hal.ram import RamDevice
from kvharbor.telemetry.metrics import CodecStats, GatewayMetrics

FINGERPRINT = LayoutFingerprint(model_id="test/model", chunk_size=16).digest()
VALUE_BYTES = 1000
OBJECT_BYTES = HEADER_BYTES + VALUE_BYTES
WAIT_S = 30.0
"""Bound of every wait; far above what a healthy run needs."""


class GatedDevice(RamDevice):
    """A RAM device whose puts wait until the test opens the gate; ``entered`` counts the
    puts that reached it (a worker is inside the device once it moves)."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self.gate = threading.Event()
        self.gate.set()
        self._entered = threading.Condition()
        self.entered = 0
        self.written: list[bytes] = []

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        with self._entered:
            self.entered += 1
            self._entered.notify_all()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        super().put(key, parts)
        self.written.append(bytes(key))

    def wait_entered(self, count: int) -> None:
        with self._entered:
            assert self._entered.wait_for(lambda: self.entered >= count, WAIT_S), f"{count} puts never arrived"


def make_tier(name: str, values: int, device: RamDevice, metrics: GatewayMetrics, codec: Codec = Codec.NONE) -> Tier:
    capacity = values * OBJECT_BYTES
    return Tier(
        name, device, MemoryIndex(), capacity, CircuitBreaker(BreakerSettings()), codec,
        metrics=metrics.tiers.tier(name),
    )  # fmt: skip


class Rig:
    """A RAM tier over a gated slow tier written asynchronously, counting in one registry."""

    def __init__(
        self,
        policy: WritePolicy = "write_through",
        upper_values: int = 100,
        depth_max: int = 16,
        bytes_max: int = 1 << 20,
        workers: int = 1,
        deadline_s: float = WAIT_S,
    ) -> None:
        self.metrics = GatewayMetrics()
        self.slow = GatedDevice("slow", 100 * OBJECT_BYTES)
        self.upper = make_tier("ram", upper_values, RamDevice("ram", upper_values * OBJECT_BYTES), self.metrics)
        self.lower = make_tier("slow", 100, self.slow, self.metrics)
        settings = AsyncWrites(frozenset({"slow"}), WriteQueueSettings(depth_max, bytes_max, workers), deadline_s)
        self.store = TieredStore([self.upper, self.lower], policy, self.metrics.hits, async_writes=settings)

    def scrape(self) -> dict[tuple[str, str], float]:
        """``(sample name, tier label)`` -> value, as a scraper parses ``/metrics``."""
        text = generate_latest(self.metrics.registry).decode()
        return {
            (sample.name, sample.labels.get("tier", "") + ":" + sample.labels.get("op", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.slow.gate.set()
    made.store.close()


def new_key() -> ChunkKey:
    return ChunkKey(os.urandom(16))


def held(tier: Tier, key: bytes) -> bool:
    return tier.index.get(key) is not None and tier.device.size(key) is not None


def settled(store: TieredStore) -> None:
    assert store.settle(WAIT_S), "the write queue did not drain"


# ---- the put path ---------------------------------------------------------------------


def test_a_put_returns_before_the_slow_tier_has_it_and_the_tier_gets_it_from_the_queue(rig: Rig) -> None:
    rig.slow.gate.clear()
    key, value = new_key(), os.urandom(VALUE_BYTES)
    assert rig.store.put(key, FINGERPRINT, value)  # Returns with the slow tier's write blocked.
    rig.slow.wait_entered(1)
    assert held(rig.upper, key) and not held(rig.lower, key)
    queue = rig.store.status().tiers[1].write_queue
    assert queue is not None and (queue.depth, queue.nbytes) == (1, VALUE_BYTES)
    assert rig.store.status().tiers[0].write_queue is None, "the first tier is written at once"
    rig.slow.gate.set()
    settled(rig.store)
    assert held(rig.lower, key)
    assert bytes(rig.lower.read(key, FINGERPRINT) or b"") == value
    counts = rig.lower.counters
    assert (counts.puts, counts.async_flushed, counts.async_dropped) == (1, 1, 0)


def test_a_queued_write_keeps_the_checksum_its_writer_gave(rig: Rig) -> None:
    """The slow tier stores the checksum it was given with the value (a wrong one, to see
    it): its copy then fails its check on a read, while the first tier's did too."""
    key, value = new_key(), os.urandom(VALUE_BYTES)
    assert rig.store.put(key, FINGERPRINT, value, value_checksum=checksum(value) ^ 1)
    settled(rig.store)
    assert held(rig.lower, key)
    assert rig.lower.read(key, FINGERPRINT) is None
    assert rig.lower.counters.corrupt == 1
    good = new_key()
    assert rig.store.put(good, FINGERPRINT, value, value_checksum=checksum(value))
    settled(rig.store)
    assert bytes(rig.lower.read(good, FINGERPRINT) or b"") == value


def test_the_queue_copies_a_value_whose_buffer_is_reused_meanwhile(rig: Rig) -> None:
    """The bytes a put came from (a client's shared memory) may change once it returns."""
    rig.slow.gate.clear()
    key, value = new_key(), os.urandom(VALUE_BYTES)
    buffer = bytearray(value)
    assert rig.store.put(key, FINGERPRINT, memoryview(buffer))
    buffer[:] = bytes(VALUE_BYTES)  # Reused for the next transfer.
    rig.slow.gate.set()
    settled(rig.store)
    assert bytes(rig.lower.read(key, FINGERPRINT) or b"") == value


def test_a_full_queue_drops_writes_counts_and_says_it_once_and_never_blocks(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(depth_max=2)
    try:
        rig.slow.gate.clear()
        keys = [new_key() for _ in range(5)]
        assert rig.store.put(keys[0], FINGERPRINT, os.urandom(VALUE_BYTES))
        rig.slow.wait_entered(1)  # The one worker is inside the device: the queue holds it and one more.
        with caplog.at_level(logging.WARNING):
            for key in keys[1:]:
                assert rig.store.put(key, FINGERPRINT, os.urandom(VALUE_BYTES)), "the first tier took it"
        assert rig.lower.counters.async_dropped == 3
        said = [r.getMessage() for r in caplog.records if "write queue full" in r.getMessage()]
        assert len(said) == 1 and "storage.async_queue_depth 2" in said[0], said
        rig.slow.gate.set()
        settled(rig.store)
        assert [held(rig.lower, key) for key in keys] == [True, True, False, False, False]
        assert all(held(rig.upper, key) for key in keys)
    finally:
        rig.slow.gate.set()
        rig.store.close()


def test_the_queue_s_bytes_limit_drops_what_would_pass_it() -> None:
    rig = Rig(bytes_max=VALUE_BYTES + VALUE_BYTES // 2)
    try:
        rig.slow.gate.clear()
        first, second = new_key(), new_key()
        assert rig.store.put(first, FINGERPRINT, os.urandom(VALUE_BYTES))
        assert rig.store.put(second, FINGERPRINT, os.urandom(VALUE_BYTES))
        assert rig.lower.counters.async_dropped == 1
        queue = rig.store.status().tiers[1].write_queue
        assert queue is not None and queue.nbytes == VALUE_BYTES <= queue.bytes_max
    finally:
        rig.slow.gate.set()
        rig.store.close()


# ---- reads and deletes while queued -------------------------------------------------


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_key_queued_and_evicted_above_is_served_from_the_queue(policy: WritePolicy) -> None:
    rig = Rig(policy, upper_values=1)
    try:
        rig.slow.gate.clear()
        first, second = new_key(), new_key()
        value = os.urandom(VALUE_BYTES)
        assert rig.store.put(first, FINGERPRINT, value)
        assert rig.store.put(second, FINGERPRINT, os.urandom(VALUE_BYTES))  # Evicts the first above.
        assert not held(rig.upper, first) and not held(rig.lower, first)
        assert rig.store.lookup([first, second]) == 2, "a queued key is stored"
        assert bytes(rig.store.get(first, FINGERPRINT) or b"") == value
        assert held(rig.upper, first), "served from the queue and promoted, as a hit below is"
        rig.slow.gate.set()
        settled(rig.store)
        assert bytes(rig.lower.read(first, FINGERPRINT) or b"") == value
    finally:
        rig.slow.gate.set()
        rig.store.close()


def test_a_delete_cancels_queued_writes_and_one_under_way_is_deleted_once_it_lands(rig: Rig) -> None:
    rig.slow.gate.clear()
    writing, queued = new_key(), new_key()
    assert rig.store.put(writing, FINGERPRINT, os.urandom(VALUE_BYTES))
    rig.slow.wait_entered(1)
    assert rig.store.put(queued, FINGERPRINT, os.urandom(VALUE_BYTES))
    rig.store.delete([writing, queued])
    assert rig.store.lookup([writing]) == 0 and rig.store.lookup([queued]) == 0
    assert rig.store.get(queued, FINGERPRINT) is None
    rig.slow.gate.set()
    settled(rig.store)
    assert not held(rig.lower, writing) and not held(rig.lower, queued)
    assert rig.slow.written == [writing], "the cancelled write never reached the device"
    assert rig.store.lookup([writing]) == 0


def test_a_newer_write_of_a_key_replaces_the_queued_one(rig: Rig) -> None:
    rig.slow.gate.clear()
    blocker, key = new_key(), new_key()
    assert rig.store.put(blocker, FINGERPRINT, os.urandom(VALUE_BYTES))
    rig.slow.wait_entered(1)
    old, new = os.urandom(VALUE_BYTES), os.urandom(VALUE_BYTES)
    assert rig.store.put(key, FINGERPRINT, old)
    assert rig.store.put(key, FINGERPRINT, new)
    queue = rig.store.status().tiers[1].write_queue
    assert queue is not None and (queue.depth, queue.nbytes) == (2, 2 * VALUE_BYTES), "one copy per key"
    rig.slow.gate.set()
    settled(rig.store)
    assert bytes(rig.lower.read(key, FINGERPRINT) or b"") == new
    assert rig.slow.written == [blocker, key], "the replaced write never reached the device"


# ---- shutdown ---------------------------------------------------------------------------


def test_close_writes_the_queue_out_before_the_tiers_close(rig: Rig) -> None:
    rig.slow.gate.clear()
    keys = [new_key() for _ in range(4)]
    for key in keys:
        assert rig.store.put(key, FINGERPRINT, os.urandom(VALUE_BYTES))
    rig.slow.wait_entered(1)
    closing = threading.Thread(target=rig.store.close)
    closing.start()
    rig.slow.gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert sorted(rig.slow.written) == sorted(keys)
    assert (rig.lower.counters.async_flushed, rig.lower.counters.async_unflushed) == (4, 0)


def test_what_the_deadline_leaves_is_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(deadline_s=0.0)
    rig.slow.gate.clear()
    for _ in range(3):
        assert rig.store.put(new_key(), FINGERPRINT, os.urandom(VALUE_BYTES))
    rig.slow.wait_entered(1)
    with caplog.at_level(logging.WARNING):
        rig.store.close()  # Deadline 0: one write inside the device, two queued.
    rig.slow.gate.set()  # Let the stuck worker out.
    assert rig.lower.counters.async_unflushed == 3
    said = [r.getMessage() for r in caplog.records if "not written within" in r.getMessage()]
    assert len(said) == 1 and "3 queued write(s)" in said[0] and "storage.async_shutdown_deadline_s" in said[0]


# ---- metrics and status agree ----------------------------------------------------------


def test_the_queue_s_metrics_and_status_are_one_set_of_numbers() -> None:
    rig = Rig(depth_max=2)
    try:
        rig.slow.gate.clear()
        for _ in range(4):
            rig.store.put(new_key(), FINGERPRINT, os.urandom(VALUE_BYTES))
        rig.slow.wait_entered(1)
        samples, status = rig.scrape(), rig.store.status().tiers[1]
        assert status.write_queue is not None
        assert samples["kvharbor_tier_async_queue_depth", "slow:"] == status.write_queue.depth == 2
        assert samples["kvharbor_tier_async_queue_bytes", "slow:"] == status.write_queue.nbytes == 2 * VALUE_BYTES
        assert samples["kvharbor_tier_async_dropped_total", "slow:"] == status.counters.async_dropped == 2
        assert ("kvharbor_tier_async_queue_depth", "ram:") not in samples, "a tier written at once has no queue"
        rig.slow.gate.set()
        settled(rig.store)
        samples, status = rig.scrape(), rig.store.status().tiers[1]
        assert samples["kvharbor_tier_async_flushed_total", "slow:"] == status.counters.async_flushed == 2
        assert samples["kvharbor_tier_async_queue_depth", "slow:"] == 0
    finally:
        rig.slow.gate.set()
        rig.store.close()


def test_codec_stats_give_the_ratio_and_the_speed_in_status_and_metrics() -> None:
    metrics = GatewayMetrics()
    packed = make_tier("packed", 10, RamDevice("packed", 10 * OBJECT_BYTES), metrics, Codec.ZSTD)
    plain = make_tier("plain", 10, RamDevice("plain", 10 * OBJECT_BYTES), metrics)
    value = bytes(VALUE_BYTES // 2) + os.urandom(VALUE_BYTES // 2)  # Half compresses away.
    keys = [new_key() for _ in range(3)]
    for key in keys:
        assert packed.write(key, FINGERPRINT, value) and plain.write(key, FINGERPRINT, value)
    assert bytes(packed.read(keys[0], FINGERPRINT) or b"") == value
    codec = packed.status().counters.codec
    assert (codec.encoded_values, codec.encode_raw_bytes, codec.decoded_values) == (3, 3 * VALUE_BYTES, 1)
    assert codec.ratio is not None and 1.5 < codec.ratio == codec.encode_raw_bytes / codec.encode_stored_bytes
    assert codec.encode_mb_per_s is not None and codec.decode_mb_per_s is not None
    assert plain.status().counters.codec == CodecStats(), "codec none: nothing to measure"
    text = generate_latest(metrics.registry).decode()
    samples = {
        (s.name, s.labels.get("tier"), s.labels.get("op")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["kvharbor_tier_codec_raw_bytes_total", "packed", "encode"] == codec.encode_raw_bytes
    assert samples["kvharbor_tier_codec_stored_bytes_total", "packed", "encode"] == codec.encode_stored_bytes
    assert samples["kvharbor_tier_codec_values_total", "packed", "decode"] == 1
    assert math.isclose(samples["kvharbor_tier_codec_seconds_total", "packed", "encode"], codec.encode_seconds)
    assert math.isclose(samples["kvharbor_tier_compression_ratio", "packed", None], codec.ratio)
    assert ("kvharbor_tier_compression_ratio", "plain", None) not in samples


# ---- config -----------------------------------------------------------------------------


def test_async_writes_default_per_type_and_the_first_tier_is_always_written_at_once(tmp_path: os.PathLike[str]) -> None:
    config = validate_config(
        {
            "storage": {
                "tiers": [
                    {"name": "local", "type": "file", "path": f"{tmp_path}/a", "capacity_gb": 0.01,
                     "async_writes": True},
                    {"name": "ram", "type": "ram", "capacity_gb": 0.01},
                    {"name": "slow", "type": "file", "path": f"{tmp_path}/b", "capacity_gb": 0.01,
                     "async_writes": True},
                    {"name": "disk", "type": "file", "path": f"{tmp_path}/c", "capacity_gb": 0.01},
                    {"name": "sync", "type": "file", "path": f"{tmp_path}/d", "capacity_gb": 0.01,
                     "async_writes": False},
                ],
                "async_queue_depth": 8, "async_queue_mb": 4, "async_workers": 3,
            }
        }
    )  # fmt: skip
    assert [t.async_writes for t in config.storage.tiers] == [True, False, True, True, False]
    store = open_store(config)
    try:
        assert sorted(store.queues) == ["disk", "slow"], "never the first tier, whatever it says"
        queue = store.status().tiers[2].write_queue
        assert queue is not None and (queue.depth_max, queue.bytes_max, queue.workers) == (8, 4 << 20, 3)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("key", "bad"),
    [("async_queue_depth", 0), ("async_queue_mb", -1), ("async_workers", 0), ("async_shutdown_deadline_s", "soon")],
)
def test_a_bad_queue_setting_is_refused_naming_it(key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"storage.{key}"):
        validate_config({"storage": {key: bad}})
