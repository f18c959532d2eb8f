"""Stand-in for torchvision.transforms.functional (see tests/sglang/shims/__init__.py)."""

import enum


class InterpolationMode(enum.Enum):
    """The names SGLang's vision configs read at import."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def __getattr__(name: str) -> object:
    raise AttributeError(f"torchvision stand-in (kvharbor tests): transforms.functional.{name} is not available")
