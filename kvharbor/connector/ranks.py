"""The tensor-parallel ranks of one engine agree on what a step restored, and on whether the cache is on.

Each rank restores and stores its own shard of every chunk over its own
gateway link, and links fail one at a time (a connection hung up, a client
refused). vLLM already makes *loads* consistent: it unions the ranks' load
errors (``KVOutputAggregator`` ORs ``invalid_block_ids``) and the scheduler
truncates the request's computed tokens at the first failed block, so a
block that one rank could not restore is recomputed on every rank, over any
rank's restored copy. What vLLM cannot undo is a *save* in the same step: the
chunks a step computes behind a restore that fell short on some rank attend
to blocks that rank never filled, and the forward pass's all-reduce spreads
that into every rank's KV. A rank that saved them would store wrong KV under
the right key, and a later lookup (which needs every rank's shard) would
restore it once the failed rank stored its own.

The guarantee, for the ranks of one tensor-parallel group, in every step that
restores something or that the scheduler marks ``cache_off``:

- every rank reports the same blocks as load errors: those past the shortest
  restore any rank made of each transfer, so vLLM recomputes exactly those,
  on every rank;
- no rank saves, in that step, a chunk of a request whose restore fell short
  on any rank;
- once the cache is off on one rank it is off on every rank, each saying
  which rank turned it off first and why.

Between such steps a rank whose link failed is off alone: its next restore
fails (so the next restoring step agrees), and what the other ranks save
meanwhile is correct KV, never read (a lookup needs every rank's shard). The
scheduler stops planning restores when a worker reports the cache off and
marks the next step it builds ``cache_off``, which ends that window.

The agreement is one all-reduce (minimum) of a few integers over the group's
CPU group, plus one all-gather of the ranks' reasons the first time some rank
is off. It is a collective: every rank calls `RankAgreement.agree` in exactly
the same steps, decided from the step's metadata alone, which every rank
receives identically. Pipeline stages are not covered: a stage gets its input
only after the stage before it has run, so a collective across stages inside
a step would deadlock; each stage agrees within its own tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from kvharbor.connector.link import RankSwitch, say_off


class RankGroup(Protocol):
    """The ranks that agree, seen from one of them."""

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum over the group; every rank passes as many values."""
        ...

    def gather(self, text: str) -> list[str]:
        """Every rank's ``text``, by rank."""
        ...


class SoleRank:
    """A group of one (no tensor parallelism): agreeing is a no-op."""

    size = 1
    rank = 0

    def min(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def gather(self, text: str) -> list[str]:
        return [text]


class TorchRankGroup:
    """A ``torch.distributed`` process group: the engine's tensor-parallel CPU (gloo) group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def min(self, values: Sequence[int]) -> list[int]:
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        return [int(v) for v in tensor.tolist()]

    def gather(self, text: str) -> list[str]:
        texts: list[object] = [None] * self.size
        dist.all_gather_object(texts, text, group=self._group)
        return [str(t) for t in texts]


class RankAgreement:
    """One rank's side of the per-step agreement (see the module docstring)."""

    def __init__(self, group: RankGroup, switch: RankSwitch) -> None:
        if not 0 <= group.rank < group.size:
            raise ValueError(f"rank {group.rank} is not in a group of {group.size}")
        self.group = group
        self.switch = switch
        """This rank's switch: what it reports, and what the agreement turns off."""
        self._off_agreed = False
        """Some rank was seen off: set in the same step on every rank (they all see the same minimum)."""

    def agree(self, restored_blocks: Sequence[int]) -> list[int]:
        """Per transfer of the step, the blocks every rank restored (this rank's are
        ``restored_blocks``); turns the cache off here when it is off on any rank.

        A collective: every rank of the group calls it in the same steps, with one
        value per transfer of the step.
        """
        size, rank = self.group.size, self.group.rank
        on = [1] * size  # The neutral value of a minimum: each rank speaks only for itself.
        on[rank] = int(not self.switch.is_off)
        agreed = self.group.min([*on, *restored_blocks])
        off = [r for r in range(size) if not agreed[r]]
        if off and not self._off_agreed:
            self._off_agreed = True
            reasons = self.group.gather(self.switch.reason)
            first = off[0]  # Ranks seen off in one step failed "at once": the lowest is named.
            reason = f"rank {first} of {size} turned it off first ({reasons[first]}); every rank follows"
            if self.switch.turn_off(reason):
                say_off(reason)
        return agreed[size:]
