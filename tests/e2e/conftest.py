"""Fixtures for the end-to-end tests: a `Lab` per test (the tiny model comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_harness import Lab


@pytest.fixture
def lab(tmp_path: Path, tiny_model: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path, tiny_model)
    try:
        yield lab
    finally:
        lab.close()
