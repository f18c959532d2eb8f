"""Where the shared Mooncake trace lies: ``shared/data/traces/`` beside the checkout (``../shared``
of /work/main) or beside a folder above it (a worktree under /work/wt)."""

from __future__ import annotations

from pathlib import Path

MOONCAKE_NAME = "mooncake_conversation_trace.jsonl"


def mooncake_trace() -> Path:
    """The trace's path; fails naming where it looked (the validation needs the real trace)."""
    here = Path(__file__).resolve()
    looked = []
    for folder in here.parents:
        candidate = folder / "shared" / "data" / "traces" / MOONCAKE_NAME
        if candidate.is_file():
            return candidate
        looked.append(str(candidate.parent))
    raise AssertionError(f"{MOONCAKE_NAME} not found in any of: {', '.join(looked)}")
