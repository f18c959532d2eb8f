"""A trace replayed against an OpenAI-compatible server: the workload, the client, the figures.

`bench/serve.py` runs it once per mode. The pieces, each usable alone:

- `Workload`: a slice of a Mooncake-format trace (`kvharbor.sim.workload.read_trace`,
  which refuses a malformed line naming it) scaled to the model: each 512-token block
  of the trace becomes ``block_tokens`` tokens, so its ``hash_ids`` keep their meaning
  (equal ids are equal token blocks, prefix-chained) and the trace's reuse is the
  prompts' reuse; prompts are cut to ``max_input_tokens``, answers scaled and capped.
  Arrivals are the trace's, squeezed or stretched to a mean rate (open loop), or
  ignored by a fixed number of clients (closed loop). `Workload.to_trace` writes the
  scaled slice back in the trace's format, for ``kvharbor plan``.
- `replay`: streams each request (``/v1/completions`` with token ids, greedy, the
  answer's length fixed by ``ignore_eos``) with httpx, timing the first token as a
  user sees it and every token after; `Outcome` is one request's record.
- `summary` and `windows`: requests per second, output tokens per second, TTFT and
  time-per-output-token percentiles, hit rates; and the same per window of trace time.

Never asserts on time: it measures.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvharbor.sim.workload import Request, read_trace

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""
FIRST_TOKEN_ID = 4
"""Prompt tokens are drawn from ``[FIRST_TOKEN_ID, vocab)``: below it sit the tiny model's
special tokens (unk, bos, eos, pad), which a prompt of ids must not hold."""


class ReplayError(ValueError):
    """A replay that cannot run as asked; the message names the flag or the file."""


@dataclass(frozen=True, slots=True)
class Shape:
    """How a trace's requests are fitted to the model under test."""

    block_tokens: int
    """Tokens per trace block once scaled (the trace's are `TRACE_BLOCK_TOKENS`)."""
    max_input_tokens: int
    """Longest prompt: the model's context less the answer's room."""
    output_scale: float = 1.0
    output_tokens_max: int = 1 << 30
    vocab: int = 4096

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ReplayError(f"--block-tokens: must be > 0 (got {self.block_tokens})")
        if self.max_input_tokens < self.block_tokens:
            raise ReplayError(
                f"--max-input-tokens {self.max_input_tokens}: must hold at least one block "
                f"(--block-tokens {self.block_tokens})"
            )
        if not self.output_scale > 0:
            raise ReplayError(f"--output-scale: must be > 0 (got {self.output_scale})")
        if self.output_tokens_max < 1:
            raise ReplayError(f"--output-tokens-max: must be >= 1 (got {self.output_tokens_max})")
        if self.vocab <= FIRST_TOKEN_ID:
            raise ReplayError(f"the model's vocabulary ({self.vocab}) leaves no ordinary token")

    def fit(self, request: Request) -> Request:
        """``request`` in this shape: its prompt scaled and cut (its blocks with it), its answer scaled."""
        tokens = -(-request.input_tokens * self.block_tokens // TRACE_BLOCK_TOKENS)
        tokens = max(1, min(tokens, self.max_input_tokens))
        blocks = request.blocks[: -(-tokens // self.block_tokens)]
        output = max(1, min(self.output_tokens_max, round(request.output_tokens * self.output_scale)))
        return Request(request.arrival_s, tokens, output, blocks)


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests of one replay, in arrival order (arrival times in seconds from the first)."""

    requests: tuple[Request, ...]
    shape: Shape
    seed: int = 0

    @classmethod
    def from_trace(
        cls, path: Path, shape: Shape, count: int, start: int = 0, rate_per_s: float | None = None, seed: int = 0
    ) -> Workload:
        """``count`` requests of the trace at ``path`` from its ``start``-th on, fitted to
        ``shape``; ``rate_per_s``: arrivals rescaled to that mean rate (None: the trace's own)."""
        if count <= 0:
            raise ReplayError(f"--requests: must be > 0 (got {count})")
        if start < 0:
            raise ReplayError(f"--start: must be >= 0 (got {start})")
        if rate_per_s is not None and not (rate_per_s > 0 and math.isfinite(rate_per_s)):
            raise ReplayError(f"--rate: must be a number of requests per second > 0 (got {rate_per_s})")
        trace = read_trace(path, TRACE_BLOCK_TOKENS)
        picked = trace[start : start + count]
        if len(picked) < count:
            raise ReplayError(
                f"trace {path}: holds {len(trace)} requests, --start {start} --requests {count} asks more"
            )
        origin = picked[0].arrival_s
        span_s = picked[-1].arrival_s - origin
        # The slice's mean rate is (count - 1) arrivals over its span; a span of 0 (all at
        # once) has no rate to rescale, so its requests arrive 1 / rate apart.
        stretch = (count - 1) / rate_per_s / span_s if rate_per_s is not None and span_s > 0 else 1.0
        requests = []
        for index, request in enumerate(picked):
            if rate_per_s is not None and span_s == 0:
                arrival = index / rate_per_s
            else:
                arrival = (request.arrival_s - origin) * stretch
            requests.append(shape.fit(request._replace(arrival_s=arrival)))
        return cls(tuple(requests), shape, seed)

    def prompt(self, request: Request) -> list[int]:
        """The token ids of ``request``'s prompt: block id ``b`` is always the same
        ``block_tokens`` ids (drawn from a generator seeded by the seed and ``b``)."""
        ids: list[int] = []
        for block in request.blocks:
            ids.extend(self._block(block))
        return ids[: request.input_tokens]

    def _block(self, block: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{block}")
        return [rng.randrange(FIRST_TOKEN_ID, self.shape.vocab) for _ in range(self.shape.block_tokens)]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    def to_trace(self, path: Path) -> None:
        """The scaled slice in the trace's own format (``hash_ids`` per ``block_tokens``)."""
        with path.open("w") as out:
            for request in self.requests:
                record = {
                    "timestamp": round(request.arrival_s * 1000.0, 3),
                    "input_length": request.input_tokens,
                    "output_length": request.output_tokens,
                    "hash_ids": list(request.blocks),
                }
                out.write(json.dumps(record) + "\n")


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    index: int
    phase: int
    """0, or 1 for a request after the engine's restart."""
    arrival_s: float
    """When the trace has it arrive, in seconds of the phase's clock."""
    prompt_tokens: int
    output_tokens_asked: int
    sent_s: float = math.nan
    """When it was sent, in seconds from the replay's start."""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not math.isnan(self.ttft_s)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for an answer of one token)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass(frozen=True, slots=True)
class Client:
    """Where and how requests are sent."""

    url: str
    model: str
    timeout_s: float
    """Bound on one request, from sending it to its last token."""
    clients: int | None = None
    """Closed loop: this many requests in flight, each sent when one ends (None: open loop)."""
    salt: str | None = None


async def replay(
    workload: Workload, requests: Sequence[int], client: Client, phase: int, clock_start_s: float
) -> list[Outcome]:
    """Send ``workload``'s requests at those indices (arrival times from the first of
    them on, or in a closed loop) and return their outcomes in index order. A request
    that fails is recorded with its error; the replay goes on."""
    import httpx

    chosen = [workload.requests[i] for i in requests]
    origin = chosen[0].arrival_s if chosen else 0.0
    outcomes = [
        Outcome(i, phase, r.arrival_s - origin, r.input_tokens, r.output_tokens)
        for i, r in zip(requests, chosen, strict=True)
    ]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=client.url, timeout=client.timeout_s, limits=limits) as http:
        started = time.perf_counter()

        async def one(outcome: Outcome, request: Request) -> None:
            await _stream(http, client, workload.prompt(request), outcome, started, clock_start_s)

        if client.clients is None:

            async def at_arrival(outcome: Outcome, request: Request) -> None:
                await asyncio.sleep(max(0.0, outcome.arrival_s - (time.perf_counter() - started)))
                await one(outcome, request)

            await asyncio.gather(*(at_arrival(o, r) for o, r in zip(outcomes, chosen, strict=True)))
        else:
            queue: Iterator[tuple[Outcome, Request]] = iter(zip(outcomes, chosen, strict=True))

            async def worker() -> None:
                for outcome, request in queue:  # One shared iterator: each request is taken once.
                    await one(outcome, request)

            await asyncio.gather(*(worker() for _ in range(client.clients)))
    return outcomes


async def _stream(
    http: Any, client: Client, prompt: list[int], outcome: Outcome, started: float, clock_start_s: float
) -> None:
    body: dict[str, Any] = {
        "model": client.model,
        "prompt": prompt,
        "max_tokens": outcome.output_tokens_asked,
        "min_tokens": outcome.output_tokens_asked,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if client.salt is not None:
        body["cache_salt"] = client.salt
    sent = time.perf_counter()
    outcome.sent_s = sent - started + clock_start_s
    usage: dict[str, Any] = {}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                text = (await answer.aread()).decode(errors="replace")
                outcome.error = f"HTTP {answer.status_code}: {text[:200]}"
                return
            async for line in answer.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("choices") and math.isnan(outcome.ttft_s):
                    outcome.ttft_s = time.perf_counter() - sent
                usage = event.get("usage") or usage
    except Exception as err:  # The replay goes on: a failed request is a figure, not a crash.
        outcome.error = f"{type(err).__name__}: {err}"[:300]
        return
    outcome.e2e_s = time.perf_counter() - sent
    outcome.output_tokens = int(usage.get("completion_tokens") or 0)
    outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if int(usage.get("prompt_tokens") or outcome.prompt_tokens) != outcome.prompt_tokens:
        outcome.error = f"the server counted {usage.get('prompt_tokens')} prompt tokens, {outcome.prompt_tokens} sent"


# -- figures ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None of no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    failed: int
    duration_s: float
    """From the first request sent to the last answer's end (restarts' downtime excluded)."""
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    errors: list[str] = field(default_factory=list)
    """The first few distinct errors."""


def summary(outcomes: Sequence[Outcome], active_s: float) -> Summary:
    """The figures of a replay whose engines served for ``active_s`` seconds in all."""
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok]
    tpots = [t for o in ok if (t := o.tpot_s) is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    errors = sorted({o.error for o in outcomes if o.error is not None})[:5]
    return Summary(
        requests=len(outcomes),
        failed=len(outcomes) - len(ok),
        duration_s=round(active_s, 3),
        requests_per_s=round(len(ok) / active_s, 4) if active_s > 0 else 0.0,
        output_tokens_per_s=round(sum(o.output_tokens for o in ok) / active_s, 2) if active_s > 0 else 0.0,
        ttft_ms={f"p{q}": _ms(percentile(ttfts, q)) for q in (50, 90, 99)},
        tpot_ms={f"p{q}": _ms(percentile(tpots, q)) for q in (50, 99)},
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=round(cached / prompt, 4) if prompt else 0.0,
        errors=errors,
    )


def windows(outcomes: Sequence[Outcome], window_s: float) -> list[dict[str, Any]]:
    """Per phase, per ``window_s`` of its clock (by when each request was sent): requests,
    token hit rate and TTFT p50."""
    if window_s <= 0:
        raise ReplayError(f"--window-s: must be > 0 (got {window_s})")
    found: dict[tuple[int, int], list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.ok:
            found.setdefault((outcome.phase, int(outcome.sent_s // window_s)), []).append(outcome)
    rows = []
    for (phase, index), members in sorted(found.items()):
        prompt = sum(o.prompt_tokens for o in members)
        rows.append(
            {
                "phase": "before" if phase == 0 else "after",
                "from_s": round(index * window_s, 1),
                "requests": len(members),
                "hit_rate": round(sum(o.cached_tokens for o in members) / prompt, 4) if prompt else 0.0,
                "ttft_p50_ms": _ms(statistics.median(o.ttft_s for o in members)),
            }
        )
    return rows


def reuse_from_before(workload: Workload, outcomes: Sequence[Outcome]) -> dict[str, int]:
    """What the requests after a restart could have hit only from what was stored before it.

    For each request of phase 1, its leading whole blocks that some request had sent
    before it (the longest prefix any cache could hold), less those that phase-1 requests
    before it had sent (the longest prefix the restarted engine's own GPU cache could
    hold): ``reusable_tokens`` sums what is left, which only a cache that outlived the
    restart can serve, and ``hit_tokens`` the part of each request's cached tokens
    beyond its GPU-possible prefix, up to that."""
    sent: set[int] = set()
    after: set[int] = set()
    reusable = hit = 0
    block = workload.shape.block_tokens
    for outcome in sorted(outcomes, key=lambda o: (o.phase, o.sent_s)):
        request = workload.requests[outcome.index]
        whole = request.blocks[: request.input_tokens // block]
        seen, local = _leading(whole, sent), _leading(whole, after)
        sent.update(request.blocks)
        if outcome.phase == 0:
            continue
        after.update(request.blocks)
        if seen > local and outcome.ok:
            reusable += (seen - local) * block
            hit += max(0, min(outcome.cached_tokens, seen * block) - local * block)
    return {"reusable_tokens": reusable, "hit_tokens": hit}


def _leading(blocks: Sequence[int], held: set[int]) -> int:
    count = 0
    for block in blocks:
        if block not in held:
            break
        count += 1
    return count
