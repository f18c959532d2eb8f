"""Stand-in for torchvision.transforms (see tests/sglang/shims/__init__.py)."""

from .functional import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str) -> object:
    raise AttributeError(f"torchvision stand-in (kvharbor tests): transforms.{name} is not available")
