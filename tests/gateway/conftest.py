"""Fixtures for the gateway tests: every gateway and worker a test starts is
killed at its end, and every shared-memory segment of its shm_name removed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import GatewayProcess, Lab


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def started(lab: Lab) -> Callable[..., GatewayProcess]:
    """Start a gateway on a fresh config: ``started(ring_mb=8, tiers=[...])``."""

    def start(start_clean: str | None = None, **config: Any) -> GatewayProcess:
        return lab.gateway(lab.config(**config), start_clean).start()

    return start
