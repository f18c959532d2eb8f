"""The gateway's metrics on prometheus-client: one registry per process, one source of numbers.

`GatewayMetrics` owns the gateway process's `CollectorRegistry` (what ``/metrics``
serves: ``generate_latest(gateway.metrics.registry)``) and every metric family in it.
Counters are counted where things happen, through children bound once per label
set when their owner is built (`TierMetrics` per tier, `RequestMetrics` per message
type): a hot path pays one ``inc()``, never a label lookup. Gauges that mirror
state (a tier's usage, its breaker, a card's sensors) are read from the live
objects at scrape time by `kvharbor.gateway.collectors`, so none can go stale.

The status a user reads (``kvharbor status``) is read from the same metric objects
through the typed snapshots here (`TierCounts`, `HitCounts`, `GatewayCounts`):
there is one set of numbers, not two.

Names follow Prometheus: units in names, ``_total`` for counters (prometheus-client
adds the suffix to a counter's name). Every name is listed in ``docs/metrics.md``;
a test keeps the two equal.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from kvharbor import __version__
from kvharbor.telemetry.window import RecentTokens

LATENCY_BUCKETS_S = (
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
"""Histogram buckets in seconds: a RAM-tier LOOKUP answers in tens of microseconds, a large
commit to a slow file or card tier takes seconds."""


class TierOp(enum.StrEnum):
    """What a tier was asked to do (the ``op`` label)."""

    PUT = "put"
    GET = "get"
    DELETE = "delete"
    LOOKUP = "lookup"
    """Asking the device which keys it still holds (a card that evicts on its own)."""
    PROBE = "probe"
    """The background probe of a tier whose breaker is open."""
    INDEX = "index"
    """The tier's index (a manifest on disk) read or written."""


class Outcome(enum.StrEnum):
    """How a tier operation ended (the ``outcome`` label)."""

    OK = "ok"
    MISS = "miss"
    FULL = "full"
    """A put the device refused for want of room."""
    ERROR = "error"
    """A device fault, fed to the breaker."""
    SKIPPED = "skipped"
    """Not attempted: the tier's breaker is open."""
    STALE = "stale"
    """A get of an object stored under other settings of this tier (a card's fragment size): a miss, dropped."""
    CORRUPT = "corrupt"
    """A get of an object that failed verification: a miss, dropped."""


OUTCOMES: Mapping[TierOp, tuple[Outcome, ...]] = {
    TierOp.PUT: (Outcome.OK, Outcome.FULL, Outcome.ERROR, Outcome.SKIPPED),
    TierOp.GET: (Outcome.OK, Outcome.MISS, Outcome.CORRUPT, Outcome.STALE, Outcome.ERROR, Outcome.SKIPPED),
    TierOp.DELETE: (Outcome.OK, Outcome.MISS, Outcome.ERROR),
    TierOp.LOOKUP: (Outcome.OK, Outcome.ERROR, Outcome.SKIPPED),
    TierOp.PROBE: (Outcome.OK, Outcome.ERROR),
    TierOp.INDEX: (Outcome.ERROR,),
}
"""The outcomes each operation can have; each pair is a child bound at the tier's start."""

TIMED_OPS = (TierOp.PUT, TierOp.GET, TierOp.DELETE)
"""Operations whose device time is a histogram (``kvharbor_tier_operation_duration_seconds``)."""

EXTRA_ERROR_KINDS = ("ring_full", "marks_refused", "unmarked_dropped")
"""``kvharbor_errors_total`` kinds beside the `ErrorCode` names: values not moved because the
ring had no room by the deadline; completion marks refused (a place not lent, a checksum
the bytes do not match); values of a vanished client's puts not marked complete (dropped)."""


def _value(metric: MetricWrapperBase) -> float:
    """The current value of one child of a counter or gauge (not of a histogram).

    Read through `collect`, prometheus-client's public reading of a metric: the
    status is read a few times a second at most, never on a request's path.
    """
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") or sample.name == family.name:
                return sample.value
    raise LookupError(f"{metric!r} has no value sample")  # A histogram: a bug in the caller.


# -- snapshots: what the status reads, from the same metric objects -----------------------------


class CodecOp(enum.StrEnum):
    """What a tier's codec did (the ``op`` label of ``kvharbor_tier_codec_*``)."""

    ENCODE = "encode"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class CodecStats:
    """One tier's codec since the gateway started: what it compressed and decompressed, and
    how fast. Only values its codec touched count (a tier of codec none has none)."""

    encoded_values: int = 0
    encode_raw_bytes: int = 0
    encode_stored_bytes: int = 0
    encode_seconds: float = 0.0
    decoded_values: int = 0
    decode_raw_bytes: int = 0
    decode_seconds: float = 0.0
    ratio: float | None = None
    """Raw bytes over stored bytes of every value encoded; None before the first."""
    encode_mb_per_s: float | None = None
    """Raw MiB compressed per second of codec time; None before the first."""
    decode_mb_per_s: float | None = None
    """Raw MiB decompressed per second of codec time; None before the first."""

    @classmethod
    def of(cls, encoded: tuple[int, int, int, float], decoded: tuple[int, int, int, float]) -> CodecStats:
        """From each op's (values, raw bytes, stored bytes, seconds)."""
        return cls(
            encoded_values=encoded[0],
            encode_raw_bytes=encoded[1],
            encode_stored_bytes=encoded[2],
            encode_seconds=encoded[3],
            decoded_values=decoded[0],
            decode_raw_bytes=decoded[1],
            decode_seconds=decoded[3],
            ratio=encoded[1] / encoded[2] if encoded[2] else None,
            encode_mb_per_s=_mib_per_s(encoded[1], encoded[3]),
            decode_mb_per_s=_mib_per_s(decoded[1], decoded[3]),
        )


def _mib_per_s(nbytes: int, seconds: float) -> float | None:
    return nbytes / (1 << 20) / seconds if seconds > 0 else None


@dataclass(frozen=True, slots=True)
class TierCounts:
    """One tier's counts since the gateway started (``kvharbor_tier_*`` series)."""

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    """Gets the device was asked (every get outcome but ``skipped``)."""
    hits: int = 0
    hit_bytes: int = 0
    corrupt: int = 0
    """Objects that failed verification (on a get, after a put, on a refill read): dropped."""
    evictions: int = 0
    evicted_bytes: int = 0
    errors: int = 0
    """Device faults of any operation."""
    full: int = 0
    skipped: int = 0
    """Operations not attempted because the breaker was open."""
    stale: int = 0
    """Objects found written under another layout of this tier (a card's fragment size
    changed): misses, dropped, not corrupt."""
    async_dropped: int = 0
    """Writes refused by this tier's full queue (``storage.async_queue_depth``, ``async_queue_mb``)."""
    async_flushed: int = 0
    """Writes taken off this tier's queue and handed to the tier (its put outcomes say how they went)."""
    async_unflushed: int = 0
    """Writes still queued when the shutdown deadline passed (``storage.async_shutdown_deadline_s``): lost."""
    codec: CodecStats = field(default_factory=CodecStats)


@dataclass(frozen=True, slots=True)
class HitCounts:
    """Lookups in tokens. Queries are counted in full-chunk tokens, the unit of hits: a
    prompt of N tokens can hit at most floor(N / chunk_size) x chunk_size of them."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GatewayCounts:
    """The gateway's own counts since it started."""

    clients_total: int = 0
    """Clients admitted (connections served)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Refused messages by `ErrorCode` name; only kinds that happened."""
    ring_full: int = 0
    """Values not transferred because the ring had no room by the request's deadline."""
    put_bytes: int = 0
    get_bytes: int = 0
    clients_died_mid_transfer: int = 0
    """Clients that went away with transfers open (killed engines): unclean detaches."""
    marked_stored: int = 0
    """Values of puts whose client went away before committing, stored from their completion marks."""
    marks_refused: int = 0
    """Completion marks for a place not lent, or with a checksum the bytes do not match: not stored."""
    unmarked_dropped: int = 0
    """Values of such puts not marked complete (maybe half-written): given back unread."""


# -- per-tier children ---------------------------------------------------------------------------


class TierFamilies:
    """The ``kvharbor_tier_*`` counter families, one per registry; `tier` binds a tier's children."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.operations = Counter(
            "kvharbor_tier_operations_total", "Per-tier operations by outcome", ["tier", "op", "outcome"],
            registry=registry,
        )  # fmt: skip
        self.duration = Histogram(
            "kvharbor_tier_operation_duration_seconds", "Device time per tier operation", ["tier", "op"],
            registry=registry, buckets=LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.corrupt = Counter(
            "kvharbor_tier_corrupt_objects_total", "Objects that failed verification (misses, dropped)", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.stale = Counter(
            "kvharbor_tier_stale_objects_total",
            "Objects stored under other settings of the tier (a card's fragment size): misses, dropped", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.evictions = Counter("kvharbor_tier_evictions_total", "Objects evicted", ["tier"], registry=registry)
        self.evicted_bytes = Counter(
            "kvharbor_tier_evicted_bytes_total", "Bytes of the objects evicted", ["tier"], registry=registry
        )
        self.written_bytes = Counter(
            "kvharbor_tier_written_bytes_total", "Bytes of the objects stored (headers included)", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.read_bytes = Counter(
            "kvharbor_tier_read_bytes_total", "Value bytes of the gets that hit", ["tier"], registry=registry
        )
        self.async_dropped = Counter(
            "kvharbor_tier_async_dropped_total", "Writes dropped: the tier's write queue was full", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.async_flushed = Counter(
            "kvharbor_tier_async_flushed_total", "Writes taken off the tier's queue and written", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.async_unflushed = Counter(
            "kvharbor_tier_async_unflushed_total", "Writes still queued at the shutdown deadline (lost)", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.async_depth = Gauge(
            "kvharbor_tier_async_queue_depth", "Writes queued or being written now", ["tier"], registry=registry
        )
        self.async_bytes = Gauge(
            "kvharbor_tier_async_queue_bytes", "Value bytes the tier's write queue holds now", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.codec_values = Counter(
            "kvharbor_tier_codec_values_total", "Values the tier's codec compressed or decompressed", ["tier", "op"],
            registry=registry,
        )  # fmt: skip
        self.codec_raw_bytes = Counter(
            "kvharbor_tier_codec_raw_bytes_total", "Value bytes before compression or after decompression",
            ["tier", "op"], registry=registry,
        )  # fmt: skip
        self.codec_stored_bytes = Counter(
            "kvharbor_tier_codec_stored_bytes_total", "Bytes after compression or before decompression",
            ["tier", "op"], registry=registry,
        )  # fmt: skip
        self.codec_seconds = Counter(
            "kvharbor_tier_codec_seconds_total", "Time in the tier's codec", ["tier", "op"], registry=registry
        )
        self.compression_ratio = Gauge(
            "kvharbor_tier_compression_ratio", "Raw over stored bytes of the values the tier's codec compressed",
            ["tier"], registry=registry,
        )  # fmt: skip

    def tier(self, name: str) -> TierMetrics:
        return TierMetrics(self, name)


class TierMetrics:
    """One tier's children of the tier families, bound once; what `Tier` counts through."""

    def __init__(self, families: TierFamilies, tier: str) -> None:
        self.tier = tier
        self._ops = {
            (op, outcome): families.operations.labels(tier, op.value, outcome.value)
            for op, outcomes in OUTCOMES.items()
            for outcome in outcomes
        }
        self.duration = {op: families.duration.labels(tier, op.value) for op in TIMED_OPS}
        """Per timed operation, its histogram child: ``with metrics.duration[TierOp.GET].time():``."""
        self._corrupt = families.corrupt.labels(tier)
        self._stale = families.stale.labels(tier)
        self._evictions = families.evictions.labels(tier)
        self._evicted_bytes = families.evicted_bytes.labels(tier)
        self._written_bytes = families.written_bytes.labels(tier)
        self._read_bytes = families.read_bytes.labels(tier)
        self._families = families
        self._async_dropped = families.async_dropped.labels(tier)
        self._async_flushed = families.async_flushed.labels(tier)
        self._async_unflushed = families.async_unflushed.labels(tier)
        self._codec = {
            op: (
                families.codec_values.labels(tier, op.value),
                families.codec_raw_bytes.labels(tier, op.value),
                families.codec_stored_bytes.labels(tier, op.value),
                families.codec_seconds.labels(tier, op.value),
            )
            for op in CodecOp
        }

    @classmethod
    def standalone(cls, tier: str) -> TierMetrics:
        """Children in a registry of their own: a tier outside a gateway (tools, tests)."""
        return TierFamilies(CollectorRegistry()).tier(tier)

    def outcome(self, op: TierOp, outcome: Outcome) -> None:
        """Count one operation's outcome; a pair not in `OUTCOMES` is a bug (KeyError)."""
        self._ops[op, outcome].inc()

    def stored(self, nbytes: int) -> None:
        self._ops[TierOp.PUT, Outcome.OK].inc()
        self._written_bytes.inc(nbytes)

    def hit(self, nbytes: int, count: int = 1) -> None:
        """``count`` gets answered with ``nbytes`` of values in all."""
        self._ops[TierOp.GET, Outcome.OK].inc(count)
        self._read_bytes.inc(nbytes)

    def corrupt(self) -> None:
        self._corrupt.inc()

    def stale(self) -> None:
        self._stale.inc()

    def evicted(self, nbytes: int) -> None:
        self._evictions.inc()
        self._evicted_bytes.inc(nbytes)

    def watch_queue(self, depth: Callable[[], int], nbytes: Callable[[], int]) -> None:
        """Read this tier's write queue (`kvharbor.cache.writequeue`) at every scrape: a tier
        with one has ``kvharbor_tier_async_queue_*`` samples, a tier without none."""
        self._families.async_depth.labels(self.tier).set_function(depth)
        self._families.async_bytes.labels(self.tier).set_function(nbytes)

    def async_dropped(self) -> None:
        self._async_dropped.inc()

    def async_flushed(self) -> None:
        self._async_flushed.inc()

    def async_unflushed(self, count: int) -> None:
        self._async_unflushed.inc(count)

    def codec(self, op: CodecOp, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        """Count one value the codec compressed (``op`` encode) or decompressed."""
        values, raw, stored, spent = self._codec[op]
        values.inc()
        raw.inc(raw_bytes)
        stored.inc(stored_bytes)
        spent.inc(seconds)

    def watch_compression(self) -> None:
        """Give this tier a ``kvharbor_tier_compression_ratio`` sample, read at every scrape
        (a tier that compresses; NaN until its first value)."""
        ratio = self._families.compression_ratio.labels(self.tier)
        ratio.set_function(lambda: self.codec_stats().ratio or math.nan)

    def codec_stats(self) -> CodecStats:
        def read(op: CodecOp) -> tuple[int, int, int, float]:
            values, raw, stored, spent = self._codec[op]
            return int(_value(values)), int(_value(raw)), int(_value(stored)), _value(spent)

        return CodecStats.of(read(CodecOp.ENCODE), read(CodecOp.DECODE))

    def snapshot(self) -> TierCounts:
        ops = {pair: int(_value(child)) for pair, child in self._ops.items()}
        return TierCounts(
            puts=ops[TierOp.PUT, Outcome.OK],
            put_bytes=int(_value(self._written_bytes)),
            gets=sum(n for (op, outcome), n in ops.items() if op is TierOp.GET and outcome is not Outcome.SKIPPED),
            hits=ops[TierOp.GET, Outcome.OK],
            hit_bytes=int(_value(self._read_bytes)),
            corrupt=int(_value(self._corrupt)),
            evictions=int(_value(self._evictions)),
            evicted_bytes=int(_value(self._evicted_bytes)),
            errors=sum(n for (_, outcome), n in ops.items() if outcome is Outcome.ERROR),
            full=ops[TierOp.PUT, Outcome.FULL],
            skipped=sum(n for (_, outcome), n in ops.items() if outcome is Outcome.SKIPPED),
            stale=int(_value(self._stale)),
            async_dropped=int(_value(self._async_dropped)),
            async_flushed=int(_value(self._async_flushed)),
            async_unflushed=int(_value(self._async_unflushed)),
            codec=self.codec_stats(),
        )


# -- lookups ---------------------------------------------------------------------------------------


class HitMetrics:
    """Lookups and hits in tokens (`HitCounts`), counted by the store on every probe."""

    def __init__(self, registry: CollectorRegistry, window_s: int = 300) -> None:
        """``window_s``: the span of `recent` (``telemetry.hit_rate_window_s``)."""
        self.recent = RecentTokens(window_s)
        """The last ``window_s`` seconds, for status (Prometheus takes rates of the counters)."""
        self._lookups = Counter("kvharbor_lookups_total", "LOOKUP requests answered", registry=registry)
        self._lookup_tokens = Counter("kvharbor_lookup_tokens_total", "Full-chunk tokens looked up", registry=registry)
        self._hit_tokens = Counter(
            "kvharbor_hit_tokens_total", "Of the tokens looked up, those found stored", registry=registry
        )

    @classmethod
    def standalone(cls) -> HitMetrics:
        return cls(CollectorRegistry())

    def record(self, lookup_tokens: int, hit_tokens: int) -> None:
        if not 0 <= hit_tokens <= lookup_tokens:
            raise ValueError(f"hit_tokens {hit_tokens} outside 0..lookup_tokens {lookup_tokens}")
        self._lookups.inc()
        self._lookup_tokens.inc(lookup_tokens)
        self._hit_tokens.inc(hit_tokens)
        self.recent.record(lookup_tokens, hit_tokens)

    def snapshot(self) -> HitCounts:
        return HitCounts(int(_value(self._lookups)), int(_value(self._lookup_tokens)), int(_value(self._hit_tokens)))


# -- requests --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One message type's children: requests served and the time each took."""

    served: Counter
    duration: Histogram


class GatewayMetrics:
    """The gateway process's registry and metrics (see the module's docstring).

    ``registry``: the one `/metrics` serves; a fresh one by default (one per process).
    """

    def __init__(
        self,
        error_kinds: Iterable[str] = (),
        request_types: Mapping[int, str] | None = None,
        registry: CollectorRegistry | None = None,
        hit_rate_window_s: int = 300,
    ) -> None:
        """``error_kinds``: the ``kvharbor_errors_total`` kinds bound at start (the protocol's
        `ErrorCode` names; `EXTRA_ERROR_KINDS` are always bound): every kind is a series
        from the first scrape, so that ``rate()`` sees its first error. ``request_types``:
        the ``type`` label of each protocol message type (see `served`)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.info = Gauge("kvharbor_gateway_info", "Which gateway answers (always 1)", ["release", "protocol"],
                          registry=r)  # fmt: skip
        self.hits = HitMetrics(r, hit_rate_window_s)
        self.tiers = TierFamilies(r)
        self._requests = Counter("kvharbor_requests_total", "Protocol requests served, by message type", ["type"],
                                 registry=r)  # fmt: skip
        self._request_duration = Histogram(
            "kvharbor_request_duration_seconds", "Gateway time per request, by message type", ["type"],
            registry=r, buckets=LATENCY_BUCKETS_S,
        )  # fmt: skip
        self._request_names = dict(request_types or {})
        self._request_children: dict[int, RequestMetrics] = {}
        self._bind_lock = threading.Lock()
        errors = Counter("kvharbor_errors_total", "Refused requests and faults, by kind", ["kind"], registry=r)
        self._errors = {kind: errors.labels(kind) for kind in (*error_kinds, *EXTRA_ERROR_KINDS)}
        self._error_family = errors
        self._clients = Counter("kvharbor_clients_total", "Client connections admitted", registry=r)
        self.bytes_in = Counter("kvharbor_bytes_in_total", "Value bytes stored by clients (puts)", registry=r)
        self.bytes_out = Counter("kvharbor_bytes_out_total", "Value bytes served to clients (gets)", registry=r)
        self.detaches_unclean = Counter(
            "kvharbor_client_detaches_unclean_total",
            "Clients that went away with transfers open, without detaching (killed engines)", registry=r,
        )  # fmt: skip
        self.clients_attached = Gauge(
            "kvharbor_clients_attached", "Clients connected now (past their HELLO)", registry=r
        )
        """Read at scrape time: its owner sets a function (`Gauge.set_function`)."""
        self.marked_stored = Counter(
            "kvharbor_marked_values_stored_total", "Values stored from completion marks of a vanished client",
            registry=r,
        )  # fmt: skip

    def announce(self, protocol: int) -> None:
        """Set ``kvharbor_gateway_info`` for this gateway's release and protocol."""
        self.info.labels(__version__, str(protocol)).set(1)

    def watch(self, collector: Collector) -> None:
        """Read ``collector``'s gauges at every scrape (`kvharbor.gateway.collectors`)."""
        self.registry.register(collector)

    def served(self, kind: int, seconds: float) -> None:
        """Count a request of message type ``kind`` that took ``seconds``; a type not in
        ``request_types`` is not counted (it was refused as malformed, and counted so).

        A type's children are bound at its first request (a dict look-up after): only
        the types clients send become series, not every reply type of the protocol.
        """
        children = self._request_children.get(kind)
        if children is None:
            name = self._request_names.get(kind)
            if name is None:
                return
            with self._bind_lock:
                children = self._request_children.setdefault(
                    kind, RequestMetrics(self._requests.labels(name), self._request_duration.labels(name))
                )
        children.served.inc()
        children.duration.observe(seconds)

    def error(self, kind: str, count: int = 1) -> None:
        """Count ``count`` errors of ``kind`` (an `ErrorCode` name or one of `EXTRA_ERROR_KINDS`)."""
        child = self._errors.get(kind)
        if child is None:
            with self._bind_lock:
                child = self._errors.setdefault(kind, self._error_family.labels(kind))
        child.inc(count)

    def admitted(self) -> None:
        self._clients.inc()

    def snapshot(self) -> GatewayCounts:
        errors = {kind: int(_value(child)) for kind, child in list(self._errors.items())}
        return GatewayCounts(
            clients_total=int(_value(self._clients)),
            rejected={k: n for k, n in errors.items() if n and k not in EXTRA_ERROR_KINDS},
            ring_full=errors["ring_full"],
            put_bytes=int(_value(self.bytes_in)),
            get_bytes=int(_value(self.bytes_out)),
            clients_died_mid_transfer=int(_value(self.detaches_unclean)),
            marked_stored=int(_value(self.marked_stored)),
            marks_refused=errors["marks_refused"],
            unmarked_dropped=errors["unmarked_dropped"],
        )
