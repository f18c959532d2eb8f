"""Fixtures for the end-to-end tests: a `Lab` per test (the tiny model comes from tests/conftest.py).

A test that fails prints the kvharbor lines of every log its lab holds (the engines' and the
embedded gateway's, which is removed with the lab): CI keeps only the test's output.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pluggy
import pytest
from e2e_harness import ENGINE_MODULES, Lab

from kvharbor.demo.server import VllmServer
from tests.support.zygote import Zygote

_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    if outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.fixture(scope="session")
def engine_forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """The fork server every lab's engine processes come from (torch and vLLM imported once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVHARBOR", "VLLM_"))}
    zygote = Zygote.start(ENGINE_MODULES, env, tmp_path_factory.mktemp("forks") / "zygote.log")
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.fixture
def lab(request: pytest.FixtureRequest, tmp_path: Path, tiny_model: Path, engine_forks: Zygote) -> Iterator[Lab]:
    lab = Lab(tmp_path, tiny_model, engine_forks)
    try:
        yield lab
    finally:
        if request.node.stash.get(_FAILED, False):
            print_kvharbor_lines(lab)
        lab.close()


def print_kvharbor_lines(lab: Lab) -> None:
    """Shown under "Captured stdout teardown" of the failed test."""
    for log in sorted([*lab.root.glob("*.log"), *lab.runtime.glob("*.log")]):
        lines = [line for line in log.read_text(errors="replace").splitlines() if "kvharbor" in line]
        print(f"--- {log} ({len(lines)} kvharbor lines)", *lines[-80:], sep="\n")


@pytest.fixture
def servers(lab: Lab) -> Iterator[list[VllmServer]]:
    """OpenAI servers a test started (append them): each is stopped after the test."""
    started: list[VllmServer] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()
