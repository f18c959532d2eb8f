"""What the scheduler tells the workers each step: which chunks to load and to save.

Built once per step by the scheduler half and delivered to every worker
(pickled across processes), so it holds only plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class ChunkTransfer:
    """Consecutive chunks of one request and the blocks that hold them.

    ``keys[rank][i]`` names chunk i of this transfer for that rank;
    ``block_ids[group]`` lists the blocks of those chunks in order, ``blocks_per_chunk``
    to a chunk, for every KV cache group (`chunks.GroupBlocks`). A load may cover only
    part of its first chunk (blocks vLLM's own prefix cache already filled:
    ``skip_blocks``) and of its last (a load stops one token short of the prompt so
    vLLM computes the last position).
    """

    request_id: str
    keys: Sequence[Sequence[bytes]]
    block_ids: Sequence[Sequence[int]]
    skip_blocks: int = 0
    recompute_s: tuple[float, ...] = ()
    """Loads: the scheduler's estimate of each chunk's recompute time (empty: unknown);
    the worker stops a load whose rest would arrive slower than it recomputes."""
    asynchronous: bool = False
    """Loads: vLLM holds the request back until the load is reported (its asynchronous loads,
    ``WAITING_FOR_REMOTE_KVS``), and a load that fell short is reported by request
    (``failed_recving``): vLLM recomputes the request then, also for a model with several
    KV cache groups, where failed blocks would stop it (`compat.reports_failed_loads`)."""
    state: ChunkTransfer | None = None
    """A hybrid model's Mamba-type state at the end of this transfer's last chunk: one key
    per rank, one block per Mamba-type group. A load restores it first and its chunks only
    if it was restored (a restore ends at its state, or does not happen); a save stores it
    beside its chunks. None for other models, and for saves whose step ended off a chunk end."""

    def __post_init__(self) -> None:
        assert self.keys and all(len(k) == len(self.keys[0]) for k in self.keys), "one key list per rank"
        assert self.skip_blocks >= 0, self.skip_blocks
        assert self.block_ids and all(len(ids) == len(self.block_ids[0]) for ids in self.block_ids), (
            "one block list per group, all of one length")  # fmt: skip

    @property
    def chunks(self) -> int:
        return len(self.keys[0])

    @property
    def blocks(self) -> int:
        """Block positions of the transfer (each group holds as many)."""
        return len(self.block_ids[0])


@dataclass
class KVHarborMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)
    """Requests whose answer is complete after this step by their length limit (its last
    token, ``max_tokens``, comes out of it): their saves not yet in shared memory land before
    the step returns (`EngineSection.saves_land_before_answer`). An answer that ends early,
    at a stop token or string, is not known here."""
    step_flops: float = 0.0
    """Prefill FLOPs of this step when it loads nothing (0: not a prefill sample);
    workers time the forward pass and report FLOPs per second back."""
    cache_off: str = ""
    """Set in one step, the first the scheduler builds after it learned that the
    external cache is off somewhere (a worker's stats, or its own link): why.
    Every worker then turns its own off in this step, together
    (`kvharbor.connector.ranks`)."""
