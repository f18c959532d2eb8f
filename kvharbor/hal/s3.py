"""An S3-compatible object store: the tier several hosts share (``type: s3``).

One value per object, named ``<prefix><32 hex digits of the key>``. The store's
own guarantees give the device protocol's: a single PUT is atomic (a reader
sees the old object, the new one or none) and a multipart upload becomes
visible only when it is completed, so a writer that dies midway leaves
nothing a reader sees. A GET reads one version of an object. Everything read
is verified by the cache above (the object format's header and checksums),
so damage, a truncated body or a foreign object is a miss, never a value.

Values above ``multipart_threshold_mb`` go up in parts of ``multipart_part_mb``
sent in parallel over the connection pool; `peek` is a ranged GET of the header
alone. Requests are bounded by the named timeouts and retried by botocore's
standard mode up to ``retries_max``; what still fails is a typed device error
(`DeviceTransient` for a server error or a timeout, `DeviceUnavailable` for
refused credentials or a missing bucket), which the tier's breaker judges.

botocore's own request and response checksums are turned off: the object format
already carries a checksum over every byte (verified on every read), and the
CRC pass would cost a second walk over each value. Credentials come from the
AWS chain (an optional ``profile``), never from kvharbor's config.

Beside the values, the prefix holds the shared budget's records under
``_kvharbor/`` (`SharedDevice`), written with S3's conditional writes
(``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace).
"""

from __future__ import annotations

import bisect
import contextlib
import email.utils
import io
import itertools
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvharbor.config import MIB, S3TierSection
from kvharbor.hal.base import (
    STREAM_SLICE_BYTES,
    Buffer,
    BufferTooSmall,
    Device,
    DeviceCorrupt,
    DeviceError,
    DeviceFull,
    DeviceTransient,
    DeviceUnavailable,
    Health,
    HealthState,
    PreconditionFailed,
    Record,
    SharedDevice,
    SliceConsumer,
    StoredObject,
    Usage,
)
from kvharbor.telemetry.log import get_logger

_log = get_logger("kvharbor.hal.s3")

INSTALL_HINT = "pip install 'kvharbor[s3]'"
RECORDS = "_kvharbor/"
"""Where under the prefix the shared records live; never a value's name (32 hex digits)."""
DELETE_BATCH_MAX = 1000
"""S3's limit of keys per DeleteObjects request."""
SIZE_CACHE_ENTRIES = 65_536
"""Sizes learned from HEADs and PUTs kept for `size`, so that a read after a lookup costs
one GET, not a HEAD and a GET (a stale size is safe: the GET's own length decides)."""
_VALUE_NAME = re.compile(r"[0-9a-f]{32}")
_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
_REFUSED = frozenset(
    {
        "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
        "InvalidToken", "AllAccessDisabled", "AccountProblem", "NoSuchBucket", "InvalidBucketName",
    }
)  # fmt: skip
_FULL = frozenset({"QuotaExceeded", "XMinioStorageFull", "EntityTooLarge"})
_PRECONDITION = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})


def _boto() -> tuple[Any, Any, Any]:
    """boto3, botocore.config and botocore.exceptions; the tier is unavailable without them."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as err:
        raise ImportError(f"requires boto3 (not installed: {err.name}); {INSTALL_HINT}") from None
    return boto3, botocore.config, botocore.exceptions


class S3Device(Device, SharedDevice):
    def __init__(self, section: S3TierSection, max_value_bytes: int) -> None:
        """Connect and check the bucket answers; raises `DeviceUnavailable` naming the
        setting at fault (boto3 missing, ``profile``, credentials, ``endpoint_url``, ``bucket``)."""
        super().__init__(section.name, max_value_bytes)
        self.section = section
        self.bucket = section.bucket
        self.prefix = section.prefix
        try:
            boto3, config, self._errors = _boto()
        except ImportError as err:
            raise DeviceUnavailable(self.name, f"s3 tier '{self.name}' {err}") from None
        self._multipart_threshold_bytes = section.multipart_threshold_mb * MIB
        self._part_bytes = section.multipart_part_mb * MIB
        self._encryption: dict[str, str] = {}
        if section.sse != "none":
            self._encryption["ServerSideEncryption"] = section.sse
        if section.sse_kms_key_id is not None:
            self._encryption["SSEKMSKeyId"] = section.sse_kms_key_id
        try:
            session = boto3.Session(profile_name=section.profile, region_name=section.region)
        except self._errors.ProfileNotFound:
            raise DeviceUnavailable(
                self.name, f"tier '{self.name}': profile {section.profile!r} is not in the AWS config files"
            ) from None
        settings = config.Config(
            max_pool_connections=section.pool_connections,
            connect_timeout=section.connect_timeout_ms / 1000,
            read_timeout=section.read_timeout_ms / 1000,
            retries={"total_max_attempts": section.retries_max + 1, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if section.endpoint_url else None,
        )
        # No region anywhere is no error: S3 then signs for us-east-1, as the AWS CLI does.
        self._client = session.client("s3", endpoint_url=section.endpoint_url, config=settings)
        self._pool = ThreadPoolExecutor(section.pool_connections, thread_name_prefix=f"kvharbor-s3-{self.name}")
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._sizes_lock = threading.Lock()
        try:
            self._check_bucket()
        except BaseException:
            self.close()
            raise

    # -- values ------------------------------------------------------------

    def put(self, key: bytes, parts: Sequence[Buffer]) -> None:
        total = self.check_value_size(parts)
        name = self._name(key)
        body = PartsReader(parts)
        with self._translated(f"put {name}"):
            if total <= self._multipart_threshold_bytes:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=body, **self._encryption)
            else:
                self._put_multipart(name, body)
        self._learn_size(key, total)

    def get(self, key: bytes, into: memoryview) -> int | None:
        return self.get_streamed(key, into, _ignore, STREAM_SLICE_BYTES)

    def get_streamed(
        self,
        key: bytes,
        into: memoryview,
        consume: SliceConsumer,
        slice_bytes: int = STREAM_SLICE_BYTES,
    ) -> int | None:
        """One GET (one version of the object), read from the socket a slice at a time."""
        assert slice_bytes > 0, slice_bytes
        name = self._name(key)
        view = _bytes_view(into)
        with self._translated(f"get {name}"):
            answer = self._answer(self._client.get_object, Key=name)
            if answer is None:
                self._forget_size(key)
                return None
            body = answer["Body"]
            try:
                size = int(answer["ContentLength"])
                if size > view.nbytes:
                    # Replaced by a longer value (another host) since `size` said less: the
                    # next `size` must say this one's, or the caller would never fit it.
                    self._learn_size(key, size)
                    raise BufferTooSmall(self.name, size, view.nbytes)
                got = 0
                while got < size:
                    piece = view[got : min(got + slice_bytes, size)]
                    n = body.readinto(piece)
                    if not n:
                        break
                    consume(piece[:n])
                    got += n
            finally:
                body.close()
        if got != size:
            raise DeviceCorrupt(self.name, f"{name}: the body ended after {got} of {size} bytes")
        return size

    def peek(self, key: bytes, into: memoryview) -> int | None:
        """A ranged GET of the first ``into.nbytes`` bytes."""
        name = self._name(key)
        view = _bytes_view(into)
        with self._translated(f"peek {name}"):
            try:
                answer = self._answer(self._client.get_object, Key=name, Range=f"bytes=0-{view.nbytes - 1}")
            except self._errors.ClientError as err:
                if _code(err) != "InvalidRange":
                    raise
                return 0 if self._head(key) is not None else None  # An empty object has no first byte.
            if answer is None:
                return None
            data = answer["Body"].read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def size(self, key: bytes) -> int | None:
        with self._sizes_lock:
            known = self._sizes.get(key)
        return known if known is not None else self._head(key)

    def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        if len(keys) <= 1:
            return [self._head(key) for key in keys]
        return list(self._pool.map(self._head, keys))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [size is not None for size in self.sizes(keys)]

    def delete(self, key: bytes) -> bool:
        # S3's DELETE answers the same for an absent key: a HEAD first tells them apart.
        # Not a hot path: the shared budget evicts with `delete_many`.
        if self._head(key) is None:
            return False
        self.delete_many([key])
        return True

    def delete_many(self, keys: Sequence[bytes]) -> None:
        for start in range(0, len(keys), DELETE_BATCH_MAX):
            batch = keys[start : start + DELETE_BATCH_MAX]
            objects = [{"Key": self._name(key)} for key in batch]
            with self._translated(f"delete {len(batch)} objects under {self.prefix}"):
                answer = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
            failed = answer.get("Errors") or []
            if failed:
                first = failed[0]
                raise DeviceTransient(
                    self.name, f"delete of {len(failed)} objects failed ({first.get('Code')}: {first.get('Message')})"
                )
            for key in batch:
                self._forget_size(key)

    def scan(self) -> Iterator[tuple[bytes, int]]:
        for stored in self.listing():
            yield stored.key, stored.nbytes

    def listing(self) -> Iterator[StoredObject]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        with self._translated(f"list {self.prefix}"):
            for page in pages:
                for item in page.get("Contents", ()):
                    name = item["Key"][len(self.prefix) :]
                    if _VALUE_NAME.fullmatch(name):
                        yield StoredObject(bytes.fromhex(name), int(item["Size"]), item["LastModified"].timestamp())

    # -- shared records ------------------------------------------------------

    def read_record(self, name: str) -> Record | None:
        full = self.prefix + RECORDS + name
        with self._translated(f"read {full}"):
            answer = self._answer(self._client.get_object, Key=full)
            if answer is None:
                return None
            body = answer["Body"].read()
        now_s = _server_time_s(answer, time.time())
        return Record(body, answer["ETag"], max(0.0, now_s - answer["LastModified"].timestamp()))

    def write_record(self, name: str, body: bytes, replaces: str | None) -> str:
        full = self.prefix + RECORDS + name
        condition = {"IfNoneMatch": "*"} if replaces is None else {"IfMatch": replaces}
        with self._translated(f"write {full}"):
            answer = self._client.put_object(Bucket=self.bucket, Key=full, Body=body, **condition, **self._encryption)
        return str(answer["ETag"])

    def abort_uploads(self, older_than_s: float) -> int:
        aborted = 0
        with self._translated(f"list uploads under {self.prefix}"):
            answer = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
            now_s = _server_time_s(answer, time.time())
            for upload in answer.get("Uploads", ()):
                if now_s - upload["Initiated"].timestamp() > older_than_s:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted

    # -- state -------------------------------------------------------------

    def usage(self) -> Usage:
        """A listing of the prefix: every host's values (an object store has no size of its own)."""
        used = keys = 0
        for stored in self.listing():
            used, keys = used + stored.nbytes, keys + 1
        return Usage(used, max(used, self.section.capacity_bytes), keys)

    def health(self) -> Health:
        try:
            self._check_bucket()
        except DeviceError as err:
            return Health(HealthState.FAILED, str(err))
        return Health(HealthState.OK)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    # -- internals ---------------------------------------------------------

    def _name(self, key: bytes) -> str:
        assert len(key) == 16, len(key)
        return self.prefix + key.hex()

    def _check_bucket(self) -> None:
        where = self.section.endpoint_url or f"AWS region {self._client.meta.region_name}"
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except self._errors.ClientError as err:
            code = _code(err)
            if code in ("404", "NoSuchBucket"):
                raise DeviceUnavailable(self.name, f"bucket {self.bucket!r} does not exist at {where}") from None
            if code in _REFUSED:
                raise DeviceUnavailable(
                    self.name,
                    f"bucket {self.bucket!r} at {where} refused the credentials of the AWS chain"
                    f"{f' (profile {self.section.profile!r})' if self.section.profile else ''}: {code}",
                ) from None
            raise DeviceTransient(self.name, f"bucket {self.bucket!r} at {where}: {code}") from None
        except self._errors.NoCredentialsError:
            raise DeviceUnavailable(
                self.name, "no credentials in the AWS chain (environment, credentials file, profile, role)"
            ) from None
        except self._errors.BotoCoreError as err:
            named = f"endpoint_url {where}" if self.section.endpoint_url else where
            raise DeviceUnavailable(self.name, f"{named} does not answer: {err}") from None

    def _head(self, key: bytes) -> int | None:
        name = self._name(key)
        with self._translated(f"head {name}"):
            answer = self._answer(self._client.head_object, Key=name)
        if answer is None:
            self._forget_size(key)
            return None
        size = int(answer["ContentLength"])
        self._learn_size(key, size)
        return size

    def _answer(self, call: Any, **request: Any) -> Any:
        """``call``'s answer, or None for a missing object."""
        try:
            return call(Bucket=self.bucket, **request)
        except self._errors.ClientError as err:
            if _code(err) in _MISSING:
                return None
            raise

    def _put_multipart(self, name: str, body: PartsReader) -> None:
        """Upload ``body`` in parts, in parallel; visible only once completed, aborted on failure."""
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=name, **self._encryption)["UploadId"]
        try:

            def send(number: int) -> dict[str, Any]:
                start = (number - 1) * self._part_bytes
                part = body.range(start, self._part_bytes)
                answer = self._client.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=upload, PartNumber=number, Body=part
                )
                return {"PartNumber": number, "ETag": answer["ETag"]}

            count = -(-body.nbytes // self._part_bytes)
            done = list(self._pool.map(send, range(1, count + 1)))
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload, MultipartUpload={"Parts": done}
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            except Exception as err:  # The evictor aborts it later (abandoned_upload_s).
                _log.debug("kvharbor: tier %s: abort of upload %s failed: %s", self.name, upload, err)
            raise

    def _learn_size(self, key: bytes, size: int) -> None:
        with self._sizes_lock:
            self._sizes[bytes(key)] = size
            self._sizes.move_to_end(key)
            if len(self._sizes) > SIZE_CACHE_ENTRIES:
                self._sizes.popitem(last=False)

    def _forget_size(self, key: bytes) -> None:
        with self._sizes_lock:
            self._sizes.pop(key, None)

    @contextlib.contextmanager
    def _translated(self, action: str) -> Iterator[None]:
        """Turn what boto3 raises inside into the device's typed errors, naming ``action``."""
        errors = self._errors
        try:
            yield
        except DeviceError:
            raise
        except (errors.ClientError, errors.BotoCoreError) as err:
            raise self._error(err, action) from err
        except OSError as err:
            raise DeviceTransient(self.name, f"{action}: {err}") from err

    def _error(self, err: Exception, action: str) -> DeviceError:
        """The typed device error of a boto3 or botocore exception."""
        errors = self._errors
        if isinstance(err, errors.ClientError):
            code = _code(err)
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            message = f"{action}: {code} (HTTP {status})"
            if code in _PRECONDITION:
                return PreconditionFailed(self.name, message)
            if code in _REFUSED:
                return DeviceUnavailable(self.name, message)
            if code in _FULL:
                return DeviceFull(self.name, message)
            return DeviceTransient(self.name, message)
        if isinstance(err, errors.NoCredentialsError):
            return DeviceUnavailable(self.name, f"{action}: no credentials in the AWS chain")
        if isinstance(err, errors.EndpointConnectionError):
            return DeviceUnavailable(self.name, f"{action}: {err}")
        return DeviceTransient(self.name, f"{action}: {err}")


class PartsReader(io.RawIOBase):
    """The parts of a value as one seekable stream: the request body of a put, read
    straight out of the caller's buffers.

    botocore takes bytes or a file; joining a header and a 32 MiB payload into bytes
    first cost a whole extra pass over memory (70-170 ms on this machine, more than the
    copy botocore makes anyway as it sends), where a stream over the parts costs none."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        super().__init__()
        self._views = [memoryview(part).cast("B") for part in parts if memoryview(part).nbytes]
        self._starts = list(itertools.accumulate((view.nbytes for view in self._views), initial=0))
        self.nbytes = self._starts[-1]
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.nbytes}[whence]
        self._position = min(max(base + offset, 0), self.nbytes)
        return self._position

    def readinto(self, into: Any) -> int:
        target = memoryview(into).cast("B")
        got = 0
        while got < target.nbytes and self._position < self.nbytes:
            index = bisect.bisect_right(self._starts, self._position) - 1
            view = self._views[index]
            offset = self._position - self._starts[index]
            n = min(view.nbytes - offset, target.nbytes - got)
            target[got : got + n] = view[offset : offset + n]
            got += n
            self._position += n
        return got

    def range(self, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer at the end), as bytes (one multipart part)."""
        self.seek(start)
        return self.read(length) or b""


def _code(err: Any) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _server_time_s(answer: Any, fallback_s: float) -> float:
    """The server's clock from an answer's ``Date`` header (whole seconds)."""
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        return fallback_s
    try:
        return email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return fallback_s


def _bytes_view(into: memoryview) -> memoryview:
    assert into.contiguous and not into.readonly, "get needs a writable contiguous buffer"
    return into if into.format == "B" else into.cast("B")


def _ignore(_piece: memoryview) -> None:
    return None


def open_s3_device(section: S3TierSection, max_value_bytes: int) -> S3Device:
    """The driver for a ``type: s3`` tier section."""
    return S3Device(section, max_value_bytes)
