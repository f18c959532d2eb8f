"""Fixtures shared by the unit and end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvharbor.demo.model import build_tiny_model
from tests.support.real_gateway import RealGateway


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama (4 layers, 2 KV heads, head_dim 64), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def real_gateway(tmp_path: Path) -> Iterator[RealGateway]:
    """A real gateway serving in this process (tests/support/real_gateway.py), stopped and cleaned up after."""
    gateway = RealGateway(tmp_path / "gateway").start()
    try:
        yield gateway
    finally:
        gateway.close()
