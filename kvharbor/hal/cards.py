"""A card tier's ``device:`` spec to its driver: ``sim``, ``sim:PARAMS.yaml``, ``file:PATH``, ``/dev/...``.

Only the simulated card is built so far; the other forms are refused with a
message that names the tier and says what works instead, and the tier is then
skipped at start like any tier that cannot open (the gateway serves without it).
"""

from __future__ import annotations

from kvharbor.hal.base import Device


def open_card(tier: str, spec: str, max_value_bytes: int) -> Device:
    """The driver for ``spec``; raises ValueError naming the tier, the spec and, for a
    parameter file, the file and the key that is wrong."""
    if spec == "sim" or spec.startswith("sim:"):
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
    if spec.startswith("file:"):
        raise ValueError(
            f"tier '{tier}': device {spec!r}: block mode on a file is not built yet; use device: sim or sim:PARAMS.yaml"
        )
    raise ValueError(
        f"tier '{tier}': device {spec!r}: the NVMe driver is not built yet; use device: sim or sim:PARAMS.yaml"
    )
