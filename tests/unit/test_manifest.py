"""The SQLite manifest: LRU admission under a budget shared by processes, and recovery."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import re
import sqlite3
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvharbor.cache import format
from kvharbor.cache.index import Entry, MemoryIndex, OverBudget
from kvharbor.cache.keys import fragment_key
from kvharbor.cache.manifest import FORMAT_VERSION, MANIFEST_FILE, ManifestIndex, open_manifest
from kvharbor.hal.base import DeviceTransient, DeviceUnavailable
from kvharbor.hal.file import FileDevice

FINGERPRINT = b"\x05" * 16
PAYLOAD_MAX = 100
"""Fragment payload size of the devices in the rebuild tests."""


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def entry(n: int, nbytes: int, parts: int = 1) -> Entry:
    return Entry(key(n), nbytes, parts)


def open_index(root: Path, **options: int) -> ManifestIndex:
    device = FileDevice("local", str(root), format.HEADER_BYTES + PAYLOAD_MAX)
    return open_manifest(device, "local", **options)


@pytest.fixture
def index(tmp_path: Path) -> Iterator[ManifestIndex]:
    opened = open_index(tmp_path)
    yield opened
    opened.close()


def totals_on_disk(root: Path) -> tuple[int, int]:
    """SUM and COUNT over the rows themselves, to hold the kept totals against."""
    with contextlib.closing(sqlite3.connect(root / MANIFEST_FILE)) as db:
        used, count = db.execute("SELECT COALESCE(SUM(nbytes), 0), COUNT(*) FROM objects").fetchone()
    return used, count


def snapshot(index: ManifestIndex) -> tuple[int, int, list[Entry]]:
    return index.used_bytes(), index.count(), index.lru(1000)


# -- admission ---------------------------------------------------------------


def test_admit_evicts_least_recently_used_first(index: ManifestIndex, tmp_path: Path) -> None:
    for n in (1, 2, 3):
        assert index.admit(entry(n, 300), budget_bytes=1000) == []
    index.touch([key(1)])
    assert index.admit(entry(4, 500), budget_bytes=1000) == [entry(2, 300), entry(3, 300)]
    assert index.contains([key(1), key(2), key(3), key(4)]) == [True, False, False, True]
    assert [e.key for e in index.lru(10)] == [key(1), key(4)]
    assert (index.used_bytes(), index.count()) == (800, 2) == totals_on_disk(tmp_path)


def test_later_keys_of_one_touch_count_as_more_recent(index: ManifestIndex) -> None:
    for n in (1, 2, 3):
        index.admit(entry(n, 100), budget_bytes=1000)
    index.touch([key(3), key(1), key(2)])
    assert [e.key for e in index.lru(10)] == [key(3), key(1), key(2)]
    index.touch([key(2), key(3), key(2), key(9)])  # A repeat counts where it comes last.
    assert [e.key for e in index.lru(10)] == [key(1), key(3), key(2)]


def test_readmitting_a_key_replaces_it_and_never_evicts_it(index: ManifestIndex) -> None:
    index.admit(entry(1, 600), budget_bytes=1000)
    index.admit(entry(2, 300), budget_bytes=1000)
    assert index.admit(entry(1, 700, parts=2), budget_bytes=1000) == []
    assert index.get(key(1)) == entry(1, 700, parts=2)
    assert index.used_bytes() == 1000
    assert index.admit(entry(1, 900), budget_bytes=1000) == [entry(2, 300)]


def test_pinned_entries_are_never_victims(index: ManifestIndex) -> None:
    for n in (1, 2, 3):
        index.admit(entry(n, 300), budget_bytes=1000)
    victims = index.admit(entry(4, 300), budget_bytes=1000, pinned=frozenset({key(1)}))
    assert victims == [entry(2, 300)]
    assert index.contains([key(1)]) == [True]


def test_when_pins_leave_no_room_nothing_changes(index: ManifestIndex, tmp_path: Path) -> None:
    index.admit(entry(1, 400), budget_bytes=1000)
    index.admit(entry(2, 400), budget_bytes=1000)
    before = snapshot(index)
    with pytest.raises(OverBudget, match="pinned"):
        index.admit(entry(3, 400), budget_bytes=1000, pinned=frozenset({key(1), key(2)}))
    assert snapshot(index) == before
    assert index.contains([key(3)]) == [False]
    assert totals_on_disk(tmp_path) == (800, 2)


def test_a_value_over_the_whole_budget_changes_nothing(index: ManifestIndex) -> None:
    index.admit(entry(1, 400), budget_bytes=1000)
    before = snapshot(index)
    with pytest.raises(OverBudget):
        index.admit(entry(2, 1001), budget_bytes=1000)
    assert snapshot(index) == before


def test_remove_and_contains_in_batches_beyond_sqlites_variable_limit(index: ManifestIndex, tmp_path: Path) -> None:
    many = 40_000  # Above SQLite's 32 766 bound variables per statement.
    index.rebuild(entry(n, 10) for n in range(many))
    probe = [key(n) for n in range(0, 2 * many, 2)]
    assert index.contains(probe) == [n < many for n in range(0, 2 * many, 2)]
    index.remove([key(n) for n in range(1, many, 2)] + [key(many + 5)])
    assert (index.used_bytes(), index.count()) == (10 * many // 2, many // 2) == totals_on_disk(tmp_path)
    assert index.contains([key(0), key(1)]) == [True, False]
    assert index.contains([]) == []


def test_state_survives_reopening(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = open_index(tmp_path)
    for n in (1, 2, 3):
        first.admit(entry(n, 100 * n), budget_bytes=10_000)
    first.touch([key(1)])
    before = snapshot(first)
    first.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvharbor.cache.manifest"):
        second = open_index(tmp_path)
    assert snapshot(second) == before
    assert caplog.records == []  # A sound manifest opens silently.
    second.close()


def test_a_write_blocked_by_another_process_is_transient(index: ManifestIndex, tmp_path: Path) -> None:
    blocked = open_index(tmp_path, busy_timeout_ms=1)
    other = sqlite3.connect(tmp_path / MANIFEST_FILE, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # Holds the write lock for the whole test.
    try:
        with pytest.raises(DeviceTransient, match="database is locked"):
            blocked.admit(entry(1, 10), budget_bytes=100)
        assert blocked.contains([key(1)]) == [False]  # Readers are not blocked.
    finally:
        other.execute("ROLLBACK")
        other.close()
        blocked.close()


# -- two processes -------------------------------------------------------------

ADMITS_PER_PROCESS = 300
SHARED_BUDGET = 20_000


@dataclass(frozen=True)
class WorkerFailed:
    traceback: str


def _run_worker(work: Callable[..., object], args: tuple[object, ...], results: Queue) -> None:
    """Put what ``work`` returns on ``results``, or its traceback, so a failure fails the test at once."""
    try:
        results.put(work(*args))
    except BaseException:
        results.put(WorkerFailed(traceback.format_exc()))


def run_in_processes(work: Callable[..., object], args: list[tuple[object, ...]]) -> list[Any]:
    """Run ``work`` once per argument tuple, each in a fresh (spawned) process, all at once.

    Each call gets a shared barrier as its last argument: it waits there so
    that the processes really overlap.
    """
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(len(args)), context.Queue()
    workers = [context.Process(target=_run_worker, args=(work, (*a, start), results)) for a in args]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join()
    failures = [o.traceback for o in outcomes if isinstance(o, WorkerFailed)]
    assert not failures, "\n".join(failures)
    assert [w.exitcode for w in workers] == [0] * len(workers)
    return outcomes


def _admit_concurrently(root: str, seed: int, start: Barrier) -> tuple[list[tuple[bytes, int]], list[bytes], int]:
    index = open_index(Path(root))
    rng = random.Random(seed)
    start.wait()
    admitted: list[tuple[bytes, int]] = []
    evicted: list[bytes] = []
    worst = 0
    for _ in range(ADMITS_PER_PROCESS):
        new = Entry(rng.randbytes(16), rng.randint(1, SHARED_BUDGET // 5), 1)
        evicted += [victim.key for victim in index.admit(new, SHARED_BUDGET)]
        admitted.append((new.key, new.nbytes))
        worst = max(worst, index.used_bytes())
    index.close()
    return admitted, evicted, worst


def test_two_processes_never_exceed_the_budget_together(tmp_path: Path) -> None:
    outcomes = run_in_processes(_admit_concurrently, [(str(tmp_path), 1), (str(tmp_path), 2)])

    sizes = {k: n for admitted, _, _ in outcomes for k, n in admitted}
    evicted = [k for _, victims, _ in outcomes for k in victims]
    assert len(sizes) == 2 * ADMITS_PER_PROCESS
    assert all(worst <= SHARED_BUDGET for _, _, worst in outcomes)
    index = open_index(tmp_path)
    kept = {k for k, present in zip(sizes, index.contains(list(sizes)), strict=True) if present}
    # Each entry was evicted exactly once by exactly one process, or is still here.
    assert len(evicted) == len(set(evicted))
    assert set(evicted) | kept == set(sizes) and not set(evicted) & kept
    used = sum(sizes[k] for k in kept)
    assert used <= SHARED_BUDGET
    assert (index.used_bytes(), index.count()) == (used, len(kept)) == totals_on_disk(tmp_path)
    index.close()


def _open_and_admit(root: str, n: int, start: Barrier) -> int:
    start.wait()
    index = open_index(Path(root))
    index.admit(entry(n, 1), budget_bytes=1 << 30)
    count = index.count()
    index.close()
    return count


def test_two_processes_rebuilding_at_once_share_one_manifest(tmp_path: Path) -> None:
    device = FileDevice("local", str(tmp_path), format.HEADER_BYTES + PAYLOAD_MAX)
    for n in range(20):
        store(device, key(n), b"v" * 250)  # Three fragments each.
    counts = sorted(run_in_processes(_open_and_admit, [(str(tmp_path), 1001), (str(tmp_path), 1002)]))
    # Had either process rebuilt a manifest the other had already opened, that
    # admit would have gone to a deleted file and be missing here.
    index = open_index(tmp_path)
    assert index.count() == 22
    assert index.contains([key(1001), key(1002)]) == [True, True]
    assert counts in ([21, 22], [22, 22])
    index.close()


# -- recovery ------------------------------------------------------------------


def store(device: FileDevice, k: bytes, value: bytes) -> list[format.EncodedPart]:
    parts = format.encode(k, FINGERPRINT, value, max_object_bytes=device.max_value_bytes)
    for part in parts:
        device.put(part.device_key, [part.header, part.payload])
    return parts


REBUILD_LINE = re.compile(
    r"kvharbor: tier 'local': manifest (?P<problem>.+); rebuilt from a scan of (?P<objects>\d+) "
    r"objects \((?P<bytes>\d+) bytes\) in \d+\.\d\d s: (?P<kept>\d+) entries kept "
    r"\((?P<foreign>\d+) of them objects of another format version, left to their release\), "
    r"(?P<dropped>\d+) damaged objects dropped"
)


def rebuild_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    assert all(r.name == "kvharbor.cache.manifest" for r in caplog.records)
    lines = [REBUILD_LINE.fullmatch(r.getMessage()) for r in caplog.records]
    assert all(lines), [r.getMessage() for r in caplog.records]
    return [m.groupdict() for m in lines if m]


def test_a_missing_manifest_is_rebuilt_from_object_headers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    device = FileDevice("local", str(tmp_path), format.HEADER_BYTES + PAYLOAD_MAX)
    whole = store(device, key(1), b"a" * 250)  # Three fragments.
    single = store(device, key(2), b"b" * 50)
    (_, lost) = store(device, key(3), b"c" * 180)  # Fragment 1 will go missing.
    device.delete(lost.device_key)
    store(device, key(4), b"d" * 250)
    shrunk = store(device, key(4), b"d" * 50)  # Leaves fragments 1 and 2 of the old value.
    store(device, key(7), b"g" * 250)
    (rewrite_head, _) = format.encode(key(7), FINGERPRINT, b"g" * 180, max_object_bytes=device.max_value_bytes)
    device.put(key(7), [rewrite_head.header, rewrite_head.payload])  # A rewrite that stopped here.
    device.put(key(5), [b"not an object at all"])
    (torn,) = store(device, key(6), b"f" * 60)
    os.truncate(tmp_path / key(6).hex()[:2] / key(6).hex()[2:4] / key(6).hex(), torn.nbytes - 1)
    scanned = sum(n for _, n in device.scan())

    with caplog.at_level(logging.INFO, logger="kvharbor.cache.manifest"):
        index = open_manifest(device, "local")

    (line,) = rebuild_lines(caplog)
    assert line == {
        "problem": "missing",
        "objects": "13",
        "bytes": str(scanned),
        "kept": "3",
        "foreign": "0",
        "dropped": "8",
    }
    assert caplog.records[0].levelno == logging.INFO
    assert index.get(key(1)) == Entry(key(1), sum(p.nbytes for p in whole), 3, FINGERPRINT)
    assert index.get(key(2)) == Entry(key(2), single[0].nbytes, 1, FINGERPRINT)
    assert index.get(key(4)) == Entry(key(4), shrunk[0].nbytes, 1, FINGERPRINT)
    assert index.layout_counts() == {FINGERPRINT: 3}  # Told by the headers the scan read.
    assert index.contains([key(3), key(5), key(6), key(7)]) == [False] * 4
    survivors = {key(1), fragment_key(key(1), 1), fragment_key(key(1), 2), key(2), key(4)}
    assert {k for k, _ in device.scan()} == survivors  # What cannot be read is gone.
    assert index.used_bytes() == sum(e.nbytes for e in index.lru(10))
    index.close()


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("garbage", r"corrupt \(file is not a database\)"),
        ("empty", r"incomplete \(no format version\)"),
        ("other version", rf"of format version {FORMAT_VERSION + 1} \(this release uses {FORMAT_VERSION}\)"),
    ],
)
def test_a_damaged_manifest_is_rebuilt_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, problem: str
) -> None:
    device = FileDevice("local", str(tmp_path), format.HEADER_BYTES + PAYLOAD_MAX)
    store(device, key(1), b"a" * 250)
    index = open_manifest(device, "local")
    index.admit(entry(99, 10), budget_bytes=1000)  # An entry no object backs: gone after a rebuild.
    index.close()
    path = tmp_path / MANIFEST_FILE
    if damage == "other version":
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            db.execute("UPDATE meta SET value = ? WHERE name = 'format_version'", (FORMAT_VERSION + 1,))
    else:
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        path.write_bytes(os.urandom(8192) if damage == "garbage" else b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvharbor.cache.manifest"):
        rebuilt = open_manifest(device, "local")
        rebuilt.close()
        reopened = open_manifest(device, "local")

    (line,) = rebuild_lines(caplog)  # The reopen is silent: one line per rebuild.
    assert re.fullmatch(problem, line["problem"])
    assert (line["objects"], line["kept"], line["dropped"]) == ("3", "1", "0")
    assert caplog.records[0].levelno == logging.WARNING
    assert reopened.contains([key(1), key(99)]) == [True, False]
    reopened.close()


def test_a_manifest_that_cannot_be_replaced_is_a_clear_error(tmp_path: Path) -> None:
    device = FileDevice("local", str(tmp_path), 4096)
    (tmp_path / MANIFEST_FILE).mkdir()
    with pytest.raises(DeviceUnavailable, match=f"local: manifest {tmp_path / MANIFEST_FILE} cannot be replaced"):
        open_manifest(device, "local")


# -- the same LRU as MemoryIndex -----------------------------------------------

MODEL_BUDGET = 1000


class ManifestMatchesMemoryIndex(RuleBasedStateMachine):
    """Without pins, the manifest and the in-memory index make the same choices, and
    both count exactly the entries of each fingerprint they hold."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        self.manifest = open_index(Path(self._dir.name))
        self.model = MemoryIndex()

    keys = st.integers(0, 9).map(key)

    @rule(
        k=keys,
        nbytes=st.integers(1, MODEL_BUDGET + 50),
        parts=st.integers(1, 3),
        fingerprint=st.sampled_from([b"\x01" * 16, b"\x02" * 16]),
    )
    def admit(self, k: bytes, nbytes: int, parts: int, fingerprint: bytes) -> None:
        new = Entry(k, nbytes, parts, fingerprint)
        try:
            expected = self.model.admit(new, MODEL_BUDGET)
        except OverBudget:
            with pytest.raises(OverBudget):
                self.manifest.admit(new, MODEL_BUDGET)
            return
        assert self.manifest.admit(new, MODEL_BUDGET) == expected

    @rule(ks=st.lists(keys, max_size=4))
    def touch(self, ks: list[bytes]) -> None:
        self.model.touch(ks)
        self.manifest.touch(ks)

    @rule(ks=st.lists(keys, max_size=4))
    def remove(self, ks: list[bytes]) -> None:
        self.model.remove(ks)
        self.manifest.remove(ks)

    @invariant()
    def same_state(self) -> None:
        assert snapshot(self.manifest) == (self.model.used_bytes(), self.model.count(), self.model.lru(1000))
        every = [key(n) for n in range(10)]
        assert self.manifest.contains(every) == self.model.contains(every)
        held = Counter(entry.fingerprint for entry in self.model.lru(1000))
        assert self.model.layout_counts() == self.manifest.layout_counts() == dict(held)

    def teardown(self) -> None:
        self.manifest.close()
        self._dir.cleanup()


ManifestMatchesMemoryIndex.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestManifestMatchesMemoryIndex = ManifestMatchesMemoryIndex.TestCase
