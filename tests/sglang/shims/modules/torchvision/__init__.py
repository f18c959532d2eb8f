"""Stand-in for torchvision on CPU (see tests/sglang/shims/__init__.py): importable, unusable."""

__version__ = "0.0.0+kvharbor-test-stand-in"


def __getattr__(name: str) -> object:
    raise AttributeError(f"torchvision stand-in (kvharbor tests): {name} is not available on this machine")
