"""Which dtype a CPU computes the demo's model fastest in, and why.

vLLM's CPU backend runs bf16 with native instructions only where the CPU has
them (``avx512_bf16`` or AMX's ``amx_bf16``); elsewhere each bf16 operation is
emulated, and a prefill takes several times as long as in float32. Measured
on a 2-core machine without AVX-512: a 3,000-token prompt on the demo's model
took 32.8 s in bf16 and 12.2 s in float32; on a machine with ``avx512_bf16``,
1.7-2.1 s in bf16. So the demo and the CPU benchmark ask the CPU, not a
default: bf16 where it is native, float32 elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""CPU flags (as /proc/cpuinfo spells them) with which bf16 matrix work is native."""


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str
    """``bfloat16`` or ``float32``, as vLLM's ``--dtype`` takes it."""
    reason: str
    """One sentence for the user: why this dtype on this machine."""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text (x86 ``flags``, Arm ``Features``)."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose_dtype(cpuinfo: str | None = None) -> DtypeChoice:
    """bf16 where the CPU computes it natively, else float32; ``cpuinfo`` defaults to this machine's."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    native = sorted(cpu_flags(cpuinfo) & NATIVE_BF16_FLAGS)
    if native:
        return DtypeChoice("bfloat16", f"this CPU computes bf16 natively ({', '.join(native)})")
    return DtypeChoice(
        "float32",
        "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16), where float32 prefills about "
        "2.7x faster than emulated bf16",
    )
