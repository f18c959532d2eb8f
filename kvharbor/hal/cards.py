"""A card tier's ``device:`` spec to its driver: ``sim``, ``sim:PARAMS.yaml``, ``file:PATH``, ``/dev/...``.

- ``sim``, ``sim:PARAMS.yaml``: the simulated card (`kvharbor.hal.sim`);
- ``file:PATH``: block mode (`kvharbor.hal.block`) on a file; an absent file is
  created to hold the tier's ``capacity_gb`` (whole regions and the superblock),
  which it then needs;
- ``/dev/nvmeXnY`` or any other block device: block mode on the device; for an
  NVMe namespace its health comes from nvme-cli (`kvharbor.hal.nvme.block_device`);
- ``/dev/ngXnY`` (a character device): an NVMe Key Value namespace
  (`kvharbor.hal.nvme.kv_device`).

Every refusal is a ValueError or `DeviceError` naming the tier and the device (a
path that does not exist, is not an NVMe device, lacks the KV command set, a file
too small or of another format); the tier is then skipped at start like any tier
that cannot open, and the gateway serves without it.
"""

from __future__ import annotations

import os
import re
import stat

from kvharbor.config import CardSection, NvmeTierSection
from kvharbor.hal.base import Device
from kvharbor.hal.posix import device_mode

_NVME_NAMESPACE = re.compile(r"^/dev/nvme\d+n\d+$")
"""An NVMe namespace's block device (not a partition, ``p1``): nvme-cli answers for it."""


def open_card(section: NvmeTierSection, card: CardSection, max_value_bytes: int, *, exclusive: bool = True) -> Device:
    """The driver for ``section.device`` with the ``card`` settings that shape it (region
    size, health interval); raises ValueError naming the tier, the spec and, for a
    parameter file, the file and the key that is wrong. ``exclusive`` False opens a block
    store without its lock (a forced wipe beside the gateway that holds it)."""
    spec, tier = section.device, section.name
    if spec == "sim" or spec.startswith("sim:"):
        return _open_sim(tier, spec, max_value_bytes)
    if spec.startswith("file:"):
        return _open_file(section, card, max_value_bytes, exclusive)
    return _open_device_path(tier, spec, card, max_value_bytes, exclusive)


def _open_sim(tier: str, spec: str, max_value_bytes: int) -> Device:
    from kvharbor.hal.sim.device import SimCardDevice
    from kvharbor.hal.sim.params import CardParams, load_params

    path = spec.removeprefix("sim").removeprefix(":")
    if spec != "sim" and not path:
        raise ValueError(f"tier '{tier}': device 'sim:' needs a parameter file: sim:PARAMS.yaml")
    try:
        params = load_params(path) if path else CardParams()
    except ValueError as err:
        raise ValueError(f"tier '{tier}': {err}") from None
    return SimCardDevice(tier, params, max_value_bytes=max_value_bytes)


def _open_file(section: NvmeTierSection, card: CardSection, max_value_bytes: int, exclusive: bool) -> Device:
    from kvharbor.hal.block.layout import SUPERBLOCK_BYTES, LayoutError
    from kvharbor.hal.block.store import BlockStoreDevice

    path = section.device.removeprefix("file:")
    where = f"tier '{section.name}': device {section.device!r}"
    if not path:
        raise ValueError(f"{where}: file: needs a path: file:PATH")
    if os.path.isdir(path):
        raise ValueError(f"{where}: {path} is a directory; block mode needs a file (file:PATH/card.img)")
    create_bytes = None
    if not os.path.exists(path):
        if section.capacity_gb is None:
            raise ValueError(f"{where}: {path} does not exist; set the tier's capacity_gb to create it at that size")
        # The superblock beside whole regions that hold capacity_gb: the device's capacity (its
        # regions) is then at least the tier's, never refused as larger than the device.
        regions = -(-section.capacity_bytes // card.region_bytes)
        create_bytes = SUPERBLOCK_BYTES + regions * card.region_bytes
    try:
        return BlockStoreDevice(
            section.name,
            path,
            max_value_bytes,
            region_bytes=card.region_bytes,
            create_bytes=create_bytes,
            exclusive=exclusive,
        )
    except LayoutError as err:
        raise ValueError(f"tier '{section.name}': device {section.device!r}: {err}") from None


def _open_device_path(tier: str, path: str, card: CardSection, max_value_bytes: int, exclusive: bool) -> Device:
    where = f"tier '{tier}': device {path}"
    mode = device_mode(where, path)
    if stat.S_ISCHR(mode):
        from kvharbor.hal.nvme.kv_device import open_kv_namespace

        return open_kv_namespace(tier, path, max_value_bytes, health_interval_s=card.health_interval_s)
    if not stat.S_ISBLK(mode):
        raise ValueError(
            f"{where} is neither a block device (/dev/nvmeXnY, block mode) nor a character device "
            "(/dev/ngXnY, a KV namespace); for a plain file use file:PATH"
        )
    from kvharbor.hal.block.layout import LayoutError

    try:
        if _NVME_NAMESPACE.match(path):
            from kvharbor.hal.nvme.block_device import NvmeBlockDevice
            from kvharbor.hal.nvme.health import NvmeAdmin

            return NvmeBlockDevice(
                tier,
                path,
                max_value_bytes,
                NvmeAdmin(path),
                region_bytes=card.region_bytes,
                health_interval_s=card.health_interval_s,
                exclusive=exclusive,
            )
        from kvharbor.hal.block.store import BlockStoreDevice

        return BlockStoreDevice(tier, path, max_value_bytes, region_bytes=card.region_bytes, exclusive=exclusive)
    except LayoutError as err:
        raise ValueError(f"{where}: {err}") from None
