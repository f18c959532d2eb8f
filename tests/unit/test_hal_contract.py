"""The device contract of `kvharbor.hal.base`, checked against every driver.

A new driver (s3, nvme, sim) joins by adding one factory to `DRIVERS`.
"""

from __future__ import annotations

import ctypes
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvharbor.hal.base import STREAM_SLICE_BYTES, BufferTooSmall, Device, DeviceTransient, HealthState
from kvharbor.hal.block.store import BlockStoreDevice
from kvharbor.hal.file import FileDevice
from kvharbor.hal.nvme.kv_device import open_kv_namespace
from kvharbor.hal.ram import RamDevice
from kvharbor.hal.shm_ram import SharedRamDevice
from kvharbor.hal.sim.clock import ScaledClock, VirtualClock
from kvharbor.hal.sim.device import SimCardDevice
from kvharbor.hal.sim.params import CardParams
from tests.support.nvme_kv_standin import KvNamespaceStandIn
from tests.support.s3_server import s3_device_on, shared_server

MAX_VALUE_BYTES = 64 * 1024
DeviceFactory = Callable[[Path], Device]

SIM_PARAMS = CardParams(capacity_bytes=64 * MAX_VALUE_BYTES, value_bytes_max=MAX_VALUE_BYTES)

DRIVERS: dict[str, DeviceFactory] = {
    "ram": lambda _: RamDevice("ram", 16 * MAX_VALUE_BYTES, MAX_VALUE_BYTES),
    # The threshold 0: how full the host's disk is must not decide a contract test
    # (test_hal_file tests the threshold against the measured free share).
    "file": lambda root: FileDevice("local", str(root), MAX_VALUE_BYTES, free_ratio_degraded=0.0),
    # The gateway's RAM tier: a region of shared memory (here a plain buffer) at an offset in its segment.
    "shared_ram": lambda _: SharedRamDevice("ram", memoryview(bytearray(32 * MAX_VALUE_BYTES)), 8192, MAX_VALUE_BYTES),
    # The simulated card, on virtual time and on real time scaled a thousand times faster.
    "sim": lambda _: SimCardDevice("card", SIM_PARAMS, VirtualClock()),
    "sim_scaled": lambda _: SimCardDevice("card", SIM_PARAMS, ScaledClock(time_scale=1e-3)),
    # Block mode on a file: 30 regions, each holding at least one value of the limit.
    "block": lambda root: BlockStoreDevice(
        "card", str(root), MAX_VALUE_BYTES, region_bytes=128 * 1024, create_bytes=30 * 128 * 1024 + 4096
    ),
    # The NVMe KV driver, real above the ioctl, on /dev/null answered by a KV controller stand-in.
    "nvme_kv": lambda _: open_kv_namespace(
        "card", "/dev/null", MAX_VALUE_BYTES, KvNamespaceStandIn(64 * MAX_VALUE_BYTES, MAX_VALUE_BYTES)
    ),
    # An S3 bucket of its own on a real S3 server (moto, a subprocess on loopback).
    "s3": lambda _: s3_device_on(shared_server(), MAX_VALUE_BYTES),
}


@pytest.fixture(params=sorted(DRIVERS))
def device(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Device]:
    opened = DRIVERS[request.param](tmp_path / "device")
    yield opened
    opened.close()


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def read(device: Device, k: bytes) -> bytes | None:
    buffer = memoryview(bytearray(MAX_VALUE_BYTES))
    n = device.get(k, buffer)
    return None if n is None else bytes(buffer[:n])


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_streamed(device: Device, k: bytes, slice_bytes: int = STREAM_SLICE_BYTES) -> bytes | None:
    """The value as `Device.get_streamed` hands it out, checking the slices on the way:
    consecutive views of the caller's buffer, each at most ``slice_bytes`` long
    and already holding its bytes when handed over."""
    buffer = bytearray(MAX_VALUE_BYTES)
    view = memoryview(buffer)
    seen = bytearray()

    base = address(view)

    def consume(piece: memoryview) -> None:
        assert piece.obj is buffer, "a slice is a view of the caller's buffer, not a copy"
        assert 0 < piece.nbytes <= slice_bytes, piece.nbytes
        assert address(piece) - base == len(seen), "slices are consecutive, in order"
        seen.extend(piece)  # Its bytes now, not after the call returns.

    n = device.get_streamed(k, view, consume, slice_bytes)
    if n is None:
        assert not seen, "no slice is handed out on a miss"
        return None
    assert len(seen) == n, (len(seen), n)
    assert bytes(buffer[:n]) == bytes(seen)
    return bytes(seen)


def test_put_joins_parts_of_any_buffer_type(device: Device) -> None:
    payload = bytearray(range(256)) * 10
    device.put(key(1), [b"head", memoryview(payload), b"", bytearray(b"tail")])
    assert read(device, key(1)) == b"head" + bytes(payload) + b"tail"


def test_put_replaces_a_longer_value_whole(device: Device) -> None:
    device.put(key(1), [b"a" * 5000])
    device.put(key(1), [b"b" * 10])
    assert read(device, key(1)) == b"b" * 10
    assert device.size(key(1)) == 10


def test_empty_value_is_a_hit_not_a_miss(device: Device) -> None:
    device.put(key(1), [])
    assert read(device, key(1)) == b""
    assert device.exists([key(1)]) == [True]


def test_miss_is_none_everywhere(device: Device) -> None:
    buffer = memoryview(bytearray(16))
    assert device.get(key(9), buffer) is None
    assert device.peek(key(9), buffer) is None
    assert device.size(key(9)) is None
    assert device.delete(key(9)) is False


def test_get_into_a_short_buffer_says_how_much_is_needed(device: Device) -> None:
    device.put(key(1), [b"x" * 100])
    with pytest.raises(BufferTooSmall) as raised:
        device.get(key(1), memoryview(bytearray(99)))
    assert raised.value.needed == 100


def test_get_fills_a_larger_buffer_with_the_value_only(device: Device) -> None:
    device.put(key(1), [b"value"])
    buffer = bytearray(b"-" * 10)
    assert device.get(key(1), memoryview(buffer)) == 5
    assert bytes(buffer) == b"value-----"


def test_peek_copies_a_prefix(device: Device) -> None:
    device.put(key(1), [b"0123456789"])
    short = bytearray(4)
    assert device.peek(key(1), memoryview(short)) == 4
    assert bytes(short) == b"0123"
    long = bytearray(20)
    assert device.peek(key(1), memoryview(long)) == 10
    assert bytes(long[:10]) == b"0123456789"


@pytest.mark.parametrize("nbytes", [0, 1, 999, 1000, 1001, 4000, 4321, MAX_VALUE_BYTES])
def test_get_streamed_hands_out_the_value_in_consecutive_slices(device: Device, nbytes: int) -> None:
    value = bytes(i * 7 % 251 for i in range(nbytes))
    device.put(key(1), [value])
    assert read_streamed(device, key(1), slice_bytes=1000) == value
    assert read_streamed(device, key(1)) == value  # The default slice size.


def test_get_streamed_misses_and_refuses_a_short_buffer_like_get(device: Device) -> None:
    handed: list[memoryview] = []
    assert device.get_streamed(key(9), memoryview(bytearray(16)), handed.append) is None
    device.put(key(1), [b"x" * 100])
    with pytest.raises(BufferTooSmall) as raised:
        device.get_streamed(key(1), memoryview(bytearray(99)), handed.append)
    assert raised.value.needed == 100
    assert handed == []


def test_exists_answers_in_order_with_duplicates(device: Device) -> None:
    device.put(key(1), [b"a"])
    device.put(key(3), [b"c"])
    assert device.exists([key(3), key(2), key(1), key(3)]) == [True, False, True, True]
    assert device.exists([]) == []


def test_delete_removes_once(device: Device) -> None:
    device.put(key(1), [b"a"])
    assert device.delete(key(1)) is True
    assert device.delete(key(1)) is False
    assert read(device, key(1)) is None


def test_scan_lists_every_value_with_its_length(device: Device) -> None:
    stored = {key(n): n * 7 for n in range(1, 20)}
    for k, n in stored.items():
        device.put(k, [b"v" * n])
    device.delete(key(5))
    del stored[key(5)]
    assert dict(device.scan()) == stored


def test_a_value_over_the_limit_is_refused_and_not_stored(device: Device) -> None:
    with pytest.raises(ValueError, match="max_value_bytes"):
        device.put(key(1), [b"x" * MAX_VALUE_BYTES, b"y"])
    assert device.exists([key(1)]) == [False]
    device.put(key(2), [b"x" * (MAX_VALUE_BYTES - 1), b"y"])  # Exactly at the limit.
    assert device.size(key(2)) == MAX_VALUE_BYTES


def test_usage_and_health_of_a_fresh_device(device: Device) -> None:
    device.put(key(1), [b"x" * 1000])
    usage = device.usage()
    assert 0 <= usage.used_bytes <= usage.capacity_bytes
    assert usage.keys >= 1
    assert device.health().state is HealthState.OK


def read_in_slices_of_1000(device: Device, k: bytes) -> bytes | None:
    return read_streamed(device, k, slice_bytes=1000)


@pytest.mark.parametrize("reader", [read, read_in_slices_of_1000])
def test_concurrent_puts_of_one_key_never_mix(device: Device, reader: Callable[[Device, bytes], bytes | None]) -> None:
    # Each writer stores a value of one repeated byte; any reader must see one
    # writer's whole value, never bytes of two (a streamed read, in many slices,
    # included: it must read one version from its first slice to its last).
    # A server may refuse an operation with a typed transient error (moto 5.2.5 answers 500
    # to some PUTs racing on one key: its ETag reads a buffer the other PUT closed); that is
    # within the contract, a mixed value never is.
    writers, rounds, size = 4, 50, 8192
    errors: list[str] = []
    refused: list[DeviceTransient] = []
    start = threading.Barrier(writers + 1)

    def write(fill: int) -> None:
        start.wait()
        for _ in range(rounds):
            try:
                device.put(key(1), [bytes([fill]) * size])
            except DeviceTransient as err:
                refused.append(err)

    device.put(key(1), [b"\x00" * size])
    threads = [threading.Thread(target=write, args=(fill,)) for fill in range(1, writers + 1)]
    for thread in threads:
        thread.start()
    start.wait()
    reads = 0
    for _ in range(rounds):
        try:
            value = reader(device, key(1))
        except DeviceTransient as err:
            refused.append(err)
            continue
        reads += 1
        if value is None or len(value) != size or len(set(value)) != 1:
            errors.append(f"read a mixed or partial value: {None if value is None else set(value)}")
    for thread in threads:
        thread.join()
    assert not errors
    assert reads > rounds // 2, f"only {reads} of {rounds} reads answered: {refused[:3]}"
    assert read(device, key(1)) in {bytes([fill]) * size for fill in range(1, writers + 1)}


class DeviceMatchesADict(RuleBasedStateMachine):
    """Any sequence of puts and deletes leaves the device agreeing with a dict."""

    driver = ""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        self.device = DRIVERS[self.driver](Path(self._dir.name) / "device")
        self.model: dict[bytes, bytes] = {}

    keys = st.integers(0, 7).map(key)

    @rule(k=keys, parts=st.lists(st.binary(max_size=300), max_size=3))
    def put(self, k: bytes, parts: list[bytes]) -> None:
        self.device.put(k, parts)
        self.model[k] = b"".join(parts)

    @rule(k=keys)
    def delete(self, k: bytes) -> None:
        assert self.device.delete(k) is (self.model.pop(k, None) is not None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), slice_bytes=st.integers(1, 400))
    def get(self, data: st.DataObject, slice_bytes: int) -> None:
        k = data.draw(st.sampled_from(sorted(self.model)))
        assert read(self.device, k) == self.model[k]
        assert read_streamed(self.device, k, slice_bytes) == self.model[k]

    @invariant()
    def agrees(self) -> None:
        every = [key(n) for n in range(8)]
        assert self.device.exists(every) == [k in self.model for k in every]
        assert dict(self.device.scan()) == {k: len(v) for k, v in self.model.items()}

    def teardown(self) -> None:
        self.device.close()
        self._dir.cleanup()


def _machine_for(driver: str) -> type[RuleBasedStateMachine]:
    machine: type[DeviceMatchesADict] = type(f"{driver.title()}MatchesADict", (DeviceMatchesADict,), {"driver": driver})
    # Each example opens a device; an S3 client to a real server takes ~1 s to open here.
    examples = 6 if driver == "s3" else 25
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=20, deadline=None)
    return machine


# One state machine per driver, so a new driver is checked by adding it to DRIVERS.
for _driver in DRIVERS:
    globals()[f"Test{_driver.title()}MatchesADict"] = _machine_for(_driver).TestCase
