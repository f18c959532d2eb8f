"""The import hook of the stand-ins and patches (see this package's docstring); idempotent."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

MODULES = Path(__file__).parent / "modules"
BOOT = Path(__file__).parent / "boot"
"""Put on ``PYTHONPATH`` of an engine's processes: its ``sitecustomize`` calls `install`."""
STAND_INS = ("torchvision", "sgl_kernel")


def _no_amx(module: ModuleType) -> None:
    vars(module).update(cpu_has_amx_support=lambda: False)


def _no_host_register(module: ModuleType) -> None:
    vars(module).update(_cuda_host_register=lambda buffer, registration_granularity_bytes=None: None)


def _unpinned_host_pools(module: ModuleType) -> None:
    cls = module.HostKVCache
    init = cls.__init__
    signature = inspect.signature(init)

    def unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        init(*bound.args, **bound.kwargs)

    cls.__init__ = unpinned


def transfer_kv_direct(
    src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """SGLang's direct page copy, in torch: each layer's token rows, from the source indices
    to the destination ones (``page_size``: the indices come in whole pages)."""
    assert len(src_indices) == len(dst_indices) and len(src_indices) % page_size == 0
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


def _torch_page_copy(module: ModuleType) -> None:
    vars(module).update(transfer_kv_direct=transfer_kv_direct)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.torchvision_open = False
        """transformers has cached that torchvision is absent: the stand-in may be imported."""
        self.patches: dict[str, Callable[[ModuleType], None]] = {
            "transformers.utils.import_utils": self._ask_transformers_first,
            "sglang.srt.utils.common": _no_amx,
            "sglang.srt.mem_cache.pool_host.common": _no_host_register,
            "sglang.srt.mem_cache.pool_host.base": _unpinned_host_pools,
            "sglang.srt.mem_cache.pool_host.mha": _torch_page_copy,
        }

    def _ask_transformers_first(self, module: ModuleType) -> None:
        module.is_torchvision_available()
        self.torchvision_open = True

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top in STAND_INS:
            if top == "torchvision" and not self.torchvision_open:
                return None
            return importlib.machinery.PathFinder.find_spec(fullname, [str(MODULES)] if path is None else path)
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.abc.Loader):
            return None
        spec.loader = _Patched(spec.loader, patch)
        return spec


class _Patched(importlib.abc.Loader):
    """The module's own loader, then its patch."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


def install() -> None:
    """Put the hook first on ``sys.meta_path``, before anything imports SGLang."""
    if any(isinstance(finder, _Hook) for finder in sys.meta_path):
        return
    loaded = [name for name in ("transformers.utils.import_utils", "sglang.srt.utils.common") if name in sys.modules]
    if loaded:
        raise RuntimeError(f"SGLang test shims: install() must come before {', '.join(loaded)} is imported")
    sys.meta_path.insert(0, _Hook())
