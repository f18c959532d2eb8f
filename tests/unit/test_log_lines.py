"""Item 6 of the ops issue: every kvharbor log line starts with ``kvharbor:``, a repeated
condition is said once and counted, and a miss never reads like a fault."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from kvharbor.cache.breaker import BreakerSettings, CircuitBreaker
from kvharbor.cache.keys import ChunkKey, LayoutFingerprint
from kvharbor.cache.manifest import open_manifest
from kvharbor.cache.tier import Tier
from kvharbor.hal.file import FileDevice
from kvharbor.telemetry.log import PREFIX, OnceLog
from tests.support.damage import damage_file_objects
from tests.support.log_lines import HOLE, log_calls, log_calls_in


def test_every_log_call_in_kvharbor_starts_its_line_with_the_prefix() -> None:
    calls = log_calls()
    assert len(calls) > 50, "the scan found kvharbor's log calls"
    unprefixed = [call.where for call in calls if call.template is None]
    assert not unprefixed, f"log calls whose line does not visibly start with {PREFIX!r}: {unprefixed}"


def test_the_scan_tells_a_prefixed_line_from_one_without_the_prefix() -> None:
    source = """
_log.info("kvharbor: tier %s ready", name)
_log.warning("%stier '%s' full", PREFIX, name)
_log.log(level, PREFIX + f"gateway {pid} stopped")
self._once.say("full", f"tier '{name}' is full")
_log.error("tier %s failed", name)
_log.info(f"gateway {pid} stopped")
_log.warning(message)
self._once.say("twice", "kvharbor: said with its own prefix")
"""
    calls = log_calls_in("snippet.py", ast.parse(source))
    assert [call.template for call in calls] == [
        f"kvharbor: tier {HOLE} ready",
        f"kvharbor: tier '{HOLE}' full",
        f"kvharbor: gateway {HOLE} stopped",
        f"kvharbor: tier '{HOLE}' is full",
        None,
        None,
        None,
        None,
    ]


class _Clock:
    """A clock the test moves: the summary interval passes without waiting for it."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def once(caplog: pytest.LogCaptureFixture) -> tuple[OnceLog, _Clock]:
    caplog.set_level(logging.INFO, logger="kvharbor.test")
    clock = _Clock()
    return OnceLog(logging.getLogger("kvharbor.test"), summary_interval_s=60.0, clock=clock), clock


def test_a_repeated_condition_is_said_once_and_its_count_said_when_it_clears(
    once: tuple[OnceLog, _Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, clock = once
    said = [log.say("full:ram", "tier 'ram' is full (1 GiB); new chunks are not stored there") for _ in range(5)]
    assert said == [True, False, False, False, False]
    clock.now_s = 10.0
    log.clear("full:ram", "tier 'ram' takes writes again")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "kvharbor: tier 'ram' is full (1 GiB); new chunks are not stored there",
        "kvharbor: tier 'ram' takes writes again (after 4 more time(s) since it was said)",
    ]
    assert [record.levelno for record in caplog.records] == [logging.WARNING, logging.INFO]


def test_a_condition_that_never_clears_is_summed_up_at_most_once_per_interval(
    once: tuple[OnceLog, _Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, clock = once
    for second in range(0, 150):
        clock.now_s = float(second)
        log.say("corrupt:files", f"corrupt chunk {second:04x} in tier 'files' (checksum) -> treated as miss")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "kvharbor: corrupt chunk 0000 in tier 'files' (checksum) -> treated as miss",
        "kvharbor: corrupt chunk 003c in tier 'files' (checksum) -> treated as miss "
        "(again: 60 more time(s) in the last 60 s)",
        "kvharbor: corrupt chunk 0078 in tier 'files' (checksum) -> treated as miss "
        "(again: 60 more time(s) in the last 60 s)",
    ]
    log.clear("corrupt:files")
    assert caplog.records[-1].getMessage() == (
        "kvharbor: cleared after 29 more time(s): corrupt chunk 0095 in tier 'files' (checksum) -> treated as miss"
    )


def test_a_cleared_condition_that_did_not_repeat_says_only_its_clear_message_and_comes_back_fresh(
    once: tuple[OnceLog, _Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, _ = once
    log.say("open:card", "tier 'card' circuit breaker open", logging.ERROR)
    log.clear("open:card")
    log.clear("open:card", "never said: not active any more")
    assert log.say("open:card", "tier 'card' circuit breaker open", logging.ERROR)
    assert [record.getMessage() for record in caplog.records] == ["kvharbor: tier 'card' circuit breaker open"] * 2


def test_a_summary_interval_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="summary_interval_s"):
        OnceLog(logging.getLogger("kvharbor.test"), summary_interval_s=0)


def test_a_file_tier_full_of_damaged_chunks_says_so_once_and_counts_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "files"
    device = FileDevice("files", str(root), 1 << 20)
    tier = Tier("files", device, open_manifest(device, "files"), 64 << 20, CircuitBreaker(BreakerSettings()))
    fingerprint = LayoutFingerprint(model_id="test/model", chunk_size=16).digest()
    keys = [ChunkKey(bytes([i]) * 16) for i in range(8)]
    try:
        for key in keys:
            assert tier.write(key, fingerprint, bytes(4096))
        assert damage_file_objects(root) == len(keys)
        caplog.set_level(logging.INFO, logger="kvharbor")
        assert all(tier.read(key, fingerprint) is None for key in keys)
    finally:
        tier.close()
    said = [record.getMessage() for record in caplog.records if "corrupt chunk" in record.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"kvharbor: corrupt chunk {keys[0].hex()} in tier 'files' ("), said
    assert said[0].endswith(") -> treated as miss"), said
    assert tier.counters.corrupt == len(keys), "each damaged chunk is counted, though said once"


def test_kvharbor_lines_in_an_engine_are_written_once_also_when_the_host_configures_logging_later(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The engine's own handler shows ``kvharbor.*`` lines until the host process gives the root
    logger a handler (a library calling ``logging.basicConfig``, as one in a hybrid model's
    start does): from then on they go there, and are not written twice."""
    from kvharbor.telemetry.log import attach_to_engine_log

    kvharbor_log, root = logging.getLogger("kvharbor"), logging.getLogger()
    saved = (kvharbor_log.handlers[:], kvharbor_log.level, root.handlers[:])
    kvharbor_log.handlers, root.handlers = [], []
    try:
        attach_to_engine_log()
        logging.getLogger("kvharbor.test").warning("kvharbor: before")
        later = logging.StreamHandler()
        later.setFormatter(logging.Formatter("ROOT %(message)s"))
        root.addHandler(later)
        logging.getLogger("kvharbor.test").warning("kvharbor: after")
    finally:
        kvharbor_log.handlers, kvharbor_log.level, root.handlers = saved
    err = capsys.readouterr().err
    assert err.count("kvharbor: before") == 1
    assert err.count("kvharbor: after") == 1 and "ROOT kvharbor: after" in err
