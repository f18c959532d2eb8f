"""Block caches, and the hit a prompt gets from one.

A cache holds block ids up to ``capacity_blocks``. Requests use it in two steps,
as the engine and the gateway do: `match` asks how many leading blocks of a
prompt it holds (changing nothing), and once the prompt is computed `use` records
that every whole block of it was used: held ones are refreshed, the others
stored. `use` goes tail-first, so a prompt's head is the most recent and is
evicted last (evicting block 0 first would leave every later block unreachable;
the gateway's `touch` and vLLM's free queue order blocks the same way).

Policies (``--policy``):

- ``lru``: least recently used first; a stack algorithm, so `kvharbor.sim.stack`
  gives every capacity's hit rate in one pass;
- ``slru``: segmented LRU. A block enters on probation and is protected once it
  is used again; eviction takes the least recent probation block first, and the
  protected segment is capped at ``PROTECTED_SHARE`` of the capacity (its least
  recent block goes back on probation). The ATC'25 study of a cloud provider's
  KV cache ("KVCache Cache in the Wild") found most blocks never reused and a
  block's reuse probability rising with reuses seen; this keeps one-shot suffixes
  from pushing reused prefixes out. Not a stack algorithm: one pass per capacity.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvharbor.cache.keys import max_hit_tokens
from kvharbor.sim.errors import PlanInputError

PROTECTED_SHARE = 0.8
"""``slru``: the most of the capacity blocks used twice or more may hold."""


class Policy(enum.Enum):
    LRU = "lru"
    SLRU = "slru"

    @classmethod
    def parse(cls, name: str) -> Policy:
        try:
            return cls(name.lower())
        except ValueError:
            raise PlanInputError(
                f"--policy: unknown policy {name!r}; known: {', '.join(p.value for p in cls)}"
            ) from None


class BlockCache(Protocol):
    capacity_blocks: int
    evictions: int

    def __len__(self) -> int: ...

    def __contains__(self, block: object) -> bool: ...

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading ``blocks`` are held; changes nothing."""
        ...

    def use(self, blocks: Sequence[int]) -> int:
        """Record that ``blocks`` were used (tail-first); returns how many were stored anew."""
        ...


def _leading(held: OrderedDict[int, None], blocks: Sequence[int]) -> int:
    for count, block in enumerate(blocks):
        if block not in held:
            return count
    return len(blocks)


def _check_capacity(capacity_blocks: int) -> None:
    if capacity_blocks <= 0:
        raise PlanInputError(f"a cache needs a capacity of at least one block (got {capacity_blocks})")


class LruCache:
    def __init__(self, capacity_blocks: int) -> None:
        _check_capacity(capacity_blocks)
        self.capacity_blocks = capacity_blocks
        self.evictions = 0
        self._held: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block: object) -> bool:
        return block in self._held

    def match(self, blocks: Sequence[int]) -> int:
        return _leading(self._held, blocks)

    def use(self, blocks: Sequence[int]) -> int:
        held, stored = self._held, 0
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
                stored += 1
        excess = len(held) - self.capacity_blocks
        for _ in range(max(excess, 0)):
            held.popitem(last=False)
        self.evictions += max(excess, 0)
        return stored


class SlruCache:
    def __init__(self, capacity_blocks: int, protected_share: float = PROTECTED_SHARE) -> None:
        _check_capacity(capacity_blocks)
        if not 0 < protected_share < 1:
            raise PlanInputError(f"protected_share: must be between 0 and 1 (got {protected_share})")
        self.capacity_blocks = capacity_blocks
        self.evictions = 0
        self._protected_max = max(1, int(capacity_blocks * protected_share))
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, block: object) -> bool:
        return block in self._protected or block in self._probation

    def match(self, blocks: Sequence[int]) -> int:
        for count, block in enumerate(blocks):
            if block not in self._protected and block not in self._probation:
                return count
        return len(blocks)

    def use(self, blocks: Sequence[int]) -> int:
        probation, protected, stored = self._probation, self._protected, 0
        for block in reversed(blocks):
            if block in protected:
                protected.move_to_end(block)
            elif block in probation:
                del probation[block]
                protected[block] = None
            else:
                probation[block] = None
                stored += 1
        while len(protected) > self._protected_max:  # Demoted: the most recent on probation.
            block, _ = protected.popitem(last=False)
            probation[block] = None
        while len(probation) + len(protected) > self.capacity_blocks:
            (probation if probation else protected).popitem(last=False)
            self.evictions += 1
        return stored


def make_cache(policy: Policy, capacity_blocks: int) -> BlockCache:
    return LruCache(capacity_blocks) if policy is Policy.LRU else SlruCache(capacity_blocks)


def stored_blocks(input_tokens: int, blocks: Sequence[int], block_tokens: int) -> Sequence[int]:
    """The blocks of a prompt a cache stores: whole ones only (a partial last block is
    recomputed every time, as kvharbor stores whole chunks only)."""
    return blocks[: input_tokens // block_tokens]


def hit_tokens(input_tokens: int, hit_blocks: int, block_tokens: int) -> int:
    """Prompt tokens ``hit_blocks`` leading blocks save, within kvharbor's hit bound
    floor(N / chunk) x chunk (`kvharbor.cache.keys.max_hit_tokens`)."""
    return min(hit_blocks * block_tokens, max_hit_tokens(input_tokens, block_tokens))
