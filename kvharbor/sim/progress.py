"""A progress bar on a stream (stderr), redrawn at most every ``REDRAW_S``."""

from __future__ import annotations

import time
from typing import TextIO

REDRAW_S = 0.25
"""Least wall time between two redraws: a bar must not cost the run it shows."""
WIDTH = 30


class ProgressBar:
    """``bar(done)`` shows ``done`` of ``total``; `close` ends the line. A bar that is not
    ``enabled`` prints nothing (the default off a terminal)."""

    def __init__(self, total: int, stream: TextIO, label: str, enabled: bool) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.label = label
        self.enabled = enabled
        self._drawn_at = -REDRAW_S
        self._started = time.monotonic()
        self._shown = False

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._drawn_at < REDRAW_S and done < self.total:
            return
        self._drawn_at = now
        share = min(done / self.total, 1.0)
        filled = int(share * WIDTH)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {share:6.1%} {now - self._started:6.1f} s"
        )
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False
