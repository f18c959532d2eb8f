"""`GatewayHooks`: everything the dashboard reads from, and does to, the gateway it serves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvharbor.cache.store import StoreStatus
from kvharbor.config import Config


@dataclass(frozen=True, slots=True)
class GatewayHooks:
    """Each behind one function, so the dashboard holds no reference into the gateway's insides."""

    config: Callable[[], Config]
    """The config in force (read on every request: live edits apply at once)."""
    apply_config: Callable[[Config], None]
    """Put a config in force that differs from it only in keys read at each use."""
    config_path: Path | None
    """The file the config came from; None: defaults and environment only."""
    status: Callable[[], dict[str, Any]]
    """The gateway's status in its one JSON form."""
    readiness: Callable[[], str | None]
    """None when the gateway accepts clients with its store open, else why not."""
    store_status: Callable[[], StoreStatus]
    registry: Callable[[], CollectorRegistry]
    """What ``/metrics`` serves."""
