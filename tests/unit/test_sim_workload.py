"""Traces are read whole or refused naming the line; generators share prefixes as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvharbor.sim.workload import (
    Arrivals,
    MultiTurnChat,
    RagDocuments,
    SystemPrompts,
    TraceError,
    generate,
    read_trace,
)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def record(timestamp: float = 0, input_length: int = 1000, hash_ids: list[int] | None = None) -> str:
    return json.dumps(
        {"timestamp": timestamp, "input_length": input_length, "output_length": 5, "hash_ids": hash_ids or [0, 1]}
    )


def test_a_trace_is_read_into_requests_in_seconds(tmp_path: Path) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [record(0), "", record(1500, 600, [0, 7])])
    requests = read_trace(trace, 512)
    assert [(r.arrival_s, r.input_tokens, r.blocks) for r in requests] == [(0.0, 1000, (0, 1)), (1.5, 600, (0, 7))]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: must be a JSON object"),
        (json.dumps({"timestamp": 5, "input_length": 10, "output_length": 1}), "line 2: missing field 'hash_ids'"),
        (record(5, 1000, [0, 1]).replace("}", ', "extra": 1}'), "line 2: unknown field 'extra'"),
        (record(5, -3), "line 2: input_length must be an integer >= 0"),
        (record(5, 1000, [0, 1, 2]), "line 2: 3 hash_ids for input_length 1000, expected 2"),
        (record(-1), "line 2: timestamp must be >= 0"),
    ],
)
def test_a_bad_line_is_refused_naming_it(tmp_path: Path, line: str, says: str) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [record(0), line, record(10)])
    with pytest.raises(TraceError, match=says.replace("[", r"\[").replace("(", r"\(")):
        read_trace(trace, 512)


def test_a_decreasing_timestamp_is_refused_naming_the_line(tmp_path: Path) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [record(0), record(2000), record(1000)])
    with pytest.raises(TraceError, match=r"line 3: timestamp 1000 ms is before the previous line's 2000 ms"):
        read_trace(trace, 512)


def test_an_empty_or_missing_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="holds no request"):
        read_trace(write_lines(tmp_path / "empty.jsonl", ["", "  "]), 512)
    with pytest.raises(TraceError, match="cannot be read"):
        read_trace(tmp_path / "absent.jsonl", 512)


def test_generators_are_lazy_seeded_and_share_prefixes_as_documented() -> None:
    chat = list(generate(MultiTurnChat(conversations_active=3, turns_mean=50), 60, 256, seed=7))
    assert chat == list(generate(MultiTurnChat(conversations_active=3, turns_mean=50), 60, 256, seed=7))
    assert [r.arrival_s for r in chat] == sorted(r.arrival_s for r in chat)
    for request in chat:
        assert len(request.blocks) == -(-request.input_tokens // 256)
    # A later turn of a conversation starts with the earlier turn's whole blocks.
    extended = sum(
        1
        for later in chat
        for earlier in chat
        if len(earlier.blocks) > 4
        and later.blocks[: earlier.input_tokens // 256] == earlier.blocks[: earlier.input_tokens // 256]
        and later is not earlier
    )
    assert extended > 0
    prompts = list(generate(SystemPrompts(prompts=2, prompt_tokens=1024), 50, 256, Arrivals(5.0)))
    assert len({r.blocks[:4] for r in prompts}) == 2, "every request starts with one of the two system prompts"
    rag = list(generate(RagDocuments(documents=100, document_tokens=1024, system_tokens=512), 300, 512))
    heads = [r.blocks[:3] for r in rag]
    assert heads.count(max(set(heads), key=heads.count)) > 300 / 100 * 3, "Zipf: the top document is popular"
