"""Admission behind (``admit(..., behind=True)``), the RAM refill's way in, on both indexes,
and the manifest's newest-first walk that feeds the refill."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvharbor.cache import format
from kvharbor.cache.index import Entry, MemoryIndex, OverBudget, TierIndex
from kvharbor.cache.manifest import ManifestIndex, open_manifest
from kvharbor.hal.file import FileDevice


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def entry(n: int, nbytes: int = 300) -> Entry:
    return Entry(key(n), nbytes, 1)


def lru_keys(index: TierIndex) -> list[bytes]:
    return [e.key for e in index.lru(1000)]


@pytest.fixture(params=["memory", "manifest"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierIndex]:
    if request.param == "memory":
        yield MemoryIndex()
        return
    opened = open_manifest(FileDevice("local", str(tmp_path), format.HEADER_BYTES + 4096), "local")
    yield opened
    opened.close()


def test_entries_admitted_behind_are_the_least_recent_in_the_order_they_came(index: TierIndex) -> None:
    index.admit(entry(1), 10_000)
    index.admit(entry(2), 10_000)
    # A refill walks its source newest first: 3 is newer than 4, both older than 1 and 2.
    assert index.admit(entry(3), 10_000, behind=True) == []
    assert index.admit(entry(4), 10_000, behind=True) == []
    assert lru_keys(index) == [key(4), key(3), key(1), key(2)]
    assert index.used_bytes() == 1200 and index.count() == 4


def test_admission_behind_never_evicts(index: TierIndex) -> None:
    index.admit(entry(1), 1000)
    index.admit(entry(2), 1000)
    index.admit(entry(3, 400), 1000, behind=True)
    with pytest.raises(OverBudget):
        index.admit(entry(4), 1000, behind=True)
    assert lru_keys(index) == [key(3), key(1), key(2)] and index.used_bytes() == 1000
    # Engines' admission still evicts, least recent (the refilled one) first.
    assert index.admit(entry(5), 1000) == [entry(3, 400)]


def test_admission_behind_leaves_a_present_key_as_it_is(index: TierIndex) -> None:
    index.admit(entry(1), 10_000)
    index.admit(entry(2), 10_000)
    assert index.admit(entry(1, 500), 10_000, behind=True) == []
    assert lru_keys(index) == [key(1), key(2)]
    assert index.get(key(1)) == entry(1) and index.used_bytes() == 600


def test_the_manifest_walks_newest_first_page_by_page(tmp_path: Path) -> None:
    manifest = open_manifest(FileDevice("local", str(tmp_path), format.HEADER_BYTES + 4096), "local")
    try:
        assert isinstance(manifest, ManifestIndex)
        assert manifest.most_recent(10) == ([], None)
        for n in range(25):
            manifest.admit(entry(n, 10), 1 << 20)
        manifest.touch([key(3), key(7)])  # 7 is now the newest, then 3.
        walked: list[bytes] = []
        entries, cursor = manifest.most_recent(10)
        while entries:
            walked += [e.key for e in entries]
            entries, cursor = manifest.most_recent(10, cursor)
        assert cursor is None
        rest = [key(n) for n in reversed(range(25)) if n not in (3, 7)]
        assert walked == [key(7), key(3), *rest]
    finally:
        manifest.close()
