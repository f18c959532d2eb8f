"""Stand-in for sgl_kernel on CPU (see tests/sglang/shims/__init__.py): importable, unusable."""

from collections.abc import Callable
from typing import NoReturn

__version__ = "0.0.0+kvharbor-test-stand-in"


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel stand-in (kvharbor tests): {name} is not available on this machine")

    unavailable.__name__ = name
    return unavailable
