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

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_CONFIG = "KVHARBOR_CONFIG"
ENV_OVERRIDE_PREFIX = "KVHARBOR__"
GIB = 1 << 30
MIB = 1 << 20
UNIX_SOCKET_PATH_BYTES_MAX = 107
"""sizeof(sockaddr_un.sun_path) - 1 on Linux: a longer socket path cannot be bound."""


class ConfigError(ValueError):
    """A configuration the user must fix; the message is meant for them."""


class _Section(BaseModel):
    # Unknown keys are refused: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSection(_Section):
    chunk_size: int = Field(256, gt=0, description="tokens per stored chunk")
    key_namespace: str = Field("default", min_length=1, max_length=128)
    require_cache_salt: bool = False
    verify_wait_ms: int = Field(
        2000, ge=0, description="how long a request waits for its stored chunks to be read back"
    )
    """Stored chunks outside a shared-memory RAM tier (on files) are read back in full before
    the engine is told it has them; a request waits at most this long (other requests are
    scheduled meanwhile). Past it, the chunks not read back by then are recomputed, not
    promised. 0: only chunks in RAM are promised."""


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / "kvharbor"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvharbor"


class GatewaySection(_Section):
    mode: Literal["embedded", "service"] = "embedded"
    """embedded: the first client starts the gateway; service: run ``kvharbor gateway``."""
    socket: str = Field(default_factory=lambda: str(default_runtime_dir() / "gateway.sock"))
    shm_name: str = Field("kvharbor", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    shm_dir: str = "/dev/shm"
    """Where the shared-memory segment is created; a tmpfs both sides can see."""
    ring_mb: int = Field(1024, gt=0, description="shared-memory ring size in MiB")
    ring_wait_ms: int = Field(200, ge=0, description="how long a transfer waits for ring space")
    ring_mb_min: int = Field(64, gt=0, description="refuse to start below this ring size")
    shm_reserve_mb: int = Field(64, ge=0, description="MiB of shm_dir left free for the engine (NCCL uses it)")
    request_timeout_ms: int = Field(5000, gt=0, description="longest silence of the gateway during one request")
    progress_interval_ms: int = Field(1000, gt=0, description="how often a long request reports progress")
    connect_timeout_ms: int = Field(2000, gt=0)
    embedded_start_timeout_ms: int = Field(120_000, gt=0, description="how long the first client waits for it")
    """A gateway allocates its whole segment before it answers: ~19 s for 29 GiB (a 24 GiB RAM
    tier) on the H200 host, whose memory is backed on first touch."""
    stop_timeout_ms: int = Field(5000, gt=0, description="how long a stopping gateway waits for requests in flight")
    clients_max: int = Field(64, gt=0)
    checksum_threads: int = Field(8, gt=0, le=64, description="threads that checksum a put batch's values at once")
    """A GPU writes values in place by DMA at tens of GB/s; one thread checksums ~10."""
    message_bytes_max: int = Field(1 * MIB, ge=128 * 1024, description="largest control message in bytes")
    """At least 128 KiB: a full batch (4096 keys with their sizes) must fit in one message."""


class TierSection(_Section):
    """Fields every tier has; each tier type adds its own (see `TIER_TYPES`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")
    type: str
    capacity_gb: float = Field(gt=0)
    codec: Literal["none", "lz4", "zstd"] = "none"

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GIB)


class RamTierSection(TierSection):
    type: Literal["ram"] = "ram"


class FileTierSection(TierSection):
    type: Literal["file"] = "file"
    path: str
    fsync: bool = True
    """Flush every object to stable storage before it counts as stored."""
    fanout_levels: int = Field(2, ge=0, le=3)


TIER_TYPES: dict[str, type[TierSection]] = {
    "ram": RamTierSection,
    "file": FileTierSection,
}
"""Tier type name -> its config model. Drivers register here with the HAL registry."""


class CircuitBreakerSection(_Section):
    failure_ratio: float = Field(0.2, gt=0, le=1)
    window: int = Field(50, gt=0, description="operations per judgement")
    cooldown_s: float = Field(30.0, gt=0)


class BackpressureSection(_Section):
    circuit_breaker: CircuitBreakerSection = CircuitBreakerSection()


def _default_tiers() -> list[TierSection]:
    return [
        RamTierSection(name="ram", capacity_gb=1),
        FileTierSection(name="local", path=str(default_cache_dir()), capacity_gb=20),
    ]


class StorageSection(_Section):
    tiers: list[TierSection] = Field(default_factory=_default_tiers, min_length=1)
    write_policy: Literal["write_through", "write_back"] = "write_through"
    """write_through: a put reaches every tier before it returns; write_back: lower
    tiers are written when an object is evicted from the one above."""
    value_mb_max: int = Field(1024, gt=0, lt=4096, description="largest value (one chunk's KV) in MiB")
    """Below 4 GiB: stored lengths are 32 bits (a chunk of 256 tokens of a 70B model is ~80 MiB)."""
    probe: bool = True
    """Write, read back and delete a test object in every tier at start; skip failing tiers."""
    backpressure: BackpressureSection = BackpressureSection()

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
                raise ValueError(f"tiers[{index}] ({tier.get('name', '?')}): {_brief(err)}") from None
        names = [t.name for t in typed]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tier names must be unique; repeated: {', '.join(duplicates)}")
        return typed


class CardSection(_Section):
    key_eviction: bool = True
    fragment_bytes: int = Field(2 * MIB, ge=4096, description="largest value the card stores")


class DashboardSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(9400, ge=0, le=65535)
    auth_token: str | None = None
    allowed_hosts: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1"])
    allow_config_edit: bool = False


class PrometheusSection(_Section):
    port: int = Field(9402, ge=0, le=65535)


class TelemetrySection(_Section):
    prometheus: PrometheusSection = PrometheusSection()


class Config(_Section):
    engine: EngineSection = EngineSection()
    gateway: GatewaySection = GatewaySection()
    storage: StorageSection = StorageSection()
    card: CardSection = CardSection()
    dashboard: DashboardSection = DashboardSection()
    telemetry: TelemetrySection = TelemetrySection()


def _brief(err: ValidationError) -> str:
    """One line per problem: ``dotted.key: what is wrong (got value)``."""
    lines = []
    for problem in err.errors():
        where = ".".join(str(p) for p in problem["loc"]) or "(top level)"
        message = problem["msg"].removeprefix("Value error, ")
        got = problem.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"{where}: {message}{shown}")
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


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
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
    data = _merge(data, env_overrides(environ))
    if overrides:
        data = _merge(data, overrides)
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
