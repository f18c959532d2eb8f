"""Crashes of the block store: a real writer process killed with SIGKILL inside an append,
then the store reopened: the index is rebuilt, every acknowledged object reads back
whole, and nothing torn is ever served (the writer alternates copied and split objects,
`tests.support.block_writer`). A second test leaves a torn object by hand
(the state a power cut mid-write leaves), which the rebuild must drop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvharbor.hal.block.layout import (
    BLOCK_BYTES,
    OBJECT_HEADER_BYTES,
    REGION_HEADER_BYTES,
    SUPERBLOCK_BYTES,
    ObjectHeader,
    ObjectKind,
    Superblock,
    object_span,
    whole_value_checksum,
)
from kvharbor.hal.block.store import BlockStoreDevice
from tests.support.block_writer import key_of, value_of

MIB = 1 << 20
VALUE_MAX_BYTES = 8 * MIB
REGION_BYTES = 32 * MIB
STORE_BYTES = SUPERBLOCK_BYTES + 12 * REGION_BYTES
ROUNDS = 3
ACKS_PER_ROUND = 8
ROOT = Path(__file__).resolve().parents[2]


def open_store(path: Path) -> BlockStoreDevice:
    return BlockStoreDevice("card", str(path), VALUE_MAX_BYTES, region_bytes=REGION_BYTES, create_bytes=STORE_BYTES)


def read(store: BlockStoreDevice, n: int) -> bytes | None:
    buffer = memoryview(bytearray(VALUE_MAX_BYTES))
    got = store.get(key_of(n), buffer)
    return None if got is None else bytes(buffer[:got])


def kill_after_acks(path: Path, acks: int) -> int:
    """Run a writer until it acknowledged ``acks`` puts, SIGKILL it inside the next one
    (it starts that put as soon as it printed), and return the last key acknowledged."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.support.block_writer", str(path), str(STORE_BYTES), str(REGION_BYTES)]
    child = subprocess.Popen([*argv, str(VALUE_MAX_BYTES)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert child.stdout is not None
    last = -1
    try:
        for _ in range(acks):
            line = child.stdout.readline()
            assert line, f"the writer died before {acks} acknowledgements (exit {child.poll()})"
            last = int(line)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return last


def test_a_writer_killed_mid_append_loses_nothing_acknowledged_and_serves_nothing_torn(tmp_path: Path) -> None:
    path = tmp_path / "card.blocks"
    acknowledged: set[int] = set()
    for _ in range(ROUNDS):  # Each round rewrites keys from 0: later rounds replace, then add.
        last = kill_after_acks(path, ACKS_PER_ROUND + len(acknowledged))
        acknowledged |= set(range(last + 1))
        store = open_store(path)
        try:
            on_device = {int.from_bytes(k, "big"): n for k, n in store.scan()}
            assert acknowledged <= set(on_device), "the rebuilt index holds every acknowledged key"
            for n in on_device:  # The one in flight included: whole, or not there at all.
                assert read(store, n) == value_of(n, VALUE_MAX_BYTES), f"key {n} came back damaged"
            assert set(on_device) - acknowledged <= {last + 1}, "only the put in flight may have landed"
        finally:
            store.close()


def test_a_torn_last_object_is_dropped_at_rebuild_and_written_over(tmp_path: Path) -> None:
    path = tmp_path / "card.blocks"
    store = open_store(path)
    small = [b"a" * 5000, b"b" * 70_000]
    for n, data in enumerate(small):
        store.put(key_of(n), [data])
    store.close()
    # What a crash inside the third append leaves: its header and half of its value.
    with open(path, "r+b") as f:
        superblock = Superblock.decode(f.read(BLOCK_BYTES), str(path))
        torn = b"c" * 300_000
        header = bytearray(OBJECT_HEADER_BYTES)
        ObjectHeader(
            ObjectKind.VALUE, 1, len(torn), key_of(2), whole_value_checksum(torn, 0, superblock.seed)
        ).encode_into(memoryview(header), superblock.seed)
        f.seek(SUPERBLOCK_BYTES + REGION_HEADER_BYTES + sum(object_span(len(d)) for d in small))
        f.write(bytes(header) + torn[: len(torn) // 2])
    store = open_store(path)
    try:
        assert dict(store.scan()) == {key_of(0): 5000, key_of(1): 70_000}
        assert read(store, 2) is None
        store.put(key_of(3), [b"d" * 1000])  # Appended where the torn one was.
    finally:
        store.close()
    store = open_store(path)
    try:
        assert [read(store, n) for n in range(4)] == [small[0], small[1], None, b"d" * 1000]
    finally:
        store.close()
