"""What a prefill costs and what a token's KV weighs, by model and GPU.

KV bytes per token follow from the model's shape:
2 (K and V) x layers x KV heads x head size x bytes per element.
Prefill time is FLOPs over a FLOP rate: the FLOPs are the connector's own
`PrefillCost` (`kvharbor.cache.bandwidth`: weight matmuls per token plus attention
per token pair, so a token at position 130,000 costs more than one at 1,000), and
the rate is the GPU's measured or assumed prefill FLOP rate times the engine's
tensor-parallel ranks (less ``TP_EFFICIENCY`` for their all-reduces).

Sources (docs/planner.md has the derivation):

- shapes: the models' ``config.json`` (Llama-3.1-8B, -70B);
- H200: measured by ``bench/gpu.py`` (docs/performance.md): Llama-3.1-8B prefills
  130,000 tokens in 9.9-10.3 s and 32,768 in 1.16-1.24 s; `PrefillCost` counts
  6.25e15 and 7.39e14 FLOPs for them, 6.2e14 FLOP/s at both lengths (63 % of the
  989 TFLOP/s dense BF16 peak); restores at ~54 GB/s host to device;
- H100 (SXM): the same 989 TFLOP/s peak and PCIe Gen5 link as the H200, so the same
  figures are assumed (not measured here); its 80 GB hold less KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvharbor.cache.bandwidth import PrefillCost
from kvharbor.sim.errors import PlanInputError

GB = 10**9
TP_EFFICIENCY = 0.85
"""Share of linear scaling a tensor-parallel engine keeps (all-reduces per layer); assumed."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``gpu_memory_utilization``: the share of GPU memory for weights and KV."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    params: float
    """Parameters (weights), for the memory they take."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    intermediate: int
    dtype_bytes: int = 2
    tensor_parallel: int = 1
    """The ranks an engine of this model runs on by default (70B does not fit one GPU)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def prefill_cost(self) -> PrefillCost:
        return PrefillCost.transformer(
            self.hidden, self.layers, self.heads, self.kv_heads, self.head_size, self.intermediate
        )


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: float
    prefill_flops_per_s: float
    """Sustained prefill FLOP rate of one GPU (`PrefillCost` FLOPs per second)."""
    host_to_device_bytes_per_s: float
    """Restore bandwidth from pinned host memory into one GPU."""


# fmt: off
MODELS: dict[str, ModelShape] = {
    "llama-3.1-8b":  ModelShape("llama-3.1-8b",  8.03e9,  4096, 32, 32, 8, 128, 14336),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 70.6e9,  8192, 80, 64, 8, 128, 28672, tensor_parallel=4),
}
GPUS: dict[str, GpuSpec] = {
    "h200": GpuSpec("h200", 141 * GB, 6.2e14, 54e9),
    "h100": GpuSpec("h100",  80 * GB, 6.2e14, 54e9),
}
# fmt: on


@dataclass(frozen=True, slots=True)
class EngineCost:
    """One engine: a model on ``tensor_parallel`` GPUs of one kind."""

    model: ModelShape
    gpu: GpuSpec
    tensor_parallel: int
    prefill: PrefillCost = field(init=False)
    prefill_flops_per_s: float = field(init=False)
    """The engine's prefill FLOP rate: its GPUs' less ``TP_EFFICIENCY`` when there are several."""

    def __post_init__(self) -> None:
        if self.tensor_parallel <= 0:
            raise PlanInputError(f"--tensor-parallel: must be > 0 (got {self.tensor_parallel})")
        if self.gpu_cache_tokens <= 0:
            raise PlanInputError(
                f"--model {self.model.name} does not fit {self.tensor_parallel} x --gpu {self.gpu.name} "
                f"({self.model.weight_bytes / GB:.0f} GB of weights): raise --tensor-parallel"
            )
        # Computed once: a fleet run asks for prefill times several times per request.
        scale = 1.0 if self.tensor_parallel == 1 else self.tensor_parallel * TP_EFFICIENCY
        object.__setattr__(self, "prefill", self.model.prefill_cost)
        object.__setattr__(self, "prefill_flops_per_s", self.gpu.prefill_flops_per_s * scale)

    @property
    def restore_bytes_per_s(self) -> float:
        """Ranks restore their shares of a chunk in parallel."""
        return self.gpu.host_to_device_bytes_per_s * self.tensor_parallel

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def gpu_cache_tokens(self) -> int:
        """Tokens of KV the engine's GPUs hold beside the weights."""
        free = GPU_MEMORY_UTILIZATION * self.gpu.memory_bytes * self.tensor_parallel - self.model.weight_bytes
        return int(free // self.kv_bytes_per_token)

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to compute positions ``start .. end`` with ``0 .. start`` cached."""
        return self.prefill.flops(start, end) / self.prefill_flops_per_s


def engine_cost(model: str, gpu: str, tensor_parallel: int | None = None) -> EngineCost:
    """The engine named by ``--model``, ``--gpu`` and ``--tensor-parallel`` (None: the model's default)."""
    shape = MODELS.get(model.lower())
    if shape is None:
        raise PlanInputError(f"--model: unknown model {model!r}; known: {', '.join(MODELS)}")
    spec = GPUS.get(gpu.lower())
    if spec is None:
        raise PlanInputError(f"--gpu: unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    return EngineCost(shape, spec, shape.tensor_parallel if tensor_parallel is None else tensor_parallel)
