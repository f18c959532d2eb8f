"""Load or recompute: is restoring a stored prefix faster than computing it again?

A stored prefix is worth loading only while

    load time = fixed latency + bytes / measured load bandwidth

is below

    recompute time = prefill FLOPs of those tokens / measured FLOP rate.

Both rates are learned at run time from what the engine actually did, so a
slow tier (a throttled disk, a remote bucket) can never make the time to first
token worse once it has been seen, and a fast one is always used:

- **load bandwidth**: bytes restored over the seconds the restore held the
  engine (workers time their loads; vLLM hands their stats to the scheduler),
  an exponentially weighted average in which big loads weigh more than small
  ones (a small load is mostly latency);
- **prefill rate**: FLOPs over seconds of the engine's own forward passes in
  steps that loaded nothing, with the FLOPs of a step counted by
  `PrefillCost`. FLOPs and not tokens: attention makes a token at position
  130,000 cost far more than one at position 1,000 (the Llama-3.1-8B shape
  runs 32,768 tokens at ~27k tokens/s but 130,000 at ~12.6k), while the
  FLOP rate of one engine stays nearly constant (6.6e14 vs 6.3e14 FLOP/s there).

A prefix found only on a tier outside RAM (files, after a reboot) is read back
into RAM before it is promised (`kvharbor.connector.verifier`), and the request
waits for that too; so its load time adds

    read-back time = bytes to read back / measured read-back bandwidth

learned the same way from the read-backs the scheduler's verifier timed. Without
it a disk slower than recomputing would be read from on every restart: the load
itself, from RAM, is fast.

Until a rate has been measured the answer is "load" (nothing says otherwise),
and the worker stops a load part-way when the bandwidth it sees says the rest
would be slower than recomputing it (`keep_loading`). No engine imports here:
the connector feeds the numbers in.

A planner that recomputes learns nothing more about loads: one slow stretch (a
disk busy with another job's writes) would otherwise keep every later prefix
recomputed for the engine's life, however fast its tiers became. So when a load
rate no sample has refreshed for ``resample_s`` says recompute, one stored prefix
is loaded anyway (read back first where it must be), and its samples replace the
stale ones (at a bounded cost: the
worker cuts that load short if the rest arrives slower than it recomputes); the
other requests keep to the old rate meanwhile. A load that finds the rate still
saying recompute doubles the wait for the next, up to ``resample_max_s``, so that
an engine with a slow tier and few requests does not pay for one on each of them.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

LOAD_LATENCY_S = 0.002
"""Fixed cost of a restore (gateway round trips, first copy) added to bytes / bandwidth."""
LOAD_SAMPLE_BYTES_MIN = 8 << 20
"""Restores smaller than this are mostly latency: they do not update the bandwidth."""
PREFILL_SAMPLE_FLOPS_MIN = 1e12
"""Steps lighter than this (decode steps) are mostly fixed overhead: not a prefill sample."""
HALF_LIFE_SAMPLES = 8.0
"""A sample's weight halves after this many newer samples (of equal size)."""
SWITCH_MARGIN = 1.0
"""Recompute only when loading is predicted slower than this factor times recomputing."""


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Forward FLOPs of prefilling tokens of one sequence, from the model's shape.

    ``linear``: FLOPs per token of the weight matmuls (2 x weights touched per
    token); ``attention``: FLOPs per (query token, earlier position) pair
    (QK^T and PV: 4 x layers x query heads x head size).
    """

    linear: float
    attention: float

    def flops(self, start: int, end: int) -> float:
        """FLOPs to compute positions ``start .. end`` with ``0 .. start`` in cache."""
        n = max(0, end - start)
        # Token i attends to i + 1 positions: sum over i in [start, end) = n * (start + end + 1) / 2.
        return self.linear * n + self.attention * n * (start + end + 1) / 2

    @classmethod
    def transformer(
        cls,
        hidden: int,
        layers: int,
        heads: int,
        kv_heads: int,
        head_size: int,
        intermediate: int,
        gated_mlp: bool = True,
    ) -> PrefillCost:
        """A decoder-only transformer (Llama-style: gated MLP, grouped KV heads)."""
        q_out = heads * head_size
        per_layer = hidden * q_out + 2 * hidden * kv_heads * head_size + q_out * hidden
        per_layer += (3 if gated_mlp else 2) * hidden * intermediate
        return cls(linear=2.0 * layers * per_layer, attention=4.0 * layers * q_out)


class RateEstimate:
    """An exponentially weighted rate: sum(w * amount) / sum(w * seconds).

    Weighting amounts and seconds (rather than averaging rates) lets a big
    sample count for more than a small one. Thread-safe.
    """

    def __init__(self, half_life_samples: float = HALF_LIFE_SAMPLES, prior: float | None = None) -> None:
        assert half_life_samples > 0
        self._keep = 0.5 ** (1.0 / half_life_samples)
        self._amount = 0.0
        self._seconds = 0.0
        self.samples = 0
        self._prior = prior
        self._lock = threading.Lock()

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        with self._lock:
            self._amount = self._amount * self._keep + amount
            self._seconds = self._seconds * self._keep + seconds
            self.samples += 1

    def forget(self) -> None:
        """Drop every sample: the rate is the prior's until the next (`samples` keeps counting)."""
        with self._lock:
            self._amount = self._seconds = 0.0

    @property
    def rate(self) -> float | None:
        """Amount per second; the prior (or None) until a sample came."""
        with self._lock:
            if self._seconds <= 0:
                return self._prior
            return self._amount / self._seconds


class _Remeasure(enum.Enum):
    """Where a re-measurement of a stale load rate stands."""

    NONE = enum.auto()
    AWAITING_SAMPLE = enum.auto()
    """A load was chosen to measure the rate: its sample replaces the stale one."""
    SAMPLED = enum.auto()
    """The rate is that sample's: the next choice says whether to back off."""


@dataclass(frozen=True, slots=True)
class Decision:
    load: bool
    load_s: float | None
    recompute_s: float | None
    remeasure: bool = False
    """Loaded although the stale rate said recompute: to measure the load rate again."""
    reads_back: bool = False
    """``load_s`` includes reading chunks back from a tier outside RAM."""

    @property
    def reason(self) -> str:
        if self.remeasure:
            return "the load rate went unmeasured past engine.load_resample_s: load, to measure it again"
        if self.load_s is None or self.recompute_s is None:
            return "no measured rate yet: load"
        verb = "load" if self.load else "recompute"
        load = f"load {self.load_s * 1000:.0f} ms" + (
            " (its read-back from a tier outside RAM included)" if self.reads_back else ""
        )
        return f"{verb}: {load} vs recompute {self.recompute_s * 1000:.0f} ms"


def choose(load_s: float | None, recompute_s: float | None, margin: float | None = None) -> Decision:
    """Load unless both times are known and loading is the slower by ``margin``
    (default `SWITCH_MARGIN`)."""
    margin = SWITCH_MARGIN if margin is None else margin
    load = load_s is None or recompute_s is None or load_s <= margin * recompute_s
    return Decision(load, load_s, recompute_s)


def keep_loading(elapsed_s: float, bytes_done: int, bytes_left: int, recompute_left_s: float | None) -> bool:
    """Mid-load: is fetching the rest at the bandwidth seen so far still faster than
    recomputing the rest? True while nothing says otherwise."""
    if recompute_left_s is None or bytes_left <= 0 or bytes_done <= 0 or elapsed_s <= 0:
        return True
    return bytes_left * elapsed_s / bytes_done <= SWITCH_MARGIN * recompute_left_s


class LoadPlanner:
    """The scheduler's view: the rates it has learned, and the choice per request."""

    def __init__(
        self,
        cost: PrefillCost,
        chunk_bytes: int,
        chunk_tokens: int,
        load_prior_bytes_per_s: float | None = None,
        prefill_prior_flops_per_s: float | None = None,
        resample_s: float | None = None,
        resample_max_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        restore_bytes: int = 0,
    ) -> None:
        """``resample_s``: how long a load rate that says recompute is kept without a new
        sample (None: for ever), doubled after each load that still says so up to
        ``resample_max_s`` (None: ``resample_s``); ``clock``: monotonic seconds;
        ``restore_bytes``: what one rank restores once per restore besides its chunks (a
        hybrid model's state at the restore's end)."""
        assert chunk_bytes > 0 and chunk_tokens > 0
        if resample_s is not None and not resample_s > 0:
            raise ValueError(f"resample_s must be > 0 s, got {resample_s}")
        if resample_s is not None and resample_max_s is not None and resample_max_s < resample_s:
            raise ValueError(f"resample_max_s ({resample_max_s} s) must be at least resample_s ({resample_s} s)")
        self._resample_bounds_s = None if resample_s is None else (resample_s, resample_max_s or resample_s)
        self._resample_wait_s = resample_s or 0.0
        """The wait before the next re-measurement: ``resample_s``, doubled while they find it slow."""
        self._clock = clock
        self._load_measured_at = clock()
        """When the load rate last took a sample, or a load was chosen to take one."""
        self._remeasure = _Remeasure.NONE
        self.remeasured = 0
        """Loads chosen to measure a stale rate again."""
        self.cost = cost
        self.chunk_bytes = chunk_bytes
        """Bytes one rank restores per chunk (ranks load in parallel)."""
        self.chunk_tokens = chunk_tokens
        assert restore_bytes >= 0, restore_bytes
        self.restore_bytes = restore_bytes
        """Bytes one rank restores once per restore besides its chunks."""
        self.load_rate = RateEstimate(prior=load_prior_bytes_per_s)
        self.read_back_rate = RateEstimate()
        """Bytes per second of read-backs from tiers outside RAM (every rank's values)."""
        self._read_back_stale = False
        """A re-measurement began: the next read-back sample replaces the rate."""
        self.prefill_rate = RateEstimate(prior=prefill_prior_flops_per_s)
        self.chose_recompute = 0
        """Requests its caller counted as recomputed (each once)."""

    # -- learning ------------------------------------------------------------

    def observe_load(self, nbytes: float, seconds: float) -> None:
        if nbytes >= LOAD_SAMPLE_BYTES_MIN and seconds > 0:
            if self._remeasure is _Remeasure.AWAITING_SAMPLE:
                self._remeasure = _Remeasure.SAMPLED
                self.load_rate.forget()  # Older than resample_s: this sample is the rate now.
            self.load_rate.add(nbytes, seconds)
            self._load_measured_at = self._clock()

    def observe_read_back(self, nbytes: float, seconds: float) -> None:
        """A read-back of ``nbytes`` (every rank's values of its chunks) took ``seconds``."""
        if nbytes >= LOAD_SAMPLE_BYTES_MIN and seconds > 0:
            if self._read_back_stale:
                self._read_back_stale = False
                self.read_back_rate.forget()
            self.read_back_rate.add(nbytes, seconds)

    def observe_prefill(self, flops: float, seconds: float) -> None:
        if flops >= PREFILL_SAMPLE_FLOPS_MIN:
            self.prefill_rate.add(flops, seconds)

    # -- predicting ----------------------------------------------------------

    def load_s(self, nbytes: int, read_back_bytes: int = 0) -> float | None:
        """Restoring ``nbytes`` per rank (ranks load in parallel), after reading
        ``read_back_bytes`` (every rank's values, one stream) back into RAM: 0 s for those
        while no read-back has been timed. None while no load has been."""
        rate = self.load_rate.rate
        if not rate:
            return None
        read_back = self.read_back_rate.rate
        return LOAD_LATENCY_S + nbytes / rate + (read_back_bytes / read_back if read_back else 0.0)

    def recompute_s(self, start: int, end: int) -> float | None:
        rate = self.prefill_rate.rate
        return None if not rate else self.cost.flops(start, end) / rate

    def chunk_recompute_s(self, start: int, end: int) -> tuple[float, ...]:
        """Per chunk of ``start .. end`` (chunk-aligned except at the ends), its recompute
        time; empty while the prefill rate is unknown."""
        rate = self.prefill_rate.rate
        if not rate or end <= start:
            return ()
        size = self.chunk_tokens
        bounds = [start, *range((start // size + 1) * size, end, size), end]
        return tuple(self.cost.flops(a, b) / rate for a, b in itertools.pairwise(bounds))

    def choose(self, start: int, end: int, chunks: int, read_back_bytes: int = 0) -> Decision:
        """Load tokens ``start .. end`` (``chunks`` stored chunks, whole, first reading
        ``read_back_bytes`` of them back, `load_s`) or recompute them? A recompute that rests on a load
        rate unmeasured for ``resample_s`` is a load instead, one per period (the module's
        docstring says why)."""
        nbytes = chunks * self.chunk_bytes + self.restore_bytes
        decision = choose(self.load_s(nbytes, read_back_bytes), self.recompute_s(start, end))
        if read_back_bytes and self.read_back_rate.rate:
            decision = replace(decision, reads_back=True)
        if self._resample_bounds_s is None:
            return decision
        least_s, most_s = self._resample_bounds_s
        if self._remeasure is _Remeasure.SAMPLED:  # The first choice on a re-measured rate: back off, or start over.
            self._remeasure = _Remeasure.NONE
            self._resample_wait_s = least_s if decision.load else min(2 * self._resample_wait_s, most_s)
        if decision.load:
            return decision
        now = self._clock()
        if now - self._load_measured_at < self._resample_wait_s:
            return decision
        self._load_measured_at = now  # The next one a period on, should this load never report.
        self._remeasure = _Remeasure.AWAITING_SAMPLE
        self._read_back_stale = read_back_bytes > 0
        self.remeasured += 1
        return Decision(True, decision.load_s, decision.recompute_s, remeasure=True)

    def snapshot(self) -> dict[str, float]:
        return {
            "load_bytes_per_s": self.load_rate.rate or 0.0,
            "load_samples": self.load_rate.samples,
            "read_back_bytes_per_s": self.read_back_rate.rate or 0.0,
            "read_back_samples": self.read_back_rate.samples,
            "prefill_flops_per_s": self.prefill_rate.rate or 0.0,
            "prefill_samples": self.prefill_rate.samples,
            "chose_recompute": self.chose_recompute,
            "load_remeasured": self.remeasured,
        }
