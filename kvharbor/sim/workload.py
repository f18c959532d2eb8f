"""Requests: read from a trace or made by a generator.

A request is what the planner needs of it: when it arrives, how long its prompt
and its answer are, and the ids of its prompt's blocks, prefix-chained (block i's
id stands for the whole prefix up to the end of block i, so equal ids mean
reusable KV, as kvharbor's chunk keys do). A prompt of N tokens has
ceil(N / block_tokens) ids; the last block may be partial.

Traces are JSON lines in the Mooncake format (FAST'25, ``conversation_trace.jsonl``)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``timestamp`` in milliseconds from the start, never decreasing. `read_trace` reads
the whole file or refuses it with `TraceError` naming the line: a trace is never
half-read.

Generators (`system_prompts`, `multi_turn_chat`, `rag_documents`) yield requests
lazily, so a million-request run holds only the requests in flight; each takes a
frozen parameter set with the defaults documented there and a seed.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvharbor.sim.errors import PlanInputError


class Request(NamedTuple):
    """One request. A named tuple: a million of them are made in a fleet run."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    """Prefix-chained block ids, ceil(input_tokens / block_tokens) of them."""


class TraceError(PlanInputError):
    """A trace that cannot be used; the message names the file and the line."""


TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_trace(path: str | Path, block_tokens: int) -> list[Request]:
    """Every request of a Mooncake-format trace, checked line by line.

    Raises `TraceError` naming the line for: a line that is not a JSON object,
    a missing or extra field, a field of the wrong type, a negative length, a
    timestamp below the previous one, a ``hash_ids`` list whose length is not
    ceil(input_length / block_tokens) (a trace made with another block size);
    and for an empty trace or a file that cannot be read.
    """
    if block_tokens <= 0:
        raise PlanInputError(f"--block-tokens: must be > 0 (got {block_tokens})")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise TraceError(f"trace {path}: cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise TraceError(f"trace {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    requests: list[Request] = []
    previous_ms = -math.inf
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        request = _parse_line(line, block_tokens, f"trace {path}: line {number}")
        if request.arrival_s * 1000.0 < previous_ms:
            raise TraceError(
                f"trace {path}: line {number}: timestamp {request.arrival_s * 1000.0:g} ms is before the "
                f"previous line's {previous_ms:g} ms (timestamps must not decrease)"
            )
        previous_ms = request.arrival_s * 1000.0
        requests.append(request)
    if not requests:
        raise TraceError(f"trace {path}: holds no request")
    return requests


def _parse_line(line: str, block_tokens: int, where: str) -> Request:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: must be a JSON object with {', '.join(TRACE_FIELDS)}")
    missing = [name for name in TRACE_FIELDS if name not in record]
    if missing:
        raise TraceError(f"{where}: missing field {missing[0]!r}")
    extra = sorted(set(record) - set(TRACE_FIELDS))
    if extra:
        raise TraceError(f"{where}: unknown field {extra[0]!r}; known: {', '.join(TRACE_FIELDS)}")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
        raise TraceError(f"{where}: timestamp must be a number of milliseconds (got {timestamp!r})")
    if timestamp < 0:
        raise TraceError(f"{where}: timestamp must be >= 0 (got {timestamp!r})")
    lengths = []
    for name in ("input_length", "output_length"):
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {name} must be an integer >= 0 (got {value!r})")
        lengths.append(value)
    input_tokens, output_tokens = lengths
    if input_tokens == 0:
        raise TraceError(f"{where}: input_length must be > 0 (a request has a prompt)")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    expected = -(-input_tokens // block_tokens)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_tokens}, expected {expected} "
            f"(ceil(input_length / --block-tokens {block_tokens})): is the trace's block size another?"
        )
    return Request(timestamp / 1000.0, input_tokens, output_tokens, tuple(hash_ids))


# -- generators ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Poisson arrivals: ``rate_per_s`` requests per second on average."""

    rate_per_s: float = 20.0

    def times(self, rng: random.Random) -> Iterator[float]:
        if not self.rate_per_s > 0:
            raise PlanInputError(f"--rate-per-s: must be > 0 (got {self.rate_per_s})")
        now = 0.0
        while True:
            yield now
            now += rng.expovariate(self.rate_per_s)


class _Blocks:
    """Fresh block ids, and the ids of a prefix built from shared and fresh parts.

    A block id stands for its whole prefix, so the ids of a prompt are those of the
    shared prefix followed by fresh ones: a shared part is reused only where it is
    the same from the first block on, as a prefix cache sees it.
    """

    def __init__(self) -> None:
        self._next = itertools.count()

    def fresh(self, count: int) -> tuple[int, ...]:
        return tuple(itertools.islice(self._next, count))


def _blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


@dataclass(frozen=True, slots=True)
class SystemPrompts:
    """A few long system prompts shared by many requests, each followed by a user turn.

    ``prompts``: how many distinct system prompts; ``prompt_tokens``: each one's length
    (a whole number of blocks, so that it is reusable whole); ``user_tokens_mean``:
    the mean of the (exponential) user part; ``output_tokens``: the answer length.
    """

    prompts: int = 20
    prompt_tokens: int = 4096
    user_tokens_mean: int = 600
    output_tokens: int = 300


@dataclass(frozen=True, slots=True)
class MultiTurnChat:
    """Conversations of several turns; each turn's prompt is the whole history so far.

    ``conversations_active``: conversations open at once (a finished one is replaced
    by a new one); ``turns_mean``: mean turns per conversation (geometric);
    ``turn_tokens_mean``: mean tokens a turn adds (user message and the previous
    answer); ``system_tokens``: a system prompt all conversations share.
    """

    conversations_active: int = 2000
    turns_mean: float = 5.0
    turn_tokens_mean: int = 800
    system_tokens: int = 1024
    output_tokens: int = 300


@dataclass(frozen=True, slots=True)
class RagDocuments:
    """Retrieval-augmented prompts: a system prompt, one document chosen with Zipf
    popularity (exponent ``zipf_s`` over ``documents``), then the question.

    ``document_tokens``: each document's length (whole blocks); ``question_tokens_mean``:
    the mean (exponential) question length.
    """

    documents: int = 10_000
    zipf_s: float = 1.1
    document_tokens: int = 8192
    system_tokens: int = 512
    question_tokens_mean: int = 200
    output_tokens: int = 200


WorkloadParams = SystemPrompts | MultiTurnChat | RagDocuments

GENERATORS: dict[str, type[SystemPrompts] | type[MultiTurnChat] | type[RagDocuments]] = {
    "system-prompts": SystemPrompts,
    "chat": MultiTurnChat,
    "rag": RagDocuments,
}
"""``--workload`` names and their parameter sets."""


def generate(
    params: WorkloadParams,
    requests: int,
    block_tokens: int,
    arrivals: Arrivals = Arrivals(),
    seed: int = 0,
) -> Iterator[Request]:
    """``requests`` requests of the workload ``params`` describes, lazily, in arrival order."""
    if requests <= 0:
        raise PlanInputError(f"--requests: must be > 0 (got {requests})")
    if block_tokens <= 0:
        raise PlanInputError(f"--block-tokens: must be > 0 (got {block_tokens})")
    rng = random.Random(seed)
    times = arrivals.times(rng)
    if isinstance(params, SystemPrompts):
        bodies = _system_prompts(params, block_tokens, rng)
    elif isinstance(params, MultiTurnChat):
        bodies = _chat(params, block_tokens, rng)
    else:
        bodies = _rag(params, block_tokens, rng)
    for arrival_s, (tokens, output, blocks) in zip(times, itertools.islice(bodies, requests), strict=False):
        yield Request(arrival_s, tokens, output, blocks)


_Body = tuple[int, int, tuple[int, ...]]


def _exp_tokens(rng: random.Random, mean: int) -> int:
    return max(1, int(rng.expovariate(1.0 / mean))) if mean > 0 else 0


def _system_prompts(params: SystemPrompts, block_tokens: int, rng: random.Random) -> Iterator[_Body]:
    ids = _Blocks()
    shared_blocks = params.prompt_tokens // block_tokens
    prompts = [ids.fresh(shared_blocks) for _ in range(params.prompts)]
    while True:
        prefix = prompts[rng.randrange(params.prompts)]
        user = _exp_tokens(rng, params.user_tokens_mean)
        tokens = shared_blocks * block_tokens + user
        yield tokens, params.output_tokens, prefix + ids.fresh(_blocks_for(tokens, block_tokens) - shared_blocks)


def _chat(params: MultiTurnChat, block_tokens: int, rng: random.Random) -> Iterator[_Body]:
    ids = _Blocks()
    system_blocks = params.system_tokens // block_tokens
    system = ids.fresh(system_blocks)
    # Per open conversation: its history's whole blocks (ids) and its tokens so far.
    open_: list[tuple[tuple[int, ...], int]] = [(system, system_blocks * block_tokens)] * params.conversations_active
    end_p = 1.0 / max(params.turns_mean, 1.0)
    while True:
        slot = rng.randrange(len(open_))
        history, tokens = open_[slot]
        tokens += _exp_tokens(rng, params.turn_tokens_mean)
        whole = tokens // block_tokens
        blocks = history + ids.fresh(_blocks_for(tokens, block_tokens) - len(history))
        yield tokens, params.output_tokens, blocks
        # The next turn reuses this prompt's whole blocks; the partial last one is recomputed.
        open_[slot] = (system, system_blocks * block_tokens) if rng.random() < end_p else (blocks[:whole], tokens)


def _rag(params: RagDocuments, block_tokens: int, rng: random.Random) -> Iterator[_Body]:
    ids = _Blocks()
    system_blocks = params.system_tokens // block_tokens
    system = ids.fresh(system_blocks)
    doc_blocks = params.document_tokens // block_tokens
    documents: dict[int, tuple[int, ...]] = {}
    weights = list(itertools.accumulate(1.0 / (rank**params.zipf_s) for rank in range(1, params.documents + 1)))
    ranks = range(params.documents)
    while True:
        (doc,) = rng.choices(ranks, cum_weights=weights)
        prefix = documents.get(doc)
        if prefix is None:  # A document's blocks are made when it is first asked for.
            prefix = documents[doc] = system + ids.fresh(doc_blocks)
        tokens = (system_blocks + doc_blocks) * block_tokens + _exp_tokens(rng, params.question_tokens_mean)
        yield tokens, params.output_tokens, prefix + ids.fresh(_blocks_for(tokens, block_tokens) - len(prefix))
