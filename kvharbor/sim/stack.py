"""Every LRU capacity's hits in one pass, from stack distances (Mattson et al., 1970).

An LRU cache of C blocks holds exactly the C most recently used distinct
blocks, whatever C, because the sequence of uses does not depend on C (every
block of a prompt is used, hit or stored: `kvharbor.sim.caches.LruCache.use`).
So a block asked for is held by every cache larger than its *stack distance*:
the number of distinct other blocks used since its own last use. A prompt's
leading block j is a hit for capacity C when blocks 0..j all are, i.e. when
C exceeds the largest distance among them.

Distances are taken when the request arrives, before any of its own uses (as
`match` sees the cache), by a Fenwick tree over use positions that marks each
block's latest use: the distinct blocks used after position p are the marks
after p, that is all marks (one per distinct block) less the marks up to p.
Uses then follow tail-first, as `LruCache.use` makes them. O(log n) per block.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from kvharbor.sim.caches import hit_tokens, stored_blocks
from kvharbor.sim.workload import Request


class _Fenwick:
    """Prefix sums over positions 1..size, each +1 or -1."""

    def __init__(self, size: int) -> None:
        self._tree = [0] * (size + 1)

    def add(self, position: int, delta: int) -> None:
        tree, size = self._tree, len(self._tree)
        while position < size:
            tree[position] += delta
            position += position & -position

    def prefix(self, position: int) -> int:
        tree, total = self._tree, 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total


def lru_hit_tokens(
    requests: Sequence[Request],
    capacities_blocks: Sequence[int],
    block_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> list[int]:
    """Per capacity (in blocks, any order), the prompt tokens an LRU cache of that many
    blocks hits over ``requests``; the same as replaying each capacity through
    `LruCache`, in one pass. ``progress``: called with the requests done so far."""
    order = sorted(range(len(capacities_blocks)), key=lambda i: capacities_blocks[i])
    ascending = [capacities_blocks[i] for i in order]
    hits_sorted = [0] * len(ascending)
    uses = sum(len(stored_blocks(r.input_tokens, r.blocks, block_tokens)) for r in requests)
    marks = _Fenwick(uses)
    last: dict[int, int] = {}
    position = 0
    for done, request in enumerate(requests, start=1):
        distinct = len(last)
        # The capacity each leading block needs to be a hit, with every block before it.
        needs: list[int] = []
        for block in request.blocks:
            previous = last.get(block)
            if previous is None:
                break
            distance = distinct - marks.prefix(previous)
            needs.append(max(distance + 1, needs[-1]) if needs else distance + 1)
        if needs:
            for i, capacity in enumerate(ascending):
                held = bisect.bisect_right(needs, capacity)
                if held:
                    hits_sorted[i] += hit_tokens(request.input_tokens, held, block_tokens)
        for block in reversed(stored_blocks(request.input_tokens, request.blocks, block_tokens)):
            position += 1
            previous = last.get(block)
            if previous is not None:
                marks.add(previous, -1)
            marks.add(position, 1)
            last[block] = position
        if progress is not None:
            progress(done)
    hits = [0] * len(ascending)
    for rank, i in enumerate(order):
        hits[i] = hits_sorted[rank]
    return hits
