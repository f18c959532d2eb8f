"""A `GatewayStatus` with every section filled, for the tests of its forms (JSON, the wire)."""

from __future__ import annotations

from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.refill import RefillStatus
from kvharbor.cache.store import StoreStatus
from kvharbor.cache.tier import TierStatus
from kvharbor.cache.writequeue import WriteQueueStatus
from kvharbor.gateway.status import (
    AttachedClient,
    DetachedClient,
    GatewayStatus,
    HitRate,
    RegisteredLayout,
    ShmStatus,
)
from kvharbor.hal.base import CapacityUsage, CardEventRecord, CardStatus
from kvharbor.telemetry.metrics import CodecStats, HitCounts, TierCounts

LAYOUT = LayoutFingerprint(model_id="tiny", chunk_size=16, kv_shapes=("L0:2x4x8:float32",), extra=(("device", "cpu"),))

UNREGISTERED = "ab" * 16
"""A digest of stored objects that no registered layout explains."""


def sample_status(temperature_c: float = 41.5) -> GatewayStatus:
    tier = TierStatus(
        name="card", device_type="nvme", codec="none", capacity_bytes=1 << 30, used_bytes=1 << 20,
        allocated_bytes=(1 << 20) + 3 * 4096, keys=3,
        health="degraded", health_detail="CapacityUsage WARNING", breaker="closed",
        counters=TierCounts(
            puts=3, evictions=1, async_dropped=2, async_flushed=5, async_unflushed=1,
            codec=CodecStats.of((4, 4000, 1000, 0.001), (1, 1000, 250, 0.0005)),
        ),
        device_statuses={"1/81h": 2}, layouts={LAYOUT.digest().hex(): 2, UNREGISTERED: 1},
        write_queue=WriteQueueStatus(depth=3, nbytes=3 << 20, depth_max=256, bytes_max=1 << 30, workers=2),
    )  # fmt: skip
    card = CardStatus(
        driver="sim", service="running", firmware_version="1.0", temperature_c=temperature_c, supercap="ok",
        flash_spare_percent=99.0, flash_wear_percent=1.0, capacity_usage=CapacityUsage.WARNING,
        used_bytes=1 << 20, capacity_bytes=1 << 30, keys=3, keys_max=1000, key_eviction=False, paths=("/dev/x",),
    )  # fmt: skip
    return GatewayStatus(
        release="0.0.0", protocol=8, pid=123, socket="/run/kvharbor/gw.sock", config_digest="0123456789ab",
        access="gateway.access is owner-only: only me", started_at_s=1.7e9, start_clean=True,
        shm=ShmStatus("/dev/shm/x", 1 << 26, 1 << 25, 1 << 24, 2, 0),
        clients=[AttachedClient("vllm-worker rank 0", 456)],
        detached=[DetachedClient("vllm-scheduler", 789, 1.7e9 + 5, unclean=True, process_alive=False)],
        transfers_open=1, counters={"clients_total": 2}, rejected={"MALFORMED": 1},
        hit_rate=HitRate(300.0, 64, 32, 128, 48, 4),
        store=StoreStatus([tier], "write_through", HitCounts(lookups=4), {"files": "unavailable: no such directory"}),
        cards={"card": card},
        card_events={"card": [CardEventRecord(7, 12.5, 3002, "card full", "a write was refused: the card is full")]},
        refill=RefillStatus("done", 1, 4096, 0, 0.5, True),
        layouts=[RegisteredLayout(LAYOUT.digest().hex(), LAYOUT, "vllm-worker rank 0", 1.7e9, True)],
        dashboard_url="http://127.0.0.1:9400/",
    )  # fmt: skip
