"""One global cache per capacity: the hit-rate curve, and the smallest size reaching a target.

Each capacity is a cache of that many tokens (whole blocks) that every request of
the workload shares, as one gateway's tiers serve every engine of a host. The
token hit rate is hit prompt tokens over all prompt tokens, a hit bounded as
kvharbor bounds it (`kvharbor.sim.caches.hit_tokens`).

``lru`` sweeps share one pass (`kvharbor.sim.stack`); other policies replay the
workload once per capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvharbor.sim.caches import Policy, hit_tokens, make_cache, stored_blocks
from kvharbor.sim.errors import PlanInputError
from kvharbor.sim.stack import lru_hit_tokens
from kvharbor.sim.workload import Request

Progress = Callable[[int], None]
"""Called with the requests replayed so far (over all passes)."""


@dataclass(frozen=True, slots=True)
class CapacityResult:
    capacity_tokens: int
    capacity_blocks: int
    hit_tokens: int
    prompt_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def capacity_blocks(capacity_tokens: float, block_tokens: int) -> int:
    """Whole blocks in ``capacity_tokens``; refuses a capacity below one block."""
    if not capacity_tokens > 0:
        raise PlanInputError(f"--capacity-tokens: a capacity must be > 0 (got {capacity_tokens:g})")
    blocks = int(capacity_tokens // block_tokens)
    if blocks < 1:
        raise PlanInputError(
            f"--capacity-tokens: {capacity_tokens:g} tokens is less than one block of --block-tokens {block_tokens}"
        )
    return blocks


def passes(policy: Policy, capacities: int) -> int:
    """How many replays of the workload a sweep of ``capacities`` takes."""
    return 1 if policy is Policy.LRU else capacities


def sweep(
    requests: Sequence[Request],
    capacities_tokens: Sequence[float],
    block_tokens: int,
    policy: Policy,
    progress: Progress | None = None,
) -> list[CapacityResult]:
    """The result of one global cache per capacity, in the order given."""
    blocks = [capacity_blocks(c, block_tokens) for c in capacities_tokens]
    prompt = sum(r.input_tokens for r in requests)
    if policy is Policy.LRU:
        hits = lru_hit_tokens(requests, blocks, block_tokens, progress)
    else:
        hits = [
            replay(requests, policy, b, block_tokens, _offset(progress, n * len(requests)))
            for n, b in enumerate(blocks)
        ]
    return [CapacityResult(int(c), b, h, prompt) for c, b, h in zip(capacities_tokens, blocks, hits, strict=True)]


def replay(
    requests: Sequence[Request],
    policy: Policy,
    capacity_blocks: int,
    block_tokens: int,
    progress: Progress | None = None,
) -> int:
    """Prompt tokens hit replaying ``requests`` through one cache of ``policy``."""
    cache = make_cache(policy, capacity_blocks)
    hits = 0
    for done, request in enumerate(requests, start=1):
        hits += hit_tokens(request.input_tokens, cache.match(request.blocks), block_tokens)
        cache.use(stored_blocks(request.input_tokens, request.blocks, block_tokens))
        if progress is not None:
            progress(done)
    return hits


def smallest_reaching(results: Sequence[CapacityResult], target: float) -> CapacityResult | None:
    """The smallest capacity whose token hit rate is at least ``target``, or None."""
    reaching = [r for r in results if r.token_hit_rate >= target]
    return min(reaching, key=lambda r: r.capacity_tokens) if reaching else None


def _offset(progress: Progress | None, before: int) -> Progress | None:
    if progress is None:
        return None
    return lambda done: progress(before + done)
