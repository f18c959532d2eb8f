"""A clock that a test moves on by hand, for code that takes ``clock: Callable[[], float]``."""

from __future__ import annotations


class Clock:
    """Monotonic seconds, starting at 1000 (not 0: code may treat 0 as never)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s
