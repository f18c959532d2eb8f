"""The S3 tier's put and get beside boto3's own PUT and GET of the same bytes, against the
same server, in the same run (`bench/store.py` prints them with its file-tier figures).

The server is a real S3 server: by default moto in server mode, started here as a
subprocess on loopback (tests/support/s3_server.py); ``--s3-endpoint URL --s3-bucket
NAME`` measures another (credentials from the AWS chain). The references are boto3 raw,
two ways, the faster counting: a client with boto3's defaults (which checksum every
request and answer with CRC32), and a client with the tier's own settings (no botocore
checksums: the tier's object format verifies every byte itself). The raw PUT sends the
very bytes the tier stores (its header and the value, joined once, outside the timing);
the raw GET reads the object into a preallocated buffer, whole and in slices of the
tier's own size (the faster counts). The tier's get is a full
verified read (`Tier.read`): the GET, the checksum of every slice as it arrives, and
the header's check.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvharbor.cache.assembly import open_store
from kvharbor.cache.format import HEADER_BYTES, Codec, encode
from kvharbor.config import validate_config
from kvharbor.hal.base import STREAM_SLICE_BYTES
from kvharbor.hal.s3 import S3Device

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, for the server.


@dataclass(frozen=True)
class S3Server:
    url: str
    bucket: str


@contextlib.contextmanager
def s3_server(endpoint: str | None, bucket: str | None) -> Iterator[S3Server]:
    """The server to measure: the one named, or moto started here (stopped after)."""
    if endpoint is not None:
        if bucket is None:
            raise SystemExit("--s3-endpoint needs --s3-bucket")
        yield S3Server(endpoint, bucket)
        return
    from tests.support.s3_server import MotoServer, credentials_in_env

    server = MotoServer()
    try:
        with credentials_in_env(server.credentials):
            yield S3Server(server.url, server.bucket())
    finally:
        server.stop()


def s3_works(size: int, fingerprint: bytes, server: S3Server) -> tuple[dict[str, Callable[[], object]], Any]:
    """The timed operations by name, and the store to close after them."""
    import boto3
    import botocore.config

    tier = {
        "name": "s3",
        "type": "s3",
        "bucket": server.bucket,
        "endpoint_url": server.url,
        "region": "us-east-1",
        "capacity_gb": 1024,
    }
    store = open_store(validate_config({"storage": {"tiers": [tier]}}))
    (s3,) = store.tiers
    value = memoryview(bytearray(os.urandom(size)))
    # Puts replace the objects of a few keys in turn, as the raw PUT replaces its one: the
    # server then holds the same few objects throughout, for both.
    stored, *rotated = (os.urandom(16) for _ in range(4))
    keys = itertools.cycle(rotated)
    assert s3.write(stored, fingerprint, value), "the S3 tier did not store the value"
    scratch = memoryview(bytearray(size + HEADER_BYTES))

    def reuse(nbytes: int) -> memoryview:
        return scratch[:nbytes]

    (part,) = encode(stored, fingerprint, value, Codec.NONE, size + HEADER_BYTES)
    body = bytes(part.header) + bytes(part.payload)
    device = s3.device
    if not isinstance(device, S3Device):
        raise SystemExit(f"bench: the s3 tier opened a {type(device).__name__}, not an S3Device")
    section = device.section
    clients = {
        "defaults": boto3.client("s3", endpoint_url=server.url, region_name="us-east-1"),
        "tier_settings": boto3.client(
            "s3",
            endpoint_url=server.url,
            region_name="us-east-1",
            config=botocore.config.Config(
                max_pool_connections=section.pool_connections,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"addressing_style": "path"},
            ),
        ),
    }
    raw_name = "raw/object"
    for client in clients.values():
        client.put_object(Bucket=server.bucket, Key=raw_name, Body=body)

    def raw_put(client: Any) -> Callable[[], object]:
        return lambda: client.put_object(Bucket=server.bucket, Key=raw_name, Body=body)

    def raw_get(client: Any, slice_bytes: int) -> Callable[[], object]:
        def get() -> None:
            answer = client.get_object(Bucket=server.bucket, Key=raw_name)
            got = 0
            while got < len(body):
                got += answer["Body"].readinto(scratch[got : got + slice_bytes])

        return get

    def s3_put() -> None:
        assert s3.write(next(keys), fingerprint, value)

    def s3_get() -> None:
        assert s3.read(stored, fingerprint, reuse) is not None

    works: dict[str, Callable[[], object]] = {"s3_put": s3_put}
    works.update({f"raw_put_{name}": raw_put(client) for name, client in clients.items()})
    works["s3_get"] = s3_get
    # Read whole (urllib3 then allocates the value's size per read, page faults and all) and
    # in slices of the tier's own size (its buffers stay warm); the faster counts.
    for name, client in clients.items():
        works[f"raw_get_{name}"] = raw_get(client, len(body))
        works[f"raw_get_{name}_sliced"] = raw_get(client, STREAM_SLICE_BYTES)
    return works, store


def s3_ratios(seconds: dict[str, float]) -> dict[str, float]:
    raw_put = min(s for name, s in seconds.items() if name.startswith("raw_put_"))
    raw_get = min(s for name, s in seconds.items() if name.startswith("raw_get_"))
    return {"s3_put_vs_raw_put": raw_put / seconds["s3_put"], "s3_get_vs_raw_get": raw_get / seconds["s3_get"]}
