"""LOOKUP's resident hits, VERIFY and DROP against a real gateway with a RAM tier over a
file tier, restarted so that only the files answer (what an engine finds after a reboot).
Damage is real: objects rewritten on disk with a flipped byte."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import FINGERPRINT, closing_client, put_values

from tests.support.damage import damage_file_objects
from tests.support.real_gateway import RealGateway

SIZE = 64 * 1024
KEYS = [bytes([i]) * 16 for i in range(1, 5)]
ITEMS = [(FINGERPRINT, key) for key in KEYS]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    return tmp_path / "files"


@pytest.fixture
def restarted(tmp_path: Path, files: Path) -> Iterator[RealGateway]:
    """A gateway that stored `KEYS` (in RAM and on files), then restarted: files only."""
    tiers = [
        {"name": "ram", "type": "ram", "capacity_gb": 0.25},
        {"name": "local", "type": "file", "path": str(files), "capacity_gb": 1},
    ]
    # No refill: the test is what an engine finds while only the files answer.
    gateway = RealGateway(tmp_path / "gateway", tiers=tiers, storage={"refill_ram": False}).start()
    try:
        with closing_client(gateway.client()) as client:
            assert put_values(client, [(key, SIZE) for key in KEYS]) == len(KEYS)
            assert client.probe(KEYS, 0, SIZE).resident == len(KEYS)  # In shared-memory RAM.
        gateway.stop()
        yield gateway
    finally:
        gateway.close()


def test_hits_on_files_are_resident_once_read_back(restarted: RealGateway) -> None:
    restarted.start()
    with closing_client(restarted.client()) as client:
        found = client.probe(KEYS, 0, SIZE)
        assert (found.hits, found.resident) == (4, 0)
        assert client.verify(ITEMS, SIZE) == 4
        found = client.probe(KEYS, 0, SIZE)
        assert (found.hits, found.resident) == (4, 4)  # Promoted into RAM on the way.


def test_a_damaged_value_ends_the_read_back_and_is_dropped(restarted: RealGateway, files: Path) -> None:
    assert damage_file_objects(files, only={KEYS[1]}) == 1
    restarted.start()
    with closing_client(restarted.client()) as client:
        assert client.probe(KEYS, 0, SIZE).hits == 4  # The index cannot tell.
        assert client.verify(ITEMS, SIZE) == 1
        assert client.lookup(KEYS) == 1
        client.drop(KEYS[2:])
        assert client.verify(ITEMS[2:], SIZE) == 0


def test_a_value_of_another_size_is_no_hit(restarted: RealGateway) -> None:
    restarted.start()
    with closing_client(restarted.client()) as client:
        assert client.verify(ITEMS, SIZE + 1) == 0
        assert client.lookup(KEYS) == 0  # Dropped: under its key it fits no chunk.
        assert put_values(client, [(KEYS[0], SIZE)]) == 1
        found = client.probe(KEYS, 0, SIZE // 2)
        assert (found.hits, found.resident) == (0, 0)  # Resident, of another size: no hit.
