"""kvharbor's numbers in vLLM's connector stats: bytes and chunks moved, and how long it took.

Workers collect them per step; vLLM aggregates them across workers and logs
``KV Transfer metrics: ...`` every stats interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_SUMMED = (
    "loaded_chunks",
    "loaded_bytes",
    "load_s",
    "loads",
    "stored_chunks",
    "stored_bytes",
    "save_s",
    "saves",
    "load_errors",
)
_MAXED = ("cache_off",)
"""1 when the external cache is off on some rank."""


def empty() -> dict[str, float]:
    return dict.fromkeys(_SUMMED + _MAXED, 0)


@dataclass
class KVHarborStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty()

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in _SUMMED:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        for name in _MAXED:
            self.data[name] = max(self.data.get(name, 0), other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "loaded_chunks": int(d["loaded_chunks"]),
            "loaded_MiB": round(d["loaded_bytes"] / 2**20, 1),
            "load_ms_avg": round(1000 * d["load_s"] / d["loads"], 2) if d["loads"] else 0.0,
            "stored_chunks": int(d["stored_chunks"]),
            "stored_MiB": round(d["stored_bytes"] / 2**20, 1),
            "save_ms_avg": round(1000 * d["save_s"] / d["saves"], 2) if d["saves"] else 0.0,
            "load_errors": int(d["load_errors"]),
            "cache_off": int(d["cache_off"]),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in _SUMMED + _MAXED)

    def to_dict(self) -> dict[str, Any]:  # 0.26 has no to_dict; 0.32 sends this payload.
        return self.data
