"""Fixtures for the end-to-end tests: a `Lab` per test (the tiny model comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_harness import Lab

from kvharbor.demo.server import VllmServer


@pytest.fixture
def lab(tmp_path: Path, tiny_model: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path, tiny_model)
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def servers(lab: Lab) -> Iterator[list[VllmServer]]:
    """OpenAI servers a test started (append them): each is stopped after the test."""
    started: list[VllmServer] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()
