"""The S3 tier against a real S3 server (moto, a subprocess on loopback): bad input, faults
through a real HTTP proxy that answers 500s or hangs, damage, multipart, a writer killed
mid-upload, and the shared budget kept by one lease holder among several hosts' indexes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharbor.cache.assembly import open_store
from kvharbor.cache.breaker import BreakerState
from kvharbor.cache.format import HEADER_BYTES
from kvharbor.cache.index import Entry
from kvharbor.cache.keys import LayoutFingerprint
from kvharbor.cache.shared import LEASE_RECORD, LeaseBody, SharedIndex, SharedSettings
from kvharbor.cache.store import TieredStore
from kvharbor.config import MIB, ConfigError, S3TierSection, validate_config
from kvharbor.hal.base import BufferTooSmall
from kvharbor.hal.s3 import S3Device
from tests.support.s3_server import (
    FaultProxy,
    Mode,
    MotoServer,
    credentials_in_env,
    moto_server,
    s3_device_on,
    s3_tier,
    shared_server,
)

FINGERPRINT = LayoutFingerprint("m", 16).digest()
WAIT_S = 30.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> MotoServer:
    return shared_server()


@pytest.fixture
def proxy(server: MotoServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(server.url)
    yield proxy
    proxy.close()


def wait_until(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    """Re-check ``condition`` (each check a real request) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"


def config(*tiers: dict[str, Any], **storage: Any) -> Any:
    return validate_config(
        # No local fallback: a test whose S3 tier is skipped sees the RAM tier alone.
        {
            "storage": {
                "tiers": [{"name": "ram", "type": "ram", "capacity_gb": 0.05}, *tiers],
                "fallback_path": None,
                **storage,
            }
        }
    )


def store_of(server: MotoServer, *tiers: dict[str, Any], **storage: Any) -> TieredStore:
    with credentials_in_env(server.credentials):
        return open_store(config(*tiers, **storage))


def s3_only(store: TieredStore) -> Any:
    (tier,) = [t for t in store.tiers if t.device_type == "s3"]
    return tier


# -- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"bucketz": "x"}, "bucketz: Extra inputs are not permitted"),
        ({"pool_connections": "many"}, "pool_connections: Input should be a valid integer"),
        ({"read_timeout_ms": 0}, "read_timeout_ms: Input should be greater than 0"),
        ({"bucket": "No_Such"}, "bucket: String should match pattern"),
        ({"sse": "rot13"}, "sse: Input should be 'none', 'AES256' or 'aws:kms'"),
        ({"sse_kms_key_id": "k1"}, "sse_kms_key_id needs sse: aws:kms"),
        ({"endpoint_url": "localhost:9000"}, "endpoint_url: String should match pattern"),
        ({"lease_s": 5, "budget_interval_s": 10}, "lease_s (5) must exceed budget_interval_s (10)"),
        ({"multipart_threshold_mb": 4}, "multipart_threshold_mb: Input should be greater than or equal to 5"),
    ],
)
def test_a_config_mistake_is_refused_naming_the_tier_and_the_key(change: dict[str, Any], named: str) -> None:
    tier = {**s3_tier("http://127.0.0.1:1", "kvh-bucket"), **change}
    with pytest.raises(ConfigError) as refused:
        config(tier)
    assert "tiers[1] (s3)" in str(refused.value)
    assert named in str(refused.value)


def test_a_tier_without_a_bucket_is_skipped_naming_the_key(caplog: pytest.LogCaptureFixture) -> None:
    """A missing required key skips the tier (the rest of the cache works), as for every tier type."""
    caplog.set_level(logging.INFO)
    tier = s3_tier("http://127.0.0.1:1", "kvh-bucket")
    del tier["bucket"]
    assert "bucket" in skipped_because(open_store(config(tier)), caplog)


def skipped_because(store: TieredStore, caplog: pytest.LogCaptureFixture) -> str:
    """The tier s3 was skipped, the RAM tier serves, and the log said why once."""
    assert [t.name for t in store.tiers] == ["ram"]
    assert store.put(b"k" * 16, FINGERPRINT, b"value")
    assert bytes(store.get(b"k" * 16, FINGERPRINT) or b"") == b"value"
    lines = [r.getMessage() for r in caplog.records if "tier s3 unavailable" in r.getMessage()]
    assert len(lines) == 1, lines
    store.close()
    return lines[0]


def test_a_missing_bucket_skips_the_tier_and_says_so(server: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    store = store_of(server, s3_tier(server.url, "kvh-never-made"))
    assert "bucket 'kvh-never-made' does not exist" in skipped_because(store, caplog)


def test_an_unreachable_endpoint_skips_the_tier_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    # A port nothing listens on: connection refused.
    with credentials_in_env(shared_server().credentials):
        store = open_store(config(s3_tier("http://127.0.0.1:9", "kvh-bucket")))
    assert "endpoint_url http://127.0.0.1:9 does not answer" in skipped_because(store, caplog)


def test_bad_credentials_skip_the_tier_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with moto_server(authenticated=True) as guarded:
        bucket = guarded.bucket()
        good = store_of(guarded, s3_tier(guarded.url, bucket))
        assert [t.name for t in good.tiers] == ["ram", "s3"]  # The fixture's own key works.
        good.close()
        with credentials_in_env(type(guarded.credentials)("AKIAWRONGKEY", "wrong-secret")):
            store = open_store(config(s3_tier(guarded.url, bucket)))
    assert f"bucket '{bucket}' at {guarded.url} refused the credentials" in skipped_because(store, caplog)


def test_an_unknown_profile_skips_the_tier_naming_it(
    server: MotoServer, caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    store = store_of(server, s3_tier(server.url, server.bucket(), profile="nobody"))
    assert "profile 'nobody' is not in the AWS config files" in skipped_because(store, caplog)


def test_without_boto3_the_tier_is_unavailable_naming_the_extra(server: MotoServer) -> None:
    # A real process whose boto3 cannot be imported (as where the extra is not installed).
    script = textwrap.dedent(
        f"""
        import logging, sys
        sys.modules["boto3"] = None
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from kvharbor.cache.assembly import open_store
        from kvharbor.config import validate_config
        tier = {s3_tier(server.url, "kvh-bucket")!r}
        store = open_store(validate_config({{"storage": {{"tiers": [tier], "fallback_path": None}}}}))
        print("tiers:", [t.name for t in store.tiers])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S, cwd=REPO, check=True
    )
    assert "tiers: []" in done.stdout
    assert "tier s3 unavailable: s3: s3 tier 's3' requires boto3 (not installed: boto3); " in done.stderr
    assert "pip install 'kvharbor[s3]'" in done.stderr


# -- values ---------------------------------------------------------------------------


def test_another_host_hits_what_one_stored_and_damage_is_a_miss(server: MotoServer) -> None:
    bucket = server.bucket()
    tier = s3_tier(server.url, bucket, miss_ttl_ms=60_000)
    a, b = store_of(server, tier), store_of(server, tier)
    try:
        key, other = bytes(range(16)), bytes(range(1, 17))
        assert s3_only(b).contains([key]) == [False]  # Asked, absent: remembered for miss_ttl_ms.
        assert a.put(key, FINGERPRINT, b"v" * 5000)
        assert a.put(other, FINGERPRINT, b"w" * 5000)
        assert a.settle(WAIT_S)  # The S3 tier, below RAM, is written from its queue.
        value = s3_only(b).read(other, FINGERPRINT)
        assert value is not None and bytes(value) == b"w" * 5000  # B never stored it: found on S3.
        assert s3_only(b).contains([key]) == [False]  # Still within miss_ttl_ms of its miss.
        # Damage at rest: another key's object under this key's name. Verified, a miss, dropped.
        raw = server.client()
        stored = raw.get_object(Bucket=bucket, Key=f"kvharbor/{other.hex()}")["Body"].read()
        raw.put_object(Bucket=bucket, Key=f"kvharbor/{key.hex()}", Body=stored)
        fresh = store_of(server, tier)
        assert s3_only(fresh).read(key, FINGERPRINT) is None
        assert s3_only(fresh).counters.corrupt == 1
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket, Prefix=f"kvharbor/{key.hex()}")
        fresh.close()
    finally:
        a.close()
        b.close()


def test_a_value_above_the_threshold_goes_up_in_parts(server: MotoServer, proxy: FaultProxy) -> None:
    device = s3_device_on(server, 64 * MIB, url=proxy.url, multipart_threshold_mb=5, multipart_part_mb=5, sse="AES256")
    try:
        value = os.urandom(12 * MIB)
        before = proxy.requests
        device.put(bytes(16), [value[:HEADER_BYTES], value[HEADER_BYTES:]])
        assert proxy.requests - before == 5  # Create, three parts, complete.
        into = memoryview(bytearray(len(value)))
        assert device.get(bytes(16), into) == len(value)
        assert bytes(into) == value
        head = server.client().head_object(Bucket=device.bucket, Key=f"kvharbor/{bytes(16).hex()}")
        assert head["ServerSideEncryption"] == "AES256"
    finally:
        device.close()


WRITER = """
import sys
from kvharbor.config import S3TierSection
from kvharbor.hal.base import BufferTooSmall
from kvharbor.hal.s3 import S3Device
section = S3TierSection.model_validate_json(sys.argv[1])
device = S3Device(section, 64 << 20)
print("writing", flush=True)
device.put(bytes(16), [bytes(12 << 20)])
print("stored", flush=True)
"""


def test_a_writer_killed_mid_upload_leaves_nothing_readable(server: MotoServer, proxy: FaultProxy) -> None:
    bucket = server.bucket()
    section = S3TierSection.model_validate(
        s3_tier(proxy.url, bucket, multipart_threshold_mb=5, multipart_part_mb=5, read_timeout_ms=60_000)
    )
    # The second part never arrives: the writer is stuck mid-upload when it is killed.
    proxy.mode(Mode.HANG, lambda method, path: method == "PUT" and "partNumber=2" in path)
    env = {**os.environ, **server.credentials.env(), "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, section.model_dump_json()], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: proxy.faulted >= 1, "the writer reaching its second part")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(WAIT_S)
    proxy.mode(Mode.PASS)
    raw = server.client()
    assert len(raw.list_multipart_uploads(Bucket=bucket, Prefix="kvharbor/").get("Uploads", [])) == 1
    reader = s3_device_on(server, 64 * MIB, bucket=bucket, multipart_threshold_mb=5, multipart_part_mb=5)
    try:
        assert reader.exists([bytes(16)]) == [False]
        assert reader.get(bytes(16), memoryview(bytearray(13 << 20))) is None
        # The lease holder aborts the abandoned upload once it is older than abandoned_upload_s.
        index = SharedIndex(reader, "s3", SharedSettings(1 << 30, 0, 0.2, 1.0, 0.5), holder="h")
        try:
            wait_until(
                lambda: not raw.list_multipart_uploads(Bucket=bucket).get("Uploads"), "the abandoned upload aborted"
            )
        finally:
            index.close()
    finally:
        reader.close()


# -- faults ---------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [Mode.ERROR, Mode.HANG])
def test_a_failing_server_opens_the_breaker_and_its_return_closes_it(
    server: MotoServer, proxy: FaultProxy, fault: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # A cooldown long enough to outlast the queue's failing writes: still open when read below.
    breaker = {"failure_ratio": 0.5, "window": 4, "cooldown_s": 3.0}
    store = store_of(
        server,
        s3_tier(proxy.url, server.bucket(), read_timeout_ms=300, miss_ttl_ms=0),
        backpressure={"circuit_breaker": breaker},
    )
    tier = s3_only(store)
    try:
        keys = [bytes([n]) * 16 for n in range(8)]
        assert store.put(keys[0], FINGERPRINT, b"x" * 1000)
        assert store.settle(WAIT_S)  # On S3 before the fault (the tier is written from its queue).
        proxy.mode(fault)
        for key in keys:
            store.put(key, FINGERPRINT, b"y" * 1000)  # Stored in RAM; the S3 write fails.
        assert store.settle(WAIT_S)
        assert tier.breaker.state is BreakerState.OPEN
        assert tier.counters.errors >= 2
        assert bytes(store.get(keys[1], FINGERPRINT) or b"") == b"y" * 1000  # The RAM tier serves on.
        faulted = proxy.faulted
        assert tier.read(keys[0], FINGERPRINT) is None  # Open: not even asked.
        assert proxy.faulted == faulted
        proxy.mode(Mode.PASS)
        wait_until(lambda: tier.probe() is BreakerState.CLOSED, "the breaker closing")
        value = tier.read(keys[0], FINGERPRINT)
        assert value is not None and bytes(value) == b"x" * 1000
        messages = [r.getMessage() for r in caplog.records]
        assert sum("tier 's3' circuit breaker open" in m for m in messages) == 1
        assert sum("tier 's3' answers again; breaker closed" in m for m in messages) == 1
    finally:
        store.close()


# -- the shared budget ---------------------------------------------------------------


def test_one_lease_holder_keeps_the_budget_of_every_host(server: MotoServer) -> None:
    bucket = server.bucket()
    capacity = 40_000
    settings = SharedSettings(capacity, 0, 3600, 7200, 3600)  # Sweeps by hand only.
    devices = [s3_device_on(server, 1 * MIB, bucket=bucket) for _ in range(3)]
    hosts = [SharedIndex(device, "s3", settings, holder=f"host-{n}") for n, device in enumerate(devices)]
    try:
        for n, device in enumerate(devices):
            for i in range(10):
                device.put(bytes([n, i]) * 8, [b"v" * 3000])  # 90 kB in all: over the budget.
        held = [host.sweep() for host in hosts]
        assert held == [True, False, False]  # The first took the free lease; it is live for the others.
        holder = hosts[0].holder
        listed = list(devices[0].listing())
        assert sum(s.nbytes for s in listed) <= capacity
        assert len(listed) == capacity // 3000
        record = devices[1].read_record(LEASE_RECORD)
        assert record is not None
        lease = LeaseBody.decode(record.body)
        assert lease == LeaseBody(holder, sum(s.nbytes for s in listed), len(listed), 30 - len(listed))
        assert hosts[2].used_bytes() == lease.used_bytes  # Every host reports the shared totals.
        assert hosts[2].count() == len(listed)
    finally:
        for host in hosts:
            host.close()
        for device in devices:
            device.close()


def test_a_lapsed_lease_is_taken_over_by_exactly_one_host(server: MotoServer) -> None:
    bucket = server.bucket()
    settings = SharedSettings(1 << 30, 0, 0.5, 6.0, 3600)
    devices = [s3_device_on(server, 1 * MIB, bucket=bucket) for _ in range(3)]
    first = SharedIndex(devices[0], "s3", settings, holder="first")
    try:
        wait_until(lambda: _holder(devices[1]) == "first", "the first host holding the lease")
    finally:
        first.close()  # It stops renewing: its lease lapses after lease_s by the server's clock.
    others = [SharedIndex(device, "s3", settings, holder=f"next-{n}") for n, device in enumerate(devices[1:])]
    try:
        wait_until(lambda: _holder(devices[0]) in ("next-0", "next-1"), "another host taking over")
        holder = _holder(devices[0])
        # Renewed by the winner from now on, never stolen by the other while it lives.
        for _ in range(3):
            wait_until(lambda: _age(devices[0]) < settings.lease_s, "the winner renewing")
            assert _holder(devices[0]) == holder
    finally:
        for host in others:
            host.close()
        for device in devices:
            device.close()


def _holder(device: S3Device) -> str | None:
    record = device.read_record(LEASE_RECORD)
    lease = None if record is None else LeaseBody.decode(record.body)
    return None if lease is None else lease.holder


def _age(device: S3Device) -> float:
    record = device.read_record(LEASE_RECORD)
    assert record is not None
    return record.age_s


def test_what_a_host_remembers_is_bounded_and_what_it_forgot_is_asked_again(server: MotoServer) -> None:
    device = s3_device_on(server, 1 * MIB)
    index = SharedIndex(device, "s3", SharedSettings(10_000, 0, 3600, 7200, 3600), holder="h")
    try:
        keys = [bytes([n]) * 16 for n in range(6)]
        for key in keys:
            device.put(key, [b"v" * 3000])
            assert index.admit(Entry(key, 3000, 1), 10_000) == []  # The shared sweep evicts, never admit.
        assert index.get(keys[0]) is None and index.get(keys[-1]) is not None  # Forgotten here, oldest first.
        assert len(index.lru(100)) == 3
        assert index.contains(keys) == [True] * 6  # Asked of the store: all still there.
        assert len(list(device.listing())) == 6
    finally:
        index.close()
        device.close()


def test_a_value_replaced_by_a_longer_one_elsewhere_is_read_after_one_miss(server: MotoServer) -> None:
    # Host A knows the short value's size; host B replaces it with a longer one.
    a = s3_device_on(server, 1 * MIB)
    b = s3_device_on(server, 1 * MIB, bucket=a.bucket)
    try:
        a.put(bytes(16), [b"s" * 100])
        assert a.size(bytes(16)) == 100
        b.put(bytes(16), [b"L" * 5000])
        with pytest.raises(BufferTooSmall):
            a.get(bytes(16), memoryview(bytearray(a.size(bytes(16)) or 0)))
        size = a.size(bytes(16))
        assert size == 5000
        into = memoryview(bytearray(size))
        assert a.get(bytes(16), into) == 5000 and bytes(into) == b"L" * 5000
    finally:
        a.close()
        b.close()
