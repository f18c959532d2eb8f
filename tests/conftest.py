"""Fixtures shared by the unit and end-to-end tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvharbor.demo.model import build_tiny_model
from kvharbor.gateway import embedded
from tests.support.real_gateway import RealGateway
from tests.support.wheel import kvharbor_wheel

# tests/sglang need SGLang, which pins another torch than vLLM: they run in the SGLang venv
# (scripts/setup-sglang.sh; `make test` runs them there after the rest).
# (A namespace package is this folder itself, seen from tests/ on sys.path: not SGLang.)
_sglang = importlib.util.find_spec("sglang")
collect_ignore = [] if _sglang is not None and _sglang.origin is not None else ["sglang"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama (4 layers, 2 KV heads, head_dim 64), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvharbor's wheel (`tests.support.wheel`), built at most once per session."""
    return kvharbor_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture
def real_gateway(tmp_path: Path) -> Iterator[RealGateway]:
    """A real gateway serving in this process (tests/support/real_gateway.py), stopped and cleaned up after."""
    gateway = RealGateway(tmp_path / "gateway").start()
    try:
        yield gateway
    finally:
        gateway.close()


GATEWAY_EXIT_TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def _stop_embedded_gateways_started_here() -> Iterator[None]:
    """An embedded gateway outlives the process that started it (`gateway.linger_s`): one that
    a test started in this process is stopped when the test ends, so none lingers into the
    next test, or past the run, with its RAM tier."""
    before = set(embedded.started_here())
    yield
    for pid in set(embedded.started_here()) - before:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(GATEWAY_EXIT_TIMEOUT_S)
