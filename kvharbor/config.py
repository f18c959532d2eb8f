"""The one validated configuration: YAML file, then environment overrides.

Sources, later ones winning:
1. the defaults below;
2. a YAML file: ``--config FILE`` or ``KVHARBOR_CONFIG``;
3. ``KVHARBOR__SECTION__KEY=value`` variables, e.g. ``KVHARBOR__ENGINE__CHUNK_SIZE=512``
   (values are read as YAML scalars, so ``true``, ``512`` and ``1.5`` keep their types).

A bad value is refused with `ConfigError`, whose message names the key (as a
dotted path) and the expected form; nothing starts on a bad config.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

ENV_CONFIG = "KVHARBOR_CONFIG"
ENV_OVERRIDE_PREFIX = "KVHARBOR__"
GIB = 1 << 30
MIB = 1 << 20
UNIX_SOCKET_PATH_BYTES_MAX = 107
CPUS_MAX = 8192
"""The most CPUs a Linux kernel is built for (``CONFIG_NR_CPUS``'s largest value)."""
"""sizeof(sockaddr_un.sun_path) - 1 on Linux: a longer socket path cannot be bound."""


class ConfigError(ValueError):
    """A configuration the user must fix; the message is meant for them."""


class _Section(BaseModel):
    # Unknown keys are refused: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSection(_Section):
    chunk_size: int = Field(256, gt=0, description="tokens per stored chunk")
    """Left unset, an engine whose blocks do not divide it rounds it up to whole blocks
    (`chunk_size_for`); SGLang stores one chunk per page (``--page-size``)."""
    key_namespace: str = Field("default", min_length=1, max_length=128)
    require_cache_salt: bool = False
    verify_wait_ms: int = Field(
        2000, ge=0, description="how long a request waits for its stored chunks to be read back"
    )
    """Stored chunks outside a shared-memory RAM tier (on files) are read back in full before
    the engine is told it has them; a request waits at most this long (other requests are
    scheduled meanwhile). Past it, the chunks not read back by then are recomputed, not
    promised. 0: only chunks in RAM are promised."""
    load_resample_s: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="seconds a load rate that says recompute is trusted unmeasured"
    )
    """The engine recomputes a stored prefix when its measured load rate says restoring
    it is slower; recomputing measures no load, so after this long without a new sample
    the rate is forgotten and the next stored prefix is loaded to measure it again (cut
    short by the worker if it is still slow). Without it one slow stretch of a disk would
    keep every later prefix recomputed for the engine's life."""
    load_resample_max_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="longest wait between re-measurements that find it slow"
    )
    """Each re-measurement that still says recompute doubles the wait for the next, up
    to this: an engine with a slow tier and few requests does not restore on each of them."""
    verify_idle_wait_ms: int = Field(
        10, ge=0, description="longest pause of an idle engine step for a read-back to finish"
    )
    """An engine whose only requests wait for their read-back steps without running anything,
    and in Python such a loop starves the read-back's thread of the interpreter (its answer
    arrived 2 s late on a loaded 2-core machine: past ``verify_wait_ms``). Such a step waits
    for the read-back instead, at most this long; a request arriving meanwhile starts at most
    this much later. 0: never wait."""
    # The worker's data path (`connector.vllm.datapath`); none of these changes what is stored.
    load_start_wait_ms: float = Field(
        10.0, ge=0, allow_inf_nan=False, description="longest wait for an early restore's copies to get ahead"
    )
    """A step's restores start on the loader thread before vLLM asks for them (`handoff`), but
    while vLLM's thread prepares the step (12-29 ms at 130,000 tokens on an H100 or H200) it
    holds the interpreter and the loader queues next to nothing. The engine's thread therefore
    waits, at most this long, until the copies are as far ahead of the copy engine as they get:
    ``loads_in_flight_max`` requests still being copied, or all of them started (on a CPU,
    whose loader makes the copies itself, its first request copied); the copy engine then
    works through them beside vLLM's preparation. 0: never wait."""
    load_batch_mb: int = Field(256, gt=0, le=4096, description="MiB asked of the gateway per load request")
    """Also the size of each of the two device staging slots a GPU's loads pass through (one is
    copied in while the other is scattered): 256 MiB keeps the copy engines busy on the H200."""
    loads_in_flight_max: int = Field(
        2, gt=0, le=64, description="load requests whose copies a GPU may have queued at once"
    )
    """A GPU's loads of one step are queued ahead of its copy engine, each request of
    ``load_batch_mb`` holding its values in the gateway until its copy is done, so that the
    copies go on while the loader thread waits for the interpreter (vLLM's thread holds it
    while it prepares the step). Requests whose values the gateway copied into its ring (not
    served in place from a RAM tier) hold at most half the ring between them. On a CPU each
    request is copied within the step, one at a time. The copies vLLM's preparation of the step
    can overlap are at most this many requests' (`load_start_wait_ms`): 256 MiB is 4.6-4.9 ms
    at 55 GB/s. Default 2 (one per staging slot): depths 8 and 16 gave no end-to-end gain
    beyond the hosts' noise on an H200, when the engine's thread waited for requests queued
    rather than still being copied (docs/performance.md)."""
    load_layered_mb: int = Field(
        2048, ge=0, le=65536, description="MiB at the end of a step's restore copied in layer by layer"
    )
    """The last requests of a step's restore (about this many MiB, whole ``load_batch_mb``
    requests; the whole restore when it is smaller) are held in the gateway until all are
    answered, then copied in one layer at a time: every chunk's pages of the first layer,
    then of the next. The engine's forward pass starts once the gateway has answered, and
    computes each layer as soon as that layer is in, while the later layers are still being
    copied; the copies of a chunk-by-chunk restore end together, and the whole forward pass
    would follow them. Enough to cover the forward pass of a long prompt's tail: 2 GiB take
    ~39 ms at 55 GB/s, about that forward at 130,000 tokens on an H200. Only values the
    gateway serves in place (a RAM tier) are held; values it copied into its ring stream
    chunk by chunk. On a GPU at most as many chunks as fit a staging slot one layer at a
    time. 0: every restore chunk by chunk."""
    load_layered_row_mb: int = Field(
        4, ge=0, le=256, description="least MiB of a chunk a GPU's layered restore copies at once"
    )
    """A layered restore (``load_layered_mb``) on a GPU copies each held chunk's pages of as many
    consecutive layers at once as make this much (a staging slot's worth at most) and releases
    them to the forward pass together: a chunk stores its layers one after another, so these
    are rows of one two-dimensional copy. Rows of one Llama-3.1-8B layer (1 MiB per 256-token
    chunk) crossed at ~37 GB/s on an H100 against ~52 GB/s for whole chunks (pinned copies of
    1 MiB run at 36-39 GB/s there, at 53-55 from 16 MiB); four layers are 4 MiB. 0: one layer
    at a time. On a CPU every layer is copied on its own (no DMA)."""
    save_staging_mb_max: int = Field(4096, gt=0, description="memory saves waiting for their copy out may hold")
    """GPU memory on a GPU, where every step's saves are gathered into it (at least one chunk
    is always allowed); host memory on the CPU, where a step copies its saves into it only
    while the saver is busy with earlier ones (else straight into shared memory). Past it a
    step's further chunks are not saved (future misses, counted in ``save_dropped``)."""
    save_staging_wait_ms: int = Field(0, ge=0, description="how long a GPU step waits for save staging room")
    """Room is given back as earlier saves land in shared memory, which waits for the storage
    write under way: a step that waited would run at the storage's pace. 0: it never waits,
    and its chunks that find no room are dropped (counted in ``save_dropped``); the engine
    keeps its speed. Raise it to trade step time for saves."""
    prefill_sample_stall_ms_max: float = Field(5.0, ge=0, description="longest staging wait of a timed step")
    """A step that waited longer for save staging is not a sample of the prefill rate."""
    save_queue_steps_max: int = Field(64, gt=0, description="steps whose saves may wait for the storage at once")
    """Past it a step's saves are dropped (future misses, counted in ``save_dropped``), never the step."""
    saves_land_before_answer: bool = True
    """The step that gives a request its answer's last token by its length limit
    (``max_tokens``) returns only once that request's chunks are in shared memory and
    marked complete, so a request that was answered was saved, even if the engine is
    killed right after (vLLM's default shutdown): it waits for the copy out of staging and
    for the storage write under way then (not for those of the saves queued before it: its
    own land ahead of them), at most ``save_wait_ms``. A one-token answer waits in the step
    that ends its prompt; a longer answer's saves land while it decodes, so under load no
    step holds the batch's decoding up for them. An answer that ends at a stop token or
    string is not waited for (a kill within its last save loses that save). A CPU step whose
    saver is idle copies its chunks straight into shared memory within the step in any
    case. False: steps never wait, and a kill within that copy loses the step's chunks."""
    save_wait_ms: int = Field(1000, ge=0, description="longest wait of a step that ends a prompt for its saves to land")
    """Bounds ``saves_land_before_answer``: past it the step returns and its saves land behind
    it (said once; a kill before then loses them). It covers one storage write that keeps
    up with the engine: a RAM tier stores the largest GPU step's saves (2 GiB) in ~0.1 s
    (docs/performance.md: 21.4 GB/s), a file tier 0.5 GB/s; a tier slower than that costs
    a prompt's last step no more than this."""

    @property
    def load_batch_bytes(self) -> int:
        return self.load_batch_mb * MIB

    @property
    def load_layered_bytes(self) -> int:
        return self.load_layered_mb * MIB

    @property
    def load_layered_row_bytes(self) -> int:
        return self.load_layered_row_mb * MIB

    @property
    def save_staging_bytes_max(self) -> int:
        return self.save_staging_mb_max * MIB

    @property
    def chunk_size_set(self) -> bool:
        """``chunk_size`` was given (file, environment or override), not left to its default."""
        return "chunk_size" in self.model_fields_set

    def chunk_size_for(self, block_size: int, window_tokens: int | None = None) -> int:
        """The chunk size of a vLLM engine whose KV blocks hold ``block_size`` tokens:
        ``chunk_size`` where it was set (the connector refuses one that is not whole blocks,
        or larger than a sliding window), else the default rounded up to whole blocks (hybrid
        models run with blocks of 512 tokens or more, which the default 256 would not divide),
        and for a sliding-window model (``window_tokens``: its smallest window) cut to the
        whole blocks within the window, as a chunk must fit it."""
        if self.chunk_size_set:
            return self.chunk_size
        chunk = -(-self.chunk_size // block_size) * block_size
        if window_tokens is not None and window_tokens < chunk:
            chunk = max(block_size, window_tokens // block_size * block_size)
        return chunk


def default_runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/kvharbor, else /tmp/kvharbor-<uid>: a user's own either way, since a
    gateway is owner-only by default (``gateway.access``) and the directory is made 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "kvharbor" if base else Path("/tmp") / f"kvharbor-{os.geteuid()}"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvharbor"


def default_fallback_dir() -> Path:
    """Beside the default cache directory, not in it: a file tier's root holds only its own."""
    return default_cache_dir().with_name("kvharbor-fallback")


FALLBACK_TIER = "fallback"
"""The name of the tier `storage.fallback_path` opens."""


DERIVED = "derived"
"""The default of ``gateway.socket`` and ``gateway.shm_name``: a name of the config's own,
derived from its `ConfigDigest` (see `gateway_address`)."""


def _account_id(name: str | int, kind: Literal["user", "group"]) -> int:
    """A uid or gid, from its name on this host or as given; ValueError names what is unknown."""
    if isinstance(name, int):
        if name < 0:
            raise ValueError(f"{kind} id {name} is negative")
        return name
    try:
        return pwd.getpwnam(name).pw_uid if kind == "user" else grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"no {kind} named {name!r} on this host") from None


class AccessSection(_Section):
    """Who besides the gateway's own user may connect to it (``gateway.access``).

    Owner-only by default. A group (name or gid) and users (names or uids) widen
    it: they are granted the socket, the shared memory and the files beside the
    socket, and the gateway admits their processes (checked with SO_PEERCRED).
    Names must exist on this host when the config is loaded.
    """

    group: str | int | None = None
    """Processes whose primary or supplementary groups include this one may connect."""
    users: list[str | int] = Field(default_factory=list, max_length=32)
    """These users may connect (granted by POSIX ACL entries: the filesystems must support them)."""

    @field_validator("group")
    @classmethod
    def _known_group(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            _account_id(value, "group")
        return value

    @field_validator("users")
    @classmethod
    def _known_users(cls, value: list[str | int]) -> list[str | int]:
        for user in value:
            _account_id(user, "user")
        return value

    @property
    def gid(self) -> int | None:
        return None if self.group is None else _account_id(self.group, "group")

    @property
    def uids(self) -> frozenset[int]:
        return frozenset(_account_id(user, "user") for user in self.users)

    @property
    def widened(self) -> bool:
        return self.group is not None or bool(self.users)


class GatewaySection(_Section):
    mode: Literal["embedded", "service"] = "embedded"
    """embedded: the first client starts the gateway; service: run ``kvharbor gateway``."""
    socket: str = DERIVED
    """Where clients find the gateway. ``derived``: a socket of this config's own in the
    runtime directory, so engines of different storage configs never share a gateway."""
    shm_name: str = Field(DERIVED, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Prefix of the shared-memory segment's name; ``derived``: one of this config's own."""
    shm_dir: str = "/dev/shm"
    """Where the shared-memory segment is created; a tmpfs both sides can see."""
    ring_mb: int = Field(1024, gt=0, description="shared-memory ring size in MiB")
    ring_wait_ms: int = Field(200, ge=0, description="how long a transfer waits for ring space")
    ring_mb_min: int = Field(64, gt=0, description="refuse to start below this ring size")
    in_place_mb_max: int = Field(
        4096, gt=0, description="MiB of values clients may be writing in place in the RAM tier at once"
    )
    """Puts into a shared-memory RAM tier go straight to the value's final place; room
    lent for them comes from evicting stored values, so this bounds what clients that
    prepare and never commit can make the tier evict. Past it values go through the
    ring. It must hold one engine step's saves: a GPU step of 16,384 tokens of an 8B
    model is 2 GiB, and a value of a step that fits neither here nor in the ring is
    skipped (and every later chunk of its prompt is unreachable)."""
    shm_reserve_mb: int = Field(64, ge=0, description="MiB of shm_dir left free for the engine (NCCL uses it)")
    request_timeout_ms: int = Field(5000, gt=0, description="longest silence of the gateway during one request")
    progress_interval_ms: int = Field(1000, gt=0, description="how often a long request reports progress")
    request_max_ms: int = Field(
        120_000, gt=0, description="how long a request in service is reported alive (then it is taken for hung)"
    )
    """While a request is served, its client hears from the gateway every
    ``progress_interval_ms`` even when one write takes seconds; past this, a request
    still in service is no longer reported, and its client gives up
    ``request_timeout_ms`` later. It bounds how long a hung tier holds a client."""
    connect_timeout_ms: int = Field(2000, gt=0)
    embedded_start_timeout_ms: int = Field(120_000, gt=0, description="how long the first client waits for it")
    """A gateway allocates its whole segment before it answers: ~19 s for 29 GiB (a 24 GiB RAM
    tier) on the H200 host, whose memory is backed on first touch."""
    stop_timeout_ms: int = Field(5000, gt=0, description="how long a stopping gateway waits for requests in flight")
    linger_s: float = Field(
        600.0, ge=0, allow_inf_nan=False, description="seconds an embedded gateway outlives its clients"
    )
    """An embedded gateway whose last client detached keeps serving (its RAM tier intact)
    this long, so that an engine restarted within it restores from RAM; then it exits.
    0: it stops with the engine that started it. A service-mode gateway never stops by itself."""
    clients_max: int = Field(64, gt=0)
    checksum_threads: int = Field(8, gt=0, le=64, description="threads that checksum a put batch's values at once")
    """A GPU writes values in place by DMA at tens of GB/s; one thread checksums ~10."""
    message_bytes_max: int = Field(1 * MIB, ge=128 * 1024, description="largest control message in bytes")
    """At least 128 KiB: a full batch (4096 keys with their sizes) must fit in one message."""
    cpus: list[Annotated[int, Field(ge=0, lt=CPUS_MAX)]] | None = Field(None, min_length=1, max_length=CPUS_MAX)
    """CPUs (numbers as the kernel counts them) the gateway's threads run on; none: every
    CPU its host and cgroup let it use. An embedded gateway is started by an engine's
    worker, which vLLM's CPU backend binds to its own cores (one each, on a small
    machine): keeping that binding would leave the gateway a share of the engine's busy
    core and stall its answers for seconds."""
    access: AccessSection = AccessSection()
    _config_digest: ConfigDigest | None = PrivateAttr(None)

    @field_validator("cpus")
    @classmethod
    def _distinct_cpus(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"names a CPU twice: {value}")
        return value

    @property
    def config_digest(self) -> ConfigDigest:
        """The digest of the config this section belongs to, sent in the HELLO: the gateway
        serves only clients whose storage and card sections are its own. Set when the
        whole `Config` is validated; a section built alone has an empty one (refused)."""
        return self._config_digest or ConfigDigest(())


class TierSection(_Section):
    """Fields every tier has; each tier type adds its own (see `TIER_TYPES`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")
    type: str
    capacity_gb: float = Field(gt=0)
    codec: Literal["none", "lz4", "zstd"] = "none"
    async_writes: bool = True
    """Writes to this tier go through its queue (``storage.async_*``), served by worker
    threads, so that a put returns once the tiers above have it. The default is the type's:
    false for RAM (memory is not slower than the queue's own copy) and a card, true for the others.
    The store's first tier (the first configured one that opens) is always written before a
    put returns, whatever it says: the engine's saves land there."""

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GIB)


class RamTierSection(TierSection):
    type: Literal["ram"] = "ram"
    async_writes: bool = False  # Memory is not slower than the queue's own copy of the value.


class FileTierSection(TierSection):
    type: Literal["file"] = "file"
    path: str
    async_writes: bool = True
    """Below another tier (the default RAM tier first), a put returns once the tier above
    has the value, and this one is written from its queue (``storage.async_*``): the
    engine's saves land at memory speed, not the disk's. A value still queued when the
    gateway is killed (SIGKILL, power loss) is lost, never half-written; a gateway that
    stops writes its queue out first (``storage.async_shutdown_deadline_s``). False: a
    value is on the disk before its put returns. As the first tier it is always written
    before the put returns."""
    fsync: bool = True
    """Flush every object to stable storage before it counts as stored."""
    fanout_levels: int = Field(2, ge=0, le=3)
    degraded_below_free_pct: float = Field(5.0, ge=0, lt=100)
    """Below this percentage of its filesystem free (blocks available to kvharbor's user),
    the tier's health says degraded (``kvharbor status``, a WARNING in the gateway's log):
    the tier still serves, but the disk is close to refusing writes. 0 never says so."""
    cold_reads_direct: bool = False
    """Read a value whose file is not in the page cache with O_DIRECT, from the disk straight
    into the reader's memory (where the filesystem takes O_DIRECT; buffered, said once, where
    it refuses it). Off by default: on the VMs measured (bench/store.py) neither was clearly
    the faster; on a local NVMe drive O_DIRECT usually is."""
    direct_writes: bool = False
    """Write each value's payload with O_DIRECT from where it lies in memory (page-aligned, as
    in the gateway's shared segment), skipping the copy into the page cache: faster where
    that copy is slow or the CPUs are busy (bench/store.py), but a value written so is not in
    the page cache for a later read of it. Buffered, said once, where the filesystem refuses
    O_DIRECT."""


class NfsTierSection(FileTierSection):
    """A file tier on an NFS filesystem: ``path`` must be the mount point itself (as
    ``/proc/self/mountinfo`` lists it), so that an export that is not mounted is never
    written on the local disk under its empty mount point. Files as the file tier keeps them."""

    type: Literal["nfs"] = "nfs"  # type: ignore[assignment]
    async_writes: bool = True  # A filer: written from the queue, as the slow tiers are.


class OntapTierSection(FileTierSection):
    """A file tier on an ONTAP export: ``mount`` is the NFS mount point, ``path`` the
    directory on it the tier keeps its files in (the mount itself when left out).

    ``protocol: pnfs_rdma`` asks for NFSv4.1+ with a pNFS layout over RDMA; a mount that is
    not so is said once and served with plain NFS file I/O, unless ``strict_protocol``,
    which makes the tier unavailable instead."""

    type: Literal["ontap"] = "ontap"  # type: ignore[assignment]
    async_writes: bool = True  # A filer, as an nfs tier.
    mount: str = Field(min_length=1)
    protocol: Literal["nfs", "pnfs_rdma"] = "nfs"
    strict_protocol: bool = False

    @model_validator(mode="before")
    @classmethod
    def _path_defaults_to_the_mount(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "path" not in data and isinstance(data.get("mount"), str):
            return {**data, "path": data["mount"]}
        return data

    @model_validator(mode="after")
    def _path_on_the_mount(self) -> OntapTierSection:
        mount = os.path.normpath(os.path.expanduser(self.mount))
        path = os.path.normpath(os.path.expanduser(self.path))
        if not os.path.isabs(mount):
            raise ValueError(f"mount: {self.mount!r} is not an absolute path")
        if not os.path.isabs(path) or os.path.commonpath([mount, path]) != mount:
            raise ValueError(f"path: {self.path!r} is not a directory on mount {self.mount!r}")
        return self


class IncompleteTierSection(TierSection):
    """A tier whose section lacks required keys (and has nothing else wrong): the config
    loads and the tier is skipped when the store opens, saying what is missing
    (``tier <name> unavailable: ...``), so the rest of the cache keeps working."""

    type: Literal["incomplete"] = "incomplete"
    declared_type: str
    """The ``type:`` the section was written with."""
    missing: tuple[str, ...] = Field(min_length=1)
    capacity_gb: float | None = Field(None, gt=0)  # type: ignore[assignment]

    @property
    def reason(self) -> str:
        keys = " and ".join(repr(key) for key in self.missing)
        return f"tier '{self.name}' (type {self.declared_type}) requires {keys}"

    @property
    def capacity_bytes(self) -> int:
        raise ValueError(self.reason)  # Never opened: nothing may size anything by it.


CARD_DEVICE_FORMS = "sim, sim:PARAMS.yaml, file:PATH or a device path (/dev/ngXnY, /dev/nvmeXnY)"


class NvmeTierSection(TierSection):
    """A card: simulated (``sim``, ``sim:PARAMS.yaml``), block mode on a file
    (``file:PATH``) or an NVMe device path; the `card` section holds its settings."""

    type: Literal["nvme"] = "nvme"
    async_writes: bool = False
    """Written before a put returns, below RAM too: a card answers each write itself (full
    with key eviction off: event 3002; its target down: the breaker opens), and those
    answers are what its status and the breaker follow per write. True queues it like a
    file tier below the first."""
    device: str = Field(min_length=1)
    capacity_gb: float | None = Field(None, gt=0)  # type: ignore[assignment]
    """Optional: the device's capacity by default; a larger value is refused when the tier opens."""

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        if value == "sim" or value.startswith(("sim:", "file:", "/dev/")):
            return value
        raise ValueError(f"expected {CARD_DEVICE_FORMS}")

    @property
    def capacity_bytes(self) -> int:
        if self.capacity_gb is None:
            raise ValueError(f"tier '{self.name}': capacity_gb is not set; the device's capacity applies")
        return int(self.capacity_gb * GIB)


S3_BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
"""S3's rule for bucket names: 3-63 lowercase letters, digits, dots and hyphens."""


class S3TierSection(TierSection):
    """An S3-compatible object store (`kvharbor.hal.s3`), which several hosts may share.

    Credentials come from the usual AWS chain (environment, shared credentials file,
    instance or container role); the config names at most a ``profile`` of it, never keys.
    ``capacity_gb`` is the budget of the bucket prefix as a whole, over every host that
    shares it (`kvharbor.cache.shared`)."""

    type: Literal["s3"] = "s3"
    bucket: str = Field(pattern=S3_BUCKET_PATTERN)
    prefix: str = Field("kvharbor/", max_length=512, pattern=r"^[^\x00-\x1f]*$")
    """Every object of the tier is named ``<prefix><32 hex digits>``; its shared records
    (the evictor's lease, the usage record) ``<prefix>_kvharbor/...``."""
    endpoint_url: str | None = Field(None, pattern=r"^https?://[^\s/]+")
    """An S3-compatible server (MinIO, Ceph, a test server); None: AWS for ``region``."""
    region: str | None = Field(None, pattern=r"^[a-z0-9-]{1,32}$")
    profile: str | None = Field(None, min_length=1)
    """A profile of the shared AWS config and credentials files; None: the default chain."""
    multipart_threshold_mb: int = Field(64, ge=5, le=4096, description="MiB above which a value is uploaded in parts")
    """A single PUT is atomic; a multipart upload becomes visible only when it is completed,
    so a writer that dies midway leaves nothing a reader sees (S3 needs parts of >= 5 MiB)."""
    multipart_part_mb: int = Field(16, ge=5, le=4096, description="MiB per uploaded part")
    pool_connections: int = Field(32, gt=0, le=1024, description="HTTP connections kept open to the server")
    connect_timeout_ms: int = Field(2000, gt=0, description="longest wait for a connection to the server")
    read_timeout_ms: int = Field(10_000, gt=0, description="longest silence of the server during one request")
    retries_max: int = Field(2, ge=0, le=20, description="retries of a failed request (botocore's standard mode)")
    sse: Literal["none", "AES256", "aws:kms"] = "none"
    """Server-side encryption of every object written (``ServerSideEncryption``)."""
    sse_kms_key_id: str | None = Field(None, min_length=1)
    """The KMS key of ``sse: aws:kms`` (``SSEKMSKeyId``); None: the bucket's default key."""
    miss_ttl_ms: int = Field(1000, ge=0, description="how long a key found absent is not asked again")
    """A lookup of a key no host holds asks the server once per this interval (the engine
    asks again each step for a waiting request); a value another host stores meanwhile is
    found this much later at most. 0: ask every time."""
    budget_interval_s: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="seconds between two sweeps of the shared budget"
    )
    """The host holding the evictor's lease lists the prefix this often and deletes the
    oldest values above ``capacity_gb``; the shared tier can exceed its budget by what all
    hosts write in one interval. A sweep lists every object (one LIST request per 1000):
    a minute keeps that small for a prefix of millions."""
    lease_s: float = Field(180.0, gt=0, allow_inf_nan=False, description="seconds the evictor's lease lasts unrenewed")
    abandoned_upload_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="age after which an unfinished multipart upload is aborted"
    )
    """Parts of an upload whose writer died are invisible to readers but stored (and billed);
    the evictor aborts uploads older than this."""

    @model_validator(mode="after")
    def _consistent(self) -> S3TierSection:
        if self.sse_kms_key_id is not None and self.sse != "aws:kms":
            raise ValueError(f"sse_kms_key_id needs sse: aws:kms (sse is {self.sse!r})")
        if self.multipart_part_mb > self.multipart_threshold_mb:
            raise ValueError(
                f"multipart_part_mb ({self.multipart_part_mb}) must not exceed "
                f"multipart_threshold_mb ({self.multipart_threshold_mb})"
            )
        if self.lease_s <= self.budget_interval_s:
            # The holder renews its lease once per sweep: a shorter lease would lapse between them.
            raise ValueError(f"lease_s ({self.lease_s:g}) must exceed budget_interval_s ({self.budget_interval_s:g})")
        return self


TIER_TYPES: dict[str, type[TierSection]] = {
    "ram": RamTierSection,
    "file": FileTierSection,
    "nvme": NvmeTierSection,
    "s3": S3TierSection,
    "nfs": NfsTierSection,
    "ontap": OntapTierSection,
}
"""Tier type name -> its config model. Drivers register here with the HAL registry."""


class CircuitBreakerSection(_Section):
    failure_ratio: float = Field(0.2, gt=0, le=1)
    window: int = Field(50, gt=0, description="operations per judgement")
    cooldown_s: float = Field(30.0, gt=0, description="how long an open breaker skips its tier before a trial")
    probe_backoff_factor: float = Field(2.0, ge=1, description="each failed trial multiplies the wait by this")
    probe_interval_max_s: float = Field(300.0, gt=0, description="the longest wait between trials")
    background_probe_interval_s: float = Field(
        1.0, gt=0, description="how often the gateway looks for a tier due a trial"
    )
    """The first trial comes ``cooldown_s`` after the breaker opens; each failed one waits
    ``probe_backoff_factor`` times longer, up to ``probe_interval_max_s``; success closes
    the breaker and resets the wait to ``cooldown_s``. A card whose target stops
    answering opens its breaker at once (no window to fill).

    A trial is a request that reaches the tier, or, in the gateway, a background probe
    (`kvharbor.gateway.prober`): every ``background_probe_interval_s`` it gives each tier
    whose breaker is due a trial one question, so that a target that comes back is found
    with no traffic. The breaker's waits decide *when* a tier is due; the interval only
    bounds how late after that the probe comes (a trial at most ``cooldown_s`` +
    ``background_probe_interval_s`` after the breaker opened, and so on with the backoff)."""


class BackpressureSection(_Section):
    circuit_breaker: CircuitBreakerSection = CircuitBreakerSection()


def _default_tiers() -> list[TierSection]:
    return [
        RamTierSection(name="ram", capacity_gb=1),
        FileTierSection(name="local", path=str(default_cache_dir()), capacity_gb=20),
    ]


class StorageSection(_Section):
    # At most 16: a tool's LOCATE answer names the tiers of a key in one 64-bit mask.
    tiers: list[TierSection] = Field(default_factory=_default_tiers, min_length=1, max_length=16)
    write_policy: Literal["write_through", "write_back"] = "write_through"
    """write_through: a put writes every tier; write_back: lower tiers are written when an
    object is evicted from the one above. Either way a tier with ``async_writes`` is written
    from its queue, after the put returns (see ``async_queue_depth``)."""
    async_queue_depth: int = Field(256, gt=0, description="writes one async tier's queue holds at most")
    """Per tier with ``async_writes``. A write that finds its tier's queue full (this many
    values, or ``async_queue_mb``) is dropped and counted: the engine never waits for a slow
    tier. A key queued and not yet written is served from the queue's copy meanwhile. Under
    ``write_back`` a dropped write is a demotion: the value leaves the cache (a future miss)."""
    async_queue_mb: int = Field(1024, gt=0, description="MiB of values one async tier's queue holds at most")
    """The queue holds a copy of each value it has not written yet: the tier above may evict
    the value (or its client reuse its shared memory) before the slow tier has it."""
    async_workers: int = Field(2, gt=0, le=64, description="threads writing each async tier")
    async_shutdown_deadline_s: float = Field(
        30.0, ge=0, allow_inf_nan=False, description="seconds a stopping gateway writes its queues out"
    )
    """A gateway that stops (a signal, the end of an embedded gateway's linger) writes what
    its queues hold for at most this long; what is left is counted and said once, and lost."""
    value_mb_max: int = Field(1024, gt=0, lt=4096, description="largest value (one chunk's KV) in MiB")
    """Below 4 GiB: stored lengths are 32 bits (a chunk of 256 tokens of a 70B model is ~80 MiB)."""
    probe: bool = True
    """Write, read back and delete a test object in every tier at start; skip failing tiers."""
    refill_ram: bool = True
    """At gateway start the RAM tier is empty (no segment survives a gateway): copy the file
    tiers' objects into it in the background, most recently used first, until it is full.
    On by default: an engine restarted after a reboot (or a gateway restart) restores from
    RAM, not from a disk that may be slower than prefill (~1.5 GB/s on the H200 host, where
    reading 4 GiB takes longer than recomputing 32k tokens and the planner recomputes)."""
    refill_ram_mb_per_s: int = Field(256, gt=0, description="MiB per second the RAM refill copies at most")
    """Paces the refill so the disk and the CPU (each object is verified) stay free for the
    engines' own requests, which never wait for it on a lock. 256: on a shared, noisy 2-core
    machine a refill at 64-256 MiB/s left the p99 of a foreground 1 MiB put+get at 1.0-2.7x
    its quiet value, at 512 and above at 9-11x (``bench/refill.py``: the refill competes for
    the gateway's interpreter lock and its cores); 24 GiB then refill in ~100 s."""
    backpressure: BackpressureSection = BackpressureSection()
    fallback_path: str | None = Field(default_factory=lambda: str(default_fallback_dir()), min_length=1)
    """Where writes go when no persistent tier opened (every configured one was skipped, or
    none is configured): a file tier named ``fallback`` below the others, said in the log
    and shown in status. Default ``$XDG_CACHE_HOME/kvharbor-fallback`` (~/.cache/...).
    null: no fallback (a cache in RAM only, on purpose)."""
    fallback_capacity_gb: float = Field(10.0, gt=0, allow_inf_nan=False, description="the fallback tier's GiB")

    @model_validator(mode="after")
    def _fallback_name_free(self) -> StorageSection:
        if self.fallback_path is not None and FALLBACK_TIER in {tier.name for tier in self.tiers}:
            raise ValueError(
                f"tier name {FALLBACK_TIER!r} is the fallback tier's (storage.fallback_path); "
                "rename the tier or set storage.fallback_path: null"
            )
        return self

    @field_validator("tiers", mode="before")
    @classmethod
    def _typed_tiers(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        typed: list[Any] = []
        for index, tier in enumerate(value):
            if isinstance(tier, TierSection):
                typed.append(tier)
                continue
            if not isinstance(tier, Mapping):
                raise ValueError(f"tiers[{index}] must be a mapping with name and type")
            kind = tier.get("type")
            model = TIER_TYPES.get(str(kind))
            if model is None:
                known = ", ".join(sorted(TIER_TYPES))
                raise ValueError(f"tiers[{index}]: unknown tier type {kind!r}; known: {known}")
            try:
                typed.append(model.model_validate(tier))
            except ValidationError as err:
                incomplete = _incomplete(tier, err)
                if incomplete is None:
                    raise ValueError(f"tiers[{index}] ({tier.get('name', '?')}): {_brief(err)}") from None
                typed.append(incomplete)
        names = [t.name for t in typed]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tier names must be unique; repeated: {', '.join(duplicates)}")
        cards = [t.name for t in typed if isinstance(t, NvmeTierSection)]
        if len(cards) > 1:
            # One `card` section configures the card; several cards would need per-tier settings.
            raise ValueError(f"at most one nvme (card) tier; found {len(cards)}: {', '.join(cards)}")
        return typed


def _incomplete(tier: Mapping[str, Any], err: ValidationError) -> IncompleteTierSection | None:
    """The stand-in of a tier section whose only problems are missing keys other than its
    name (a nameless tier cannot be reported, so it is refused); None otherwise."""
    problems = err.errors()
    if not all(problem["type"] == "missing" and len(problem["loc"]) == 1 for problem in problems):
        return None
    missing = tuple(str(problem["loc"][0]) for problem in problems)
    if "name" in missing:
        return None
    try:
        return IncompleteTierSection(
            name=tier["name"], declared_type=str(tier["type"]), missing=missing, capacity_gb=tier.get("capacity_gb")
        )
    except ValidationError:
        return None  # A bad name or capacity besides: refused with the original problems.


CARD_REGION_SLACK_BYTES = 16 * 1024
"""What a block-mode region needs beside one fragment: the stored object's header
(`kvharbor.cache.format.HEADER_BYTES`, 4 KiB: not imported, the config sits below the cache;
`tests/unit/test_card_wiring.py` holds them together), the region header, the store's object
header and the padding of both to whole 4 KiB blocks."""


class CardSection(_Section):
    """Settings of the nvme (card) tier; applied to its device when the tier opens.

    Key eviction by device kind:

    - the simulated card and block mode (``file:PATH``, ``/dev/nvmeXnY``) evict on their
      own: on, the oldest keys (block mode: the oldest region) make room; off, a full
      card refuses the write as card full (event 3002);
    - an NVMe KV namespace (``/dev/ngXnY``) has no eviction of its own (the KV command set
      defines none): on, the tier evicts instead (least recently used, within the tier's
      capacity budget), said once when the tier opens; off, the namespace refuses a store
      it has no room for (status 81h, counted as card full).
    """

    key_eviction: bool = True
    """The card evicts its oldest keys to make room; off: a full card refuses writes (event 3002)."""
    fragment_bytes: int = Field(2 * MIB, ge=4096, description="largest value the card stores")
    """Values above it are stored in fragments; it enters the layout of what the card tier stores."""
    region_mb: int = Field(256, gt=0, description="block mode: the size of one log region")
    """Block mode only (``file:PATH``, ``/dev/nvmeXnY``), used when the store is formatted; a
    store keeps the geometry it was formatted with. Large against a fragment so that padding
    costs little, small against the device so that evicting one region drops a small share."""
    health_interval_s: float = Field(10.0, gt=0, description="how long an NVMe device's health is reused")
    """An NVMe device's health comes from nvme-cli (one subprocess per log); a status asked
    more often than this is answered from the last reading. The gateway also reads every
    tier's health this often, to say a change of it in its log."""

    @model_validator(mode="after")
    def _region_holds_a_fragment(self) -> CardSection:
        needed = self.fragment_bytes + CARD_REGION_SLACK_BYTES
        if self.region_mb * MIB < needed:
            raise ValueError(
                f"card.region_mb {self.region_mb} cannot hold one fragment of card.fragment_bytes "
                f"{self.fragment_bytes} with its headers (at least {-(-needed // MIB)} MiB)"
            )
        return self

    @property
    def region_bytes(self) -> int:
        return self.region_mb * MIB


class DashboardSection(_Section):
    """The gateway's web page and HTTP endpoints (`kvharbor.dashboard`), served by the
    gateway process on ``host:port``; a port already taken is said once and the gateway
    serves on without it."""

    enabled: bool = True
    host: str = Field("127.0.0.1", min_length=1)
    """A host other than a loopback address needs ``auth_token``: without one the
    dashboard does not start (said in the gateway's log), the gateway serves on."""
    port: int = Field(9400, ge=0, le=65535)
    """0: a free port the system picks, logged and shown in the gateway's status."""
    auth_token: str | None = Field(None, min_length=1)
    """Every request but ``/healthz`` and ``/readyz`` then needs ``Authorization: Bearer
    <token>`` or ``?token=<token>`` (``/metrics`` too: a scraper sends it as a bearer token)."""
    allowed_hosts: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1"], min_length=1)
    """Host header names (without the port) the dashboard answers; ``*`` allows any.
    A DNS-rebinding page reaches the dashboard under a name of its own: refused."""
    allow_config_edit: bool = False
    """POST /api/config may change the config (validated as a whole, written back to the file)."""
    refresh_interval_ms: int = Field(2000, ge=200, description="how often the page fetches new figures")
    history_interval_s: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="seconds between two samples of the charts' history"
    )
    history_samples_max: int = Field(720, gt=1, le=100_000, description="samples the history keeps (a ring)")
    """720 samples every 5 s: the last hour."""
    log_lines_max: int = Field(200, gt=0, le=100_000, description="recent kvharbor log lines the page shows")
    request_body_bytes_max: int = Field(1 * MIB, ge=1024, description="largest request body (a posted config)")
    request_header_bytes_max: int = Field(16 * 1024, ge=1024, description="largest request line and headers")


class PrometheusSection(_Section):
    port: int = Field(9402, ge=0, le=65535)
    """A listener with only ``/metrics`` (same host, token and Host check as the dashboard);
    taken: said once, ``/metrics`` stays on the dashboard port. 0: a port the system picks."""


class TelemetrySection(_Section):
    prometheus: PrometheusSection = PrometheusSection()
    hit_rate_window_s: int = Field(
        300, gt=0, le=86_400, description="the recent window of the hit rate that status and the dashboard show"
    )


class SglangSection(_Section):
    """kvharbor as SGLang's HiCache storage backend (`kvharbor.connector.sglang`)."""

    shutdown_flush_ms: int = Field(
        10_000, ge=0, description="how long SGLang's shutdown waits for queued page writes to be stored"
    )
    """SGLang stops its storage threads at shutdown without writing the pages still queued
    for storage: a restart right after a long prompt would then miss them. kvharbor writes
    them first, for at most this long; what is left after it is said once and not stored.
    0: write nothing more at shutdown."""
    copy_threads: int = Field(
        2,
        gt=0,
        le=64,
        description="threads that copy one batch_set_v1's or batch_get_v1's pages to or from shared memory at once",
    )
    """A page's copy and checksum let go of the GIL, and one thread's copy does not fill
    the memory bus: with two threads, 128 pages of 2 MiB were stored in 28-32 ms, with one
    in 38-41 ms, on a 2-vCPU VM. 1: each batch's pages are copied in turn, in SGLang's
    storage thread."""


SHARED_SECTIONS = ("storage", "card")
"""The sections every engine of one gateway must have in common: what the gateway stores
and where. Not ``engine``: its layout, namespace and chunk size are in every key, so
engines that differ there share a gateway safely. Not ``gateway``: it says how to reach
the gateway and how a client waits (timeouts), and the gateway's own tuning (ring size,
threads, access) changes no stored byte; a service gateway's file and its engines' files
commonly differ there."""


@dataclass(frozen=True, slots=True)
class ConfigDigest:
    """A digest per shared section (`SHARED_SECTIONS`) of one config: what an engine and
    the gateway it attaches to must agree on."""

    sections: tuple[tuple[str, str], ...]
    """(section name, SHA-256 of its canonical JSON, hex), in `SHARED_SECTIONS` order."""

    def differing(self, other: ConfigDigest) -> list[str]:
        """The names of the sections whose digests differ (a section one side lacks differs)."""
        mine, theirs = dict(self.sections), dict(other.sections)
        return [name for name in sorted(mine.keys() | theirs.keys()) if mine.get(name) != theirs.get(name)]

    @property
    def short(self) -> str:
        """12 hex digits of all sections together: the derived names' suffix."""
        whole = hashlib.sha256(";".join(f"{name}={digest}" for name, digest in self.sections).encode())
        return whole.hexdigest()[:12]


def config_digest(config: Config) -> ConfigDigest:
    """The `ConfigDigest` of ``config``: defaults count as written, so a section spelt out
    with its default values digests as the same section omitted."""
    sections = []
    for name in SHARED_SECTIONS:
        # serialize_as_any: a tier is dumped with its own type's fields (a file tier's path).
        document = getattr(config, name).model_dump(mode="json", serialize_as_any=True)
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
        sections.append((name, hashlib.sha256(canonical.encode()).hexdigest()))
    return ConfigDigest(tuple(sections))


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    socket: Path
    shm_name: str
    config_digest: ConfigDigest


def gateway_address(config: Config) -> GatewayAddress:
    """Where the gateway of ``config`` is: its socket and shared-memory name, and the
    digest it must serve. Engines, ``kvharbor gateway`` and ``kvharbor status --config``
    all find a config's gateway through this. A ``derived`` socket is
    ``<runtime dir>/gateway-<digest>.sock`` ($XDG_RUNTIME_DIR/kvharbor, else
    /tmp/kvharbor-<uid>) and a derived shm_name ``kvharbor-<digest>``, so each storage config
    has a gateway of its own; an explicit one is used as written."""
    gateway = config.gateway
    return GatewayAddress(Path(gateway.socket), gateway.shm_name, gateway.config_digest)


def _derive_gateway(section: GatewaySection, digest: ConfigDigest) -> GatewaySection:
    resolved = {}
    if section.socket == DERIVED:
        resolved["socket"] = str(default_runtime_dir() / f"gateway-{digest.short}.sock")
    if section.shm_name == DERIVED:
        resolved["shm_name"] = f"kvharbor-{digest.short}"
    derived = section.model_copy(update=resolved)
    derived._config_digest = digest
    return derived


class Config(_Section):
    """The whole config. Validation resolves ``derived`` gateway names (`gateway_address`):
    build configs with `validate_config`/`load_config`, not ``model_copy(update=...)``,
    which would keep the old names and digest."""

    engine: EngineSection = EngineSection()
    gateway: GatewaySection = GatewaySection()
    storage: StorageSection = StorageSection()
    card: CardSection = CardSection()
    dashboard: DashboardSection = DashboardSection()
    telemetry: TelemetrySection = TelemetrySection()
    sglang: SglangSection = SglangSection()

    @model_validator(mode="after")
    def _resolve_gateway(self) -> Config:
        # A frozen model: the validated section is replaced once, before anyone sees it.
        object.__setattr__(self, "gateway", _derive_gateway(self.gateway, config_digest(self)))
        return self


def _brief(err: ValidationError) -> str:
    """One line per problem: ``dotted.key: what is wrong (got value)``; a problem of a whole
    section (a model validator's) names its keys in its own message."""
    lines = []
    for problem in err.errors():
        where = ".".join(str(p) for p in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        got = problem.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"{where}: {message}{shown}" if where else f"{message}{shown}")
    return "; ".join(lines)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: cannot override inside a non-mapping value")
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVHARBOR__A__B=v`` variables as a nested mapping ``{"a": {"b": v}}``."""
    tree: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_OVERRIDE_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_OVERRIDE_PREFIX) :].split("__") if p]
        if not path:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_path(tree, path, value)
    return tree


def merge_documents(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``top`` laid over it, mappings merged key by key (a list is replaced whole)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge_documents(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist") from None
    except OSError as err:
        raise ConfigError(f"config file {file} cannot be read: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {file} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file} must hold a mapping at the top level")
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults <- YAML file <- environment <- ``overrides``; raises `ConfigError`."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(ENV_CONFIG) or None
    data: dict[str, Any] = read_yaml(path) if path else {}
    data = merge_documents(data, env_overrides(environ))
    if overrides:
        data = merge_documents(data, overrides)
    return validate_config(data, source=str(path) if path else "defaults and environment")


def validate_config(data: Mapping[str, Any], source: str = "config") -> Config:
    try:
        config = Config.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(f"invalid kvharbor config ({source}): {_brief(err)}") from None
    if config.gateway.ring_wait_ms >= config.gateway.request_timeout_ms:
        # A request waiting for ring space must answer before its client gives up on it.
        raise ConfigError(
            f"invalid kvharbor config ({source}): gateway.ring_wait_ms ({config.gateway.ring_wait_ms} ms) "
            f"must be below gateway.request_timeout_ms ({config.gateway.request_timeout_ms} ms)"
        )
    if config.gateway.progress_interval_ms >= config.gateway.request_timeout_ms:
        # A long request must say it is alive before its client gives up on it.
        raise ConfigError(
            f"invalid kvharbor config ({source}): gateway.progress_interval_ms "
            f"({config.gateway.progress_interval_ms} ms) must be below gateway.request_timeout_ms "
            f"({config.gateway.request_timeout_ms} ms)"
        )
    if config.engine.load_resample_max_s < config.engine.load_resample_s:
        raise ConfigError(
            f"invalid kvharbor config ({source}): engine.load_resample_max_s ({config.engine.load_resample_max_s} s) "
            f"must be at least engine.load_resample_s ({config.engine.load_resample_s} s)"
        )
    if config.gateway.request_max_ms <= config.gateway.progress_interval_ms:
        raise ConfigError(
            f"invalid kvharbor config ({source}): gateway.request_max_ms ({config.gateway.request_max_ms} ms) "
            f"must be above gateway.progress_interval_ms ({config.gateway.progress_interval_ms} ms)"
        )
    if len(config.gateway.socket.encode()) > UNIX_SOCKET_PATH_BYTES_MAX:
        raise ConfigError(
            f"invalid kvharbor config ({source}): gateway.socket: {config.gateway.socket!r} is "
            f"{len(config.gateway.socket.encode())} bytes; a Unix socket path holds at most "
            f"{UNIX_SOCKET_PATH_BYTES_MAX}: choose a shorter path"
        )
    if config.gateway.ring_mb < config.gateway.ring_mb_min:
        raise ConfigError(
            f"invalid kvharbor config ({source}): gateway.ring_mb: {config.gateway.ring_mb} MiB "
            f"is below gateway.ring_mb_min ({config.gateway.ring_mb_min} MiB)"
        )
    return config
