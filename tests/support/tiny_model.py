"""The tiny random-weight model now lives in the package (`kvharbor.demo.model`): the
demo needs it too. Kept so that ``python -m tests.support.tiny_model DIR`` still works."""

from kvharbor.demo.model import MARKER, build_tiny_model, main

__all__ = ["MARKER", "build_tiny_model", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
