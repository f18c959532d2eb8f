"""Where the Mooncake trace lies: ``data/traces/`` of this checkout (vendored, so that a clean
checkout has it)."""

from __future__ import annotations

from pathlib import Path

MOONCAKE_NAME = "mooncake_conversation_trace.jsonl"


def mooncake_trace() -> Path:
    """The trace's path; fails naming where it looked (the validation needs the real trace)."""
    path = Path(__file__).resolve().parents[2] / "data" / "traces" / MOONCAKE_NAME
    assert path.is_file(), f"{MOONCAKE_NAME} not found at {path}"
    return path
