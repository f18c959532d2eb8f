"""The planner's bad-input error: a `ValueError`, so ``kvharbor plan`` prints it and exits 2."""

from __future__ import annotations


class PlanInputError(ValueError):
    """Input the user must fix; the message names the flag, the file or the line."""
