"""A fleet of engines over shared tiers, in SimPy: time to first token and GPU time saved.

Each of N engines has a GPU prefix cache (LRU, in blocks, the KV room its GPUs
have beside the weights: `EngineCost.gpu_cache_tokens`) and prefills one request
at a time (prefill is compute-bound: a batch of prefills takes as long as the
same prefills one after another). Behind them sit an optional host-RAM tier and
the card tier, shared by the fleet as one gateway's tiers are by a host's
engines, with ``--policy``'s eviction.

The simulation steps per request and per transfer, never per decode step: a
request arrives (routed), waits for its engine, loads what it hits outside the
GPU (one timed transfer), prefills the rest (one timed event), then stores its
new whole blocks (a card write booked on the card's channels, off the request's
path, as kvharbor saves). Decode is not simulated: TTFT is queueing, load and
prefill.

The load-or-recompute choice is the connector's: each engine has its own
`kvharbor.cache.bandwidth.LoadPlanner`, which answers "load" until it has seen a
load, then compares the load time at the bandwidth it learned from the loads it
made with the recompute time of the same tokens (`PrefillCost` FLOPs at the
engine's rate). As in the connector, the card's part of a hit is first read back
into RAM, timed by the simulated card's channel model (`kvharbor.hal.sim.channels`)
so that concurrent loads and stores queue on its channels; then the whole hit is
copied into the GPU at the restore bandwidth, after the fixed latency. The planner
learns both rates (read-back and load) from what it sees.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field

import simpy

from kvharbor.cache.bandwidth import LOAD_LATENCY_S, LoadPlanner
from kvharbor.config import EngineSection
from kvharbor.hal.sim.channels import Channels
from kvharbor.hal.sim.params import CardParams
from kvharbor.sim.caches import LruCache, Policy, hit_tokens, make_cache, stored_blocks
from kvharbor.sim.cost import EngineCost
from kvharbor.sim.errors import PlanInputError
from kvharbor.sim.workload import Request

DEFAULT_ENGINE = EngineSection()
"""The connector's engine settings the planner is modelled with (its re-measurement of load rates)."""
FILL_SAMPLES = 200
"""Fill and eviction samples a run records (at evenly spaced completions)."""


class Routing(enum.Enum):
    ROUND_ROBIN = "round-robin"
    PREFIX_AWARE = "prefix-aware"
    """The engine whose GPU cache holds the longest prefix; ties to the shortest queue."""

    @classmethod
    def parse(cls, name: str) -> Routing:
        try:
            return cls(name.lower())
        except ValueError:
            raise PlanInputError(
                f"--routing: unknown routing {name!r}; known: {', '.join(r.value for r in cls)}"
            ) from None


class Tier(enum.Enum):
    GPU = "gpu"
    RAM = "ram"
    CARD = "card"


@dataclass(frozen=True, slots=True)
class FleetConfig:
    engines: int
    engine: EngineCost
    block_tokens: int
    card_tokens: int
    """The card tier's capacity; 0: no card tier."""
    ram_tokens: int = 0
    """The shared host-RAM tier's capacity; 0: none."""
    policy: Policy = Policy.LRU
    routing: Routing = Routing.PREFIX_AWARE
    card: CardParams = field(default_factory=CardParams)
    """The card's timing (channels, bandwidths, latencies); its capacity is ``card_tokens``."""

    def __post_init__(self) -> None:
        if self.engines <= 0:
            raise PlanInputError(f"--engines: must be > 0 (got {self.engines})")
        if self.card_tokens < 0 or self.ram_tokens < 0:
            raise PlanInputError("--card-gb, --ram-gb: must be >= 0")


@dataclass(frozen=True, slots=True)
class FillSample:
    time_s: float
    used_ratio: dict[Tier, float]
    """Per tier, its blocks held over its capacity (the GPU: the mean over engines)."""
    evictions: dict[Tier, int]
    """Per tier, blocks evicted so far (the GPU: over all engines)."""


@dataclass(frozen=True, slots=True)
class FleetResult:
    requests: int
    prompt_tokens: int
    hit_tokens: dict[Tier, int]
    """Prompt tokens served from each tier (loads that were chosen; recomputed hits are not)."""
    ttft_s: array[float]
    """Every request's time to first token, sorted."""
    prefill_gpu_s: float
    """GPU-seconds spent prefilling (x tensor-parallel ranks)."""
    prefill_gpu_s_without_cache: float
    """GPU-seconds the same prompts take with no cache at all."""
    chose_load: int
    chose_recompute: int
    fill: tuple[FillSample, ...]

    def token_hit_rate(self, tier: Tier | None = None) -> float:
        hit = sum(self.hit_tokens.values()) if tier is None else self.hit_tokens[tier]
        return hit / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft_quantile_s(self, q: float) -> float:
        """Nearest-rank quantile of the TTFTs (``q`` in 0..1)."""
        if not self.ttft_s:
            return 0.0
        rank = min(len(self.ttft_s) - 1, max(0, int(q * len(self.ttft_s) + 0.5) - 1))
        return self.ttft_s[rank]

    @property
    def prefill_gpu_s_saved(self) -> float:
        return self.prefill_gpu_s_without_cache - self.prefill_gpu_s


class _Engine:
    def __init__(self, capacity_blocks: int, planner: LoadPlanner) -> None:
        self.waiting: deque[tuple[Request, float]] = deque()
        """Requests routed here, not started yet, with their predicted prefill seconds."""
        self.wake: simpy.Event | None = None
        """What the idle engine waits on; an arrival triggers it."""
        self.gpu = LruCache(capacity_blocks)
        self.planner = planner
        """The connector's own load-or-recompute planner, learning this engine's load bandwidth."""
        self.pending_s = 0.0
        """Predicted prefill seconds of the requests routed here and not done yet."""


class _Fleet:
    """One run's state; `run_fleet` drives it."""

    def __init__(self, config: FleetConfig, requests_total: int, progress: Callable[[int], None] | None) -> None:
        self.config = config
        self.env = simpy.Environment()
        cost, bt = config.engine, config.block_tokens
        gpu_blocks = cost.gpu_cache_tokens // bt
        if gpu_blocks < 1:
            raise PlanInputError(f"--block-tokens {bt}: more than the GPU cache holds")
        self.block_bytes = bt * cost.kv_bytes_per_token
        self.engines = [_Engine(gpu_blocks, self._planner(cost, bt, self.block_bytes)) for _ in range(config.engines)]
        self.ram = make_cache(config.policy, config.ram_tokens // bt) if config.ram_tokens >= bt else None
        self.card = make_cache(config.policy, config.card_tokens // bt) if config.card_tokens >= bt else None
        params = config.card
        # One stripe per channel per block: the card's throughput and latency, with a
        # heap operation per channel and block instead of per 128 KiB.
        self.channels = Channels(params.channels, max(params.stripe_bytes, -(-self.block_bytes // params.channels)))
        self.hits = dict.fromkeys(Tier, 0)
        self.ttft = array("d")
        self.prefill_gpu_s = 0.0
        self.cold_gpu_s = 0.0
        self.prompt_tokens = 0
        self.chose_load = self.chose_recompute = 0
        self.fill: list[FillSample] = []
        self._sample_every = max(1, requests_total // FILL_SAMPLES)
        self._next_engine = 0
        self._progress = progress

    def _planner(self, cost: EngineCost, block_tokens: int, block_bytes: int) -> LoadPlanner:
        """As the connector makes it: a rank's bytes per chunk, the load bandwidth unknown
        until a load is seen, measured again after ``engine.load_resample_s`` of simulated
        time without one; the prefill rate is the engine's (the connector measures it on its
        first prefill)."""
        return LoadPlanner(
            cost.prefill,
            chunk_bytes=block_bytes // cost.tensor_parallel,
            chunk_tokens=block_tokens,
            prefill_prior_flops_per_s=cost.prefill_flops_per_s,
            resample_s=DEFAULT_ENGINE.load_resample_s,
            resample_max_s=DEFAULT_ENGINE.load_resample_max_s,
            clock=lambda: self.env.now,
        )

    # -- processes -----------------------------------------------------------

    def arrivals(self, requests: Iterator[Request]) -> Generator[simpy.Event, None, None]:
        env = self.env
        for request in requests:
            if request.arrival_s > env.now:
                yield env.timeout(request.arrival_s - env.now)
            engine, predicted_s = self.route(request)
            engine.pending_s += predicted_s
            engine.waiting.append((request, predicted_s))
            if engine.wake is not None:
                engine.wake.succeed()
                engine.wake = None

    def engine_loop(self, engine: _Engine) -> Generator[simpy.Event, None, None]:
        """One engine: its requests one at a time, in arrival order (a queue of our own
        rather than a `simpy.Resource`: two events fewer per request)."""
        while True:
            if not engine.waiting:
                engine.wake = self.env.event()
                yield engine.wake
            request, predicted_s = engine.waiting.popleft()
            yield from self.serve(request, engine)
            engine.pending_s -= predicted_s

    def serve(self, request: Request, engine: _Engine) -> Generator[simpy.Event, None, None]:
        env, cost = self.env, self.config.engine
        n = request.input_tokens
        gpu_end, ram_end, card_end = self._hit_ends(request, engine)
        computed_from = gpu_end
        end = card_end
        if end > ram_end and not self._worth_loading(engine, gpu_end, end, read_back_tokens=end - ram_end):
            end = ram_end  # As the connector: the card's part is not read back, RAM's is offered.
        if ram_end == end > gpu_end and not self._worth_loading(engine, gpu_end, end, read_back_tokens=0):
            end = gpu_end
        if end < card_end:
            self.chose_recompute += 1
        if end > gpu_end:
            self.chose_load += 1
            computed_from = end
            self.hits[Tier.RAM] += ram_end - gpu_end
            self.hits[Tier.CARD] += end - ram_end
            read_back_bytes = (end - ram_end) * cost.kv_bytes_per_token
            read_back_s = self._read_back_s(read_back_bytes)
            load_s = LOAD_LATENCY_S + (end - gpu_end) * cost.kv_bytes_per_token / cost.restore_bytes_per_s
            engine.planner.observe_read_back(read_back_bytes, read_back_s)
            engine.planner.observe_load(self._chunks(gpu_end, end) * engine.planner.chunk_bytes, load_s)
            yield env.timeout(read_back_s + load_s)
        self.hits[Tier.GPU] += gpu_end
        prefill_s = cost.prefill_s(computed_from, n)
        yield env.timeout(prefill_s)
        self.ttft.append(env.now - request.arrival_s)
        self.prefill_gpu_s += prefill_s * cost.tensor_parallel
        self.cold_gpu_s += cost.prefill_s(0, n) * cost.tensor_parallel
        self.prompt_tokens += n
        self._store(request, engine)
        done = len(self.ttft)
        if done % self._sample_every == 0:
            self._sample()
        if self._progress is not None:
            self._progress(done)

    # -- pieces --------------------------------------------------------------

    def route(self, request: Request) -> tuple[_Engine, float]:
        """The engine for ``request`` and its predicted prefill seconds there.

        Prefix-aware: the engine where it would finish first, its queued work plus its
        prefill past that engine's GPU hit (a pure longest-prefix rule sends every
        request sharing a system prompt to one engine).
        """
        cost, n, bt = self.config.engine, request.input_tokens, self.config.block_tokens
        if self.config.routing is Routing.ROUND_ROBIN:
            engine = self.engines[self._next_engine]
            self._next_engine = (self._next_engine + 1) % len(self.engines)
            return engine, cost.prefill_s(hit_tokens(n, engine.gpu.match(request.blocks), bt), n)
        best, best_s, best_finish_s = self.engines[0], 0.0, float("inf")
        seconds: dict[int, float] = {}  # Per GPU hit: most engines share one (often none).
        blocks = request.blocks
        for engine in self.engines:
            held = engine.gpu.match(blocks)
            prefill_s = seconds.get(held)
            if prefill_s is None:
                prefill_s = seconds[held] = cost.prefill_s(hit_tokens(n, held, bt), n)
            finish_s = engine.pending_s + prefill_s
            if finish_s < best_finish_s:
                best, best_s, best_finish_s = engine, prefill_s, finish_s
        return best, best_s

    def _hit_ends(self, request: Request, engine: _Engine) -> tuple[int, int, int]:
        """Where the prompt's hits end: on the GPU, then also in RAM, then also on the card
        (tokens, each within kvharbor's hit bound)."""
        blocks, n, bt = request.blocks, request.input_tokens, self.config.block_tokens
        ram, card = self.ram, self.card
        g = engine.gpu.match(blocks)
        r = g + (ram.match(blocks[g:]) if ram is not None else 0)
        c = r
        for block in blocks[r:]:  # A block in either tier continues the prefix.
            if (card is not None and block in card) or (ram is not None and block in ram):
                c += 1
            else:
                break
        return hit_tokens(n, g, bt), hit_tokens(n, r, bt), hit_tokens(n, c, bt)

    def _chunks(self, start: int, end: int) -> int:
        """The stored blocks a load of tokens ``start .. end`` touches."""
        bt = self.config.block_tokens
        return -(-end // bt) - start // bt

    def _worth_loading(self, engine: _Engine, start: int, end: int, read_back_tokens: int) -> bool:
        """The connector's choice for tokens ``start .. end``, the last ``read_back_tokens``
        of them read back from the card first."""
        read_back_bytes = read_back_tokens * self.config.engine.kv_bytes_per_token
        return engine.planner.choose(start, end, self._chunks(start, end), read_back_bytes).load

    def _read_back_s(self, nbytes: int) -> float:
        """Reading ``nbytes`` of the card back into RAM, queued on the card's channels."""
        if not nbytes:
            return 0.0
        params, now = self.config.card, self.env.now
        return self.channels.complete_at(now, nbytes, params.channel_read_bytes_per_s, params.read_latency_s) - now

    def _store(self, request: Request, engine: _Engine) -> None:
        whole = stored_blocks(request.input_tokens, request.blocks, self.config.block_tokens)
        engine.gpu.use(whole)
        if self.ram is not None:
            self.ram.use(whole)
        if self.card is not None:
            new = self.card.use(whole)
            if new:  # Written behind the request: it books the card's channels, nobody waits.
                params = self.config.card
                self.channels.complete_at(
                    self.env.now, new * self.block_bytes, params.channel_write_bytes_per_s, params.write_latency_s
                )

    def _sample(self) -> None:
        engines = self.engines
        used = {Tier.GPU: sum(len(e.gpu) / e.gpu.capacity_blocks for e in engines) / len(engines)}
        evictions = {Tier.GPU: sum(e.gpu.evictions for e in engines)}
        for tier, cache in ((Tier.RAM, self.ram), (Tier.CARD, self.card)):
            if cache is not None:
                used[tier] = len(cache) / cache.capacity_blocks
                evictions[tier] = cache.evictions
        self.fill.append(FillSample(self.env.now, used, evictions))


def run_fleet(
    config: FleetConfig,
    requests: Iterable[Request],
    requests_total: int,
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Simulate ``requests`` (in arrival order; an iterator is read lazily) on the fleet.
    ``requests_total``: how many there are, to space the fill samples."""
    fleet = _Fleet(config, requests_total, progress)
    for engine in fleet.engines:
        fleet.env.process(fleet.engine_loop(engine))
    fleet.env.process(fleet.arrivals(iter(requests)))
    fleet.env.run()
    if not fleet.ttft:
        raise PlanInputError("the workload holds no request")
    fleet._sample()
    ttft = array("d", sorted(fleet.ttft))
    return FleetResult(
        requests=len(ttft),
        prompt_tokens=fleet.prompt_tokens,
        hit_tokens=fleet.hits,
        ttft_s=ttft,
        prefill_gpu_s=fleet.prefill_gpu_s,
        prefill_gpu_s_without_cache=fleet.cold_gpu_s,
        chose_load=fleet.chose_load,
        chose_recompute=fleet.chose_recompute,
        fill=tuple(fleet.fill),
    )
