"""The metric table of docs/metrics.md, as tests read it."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `((?:vllm:)?kvharbor_[a-z_]+)` \| (counter|gauge|histogram) \|\s*([a-z_, ]*?)\s*\|")

Described = dict[str, tuple[str, frozenset[str]]]
"""Metric name -> (type, label names)."""


def documented(prefix: str) -> Described:
    rows = [ROW.match(line) for line in DOCS.read_text().splitlines()]
    return {
        m[1]: (m[2], frozenset(label.strip() for label in m[3].split(",") if label.strip()))
        for m in rows
        if m is not None and m[1].startswith(prefix)
    }
