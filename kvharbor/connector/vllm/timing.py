"""Timing the engine's forward passes: the prefill rate the load-or-recompute choice learns."""

from __future__ import annotations

import torch

from kvharbor.connector.vllm.streams import Event, engine_stream


class StepTimer:
    """Times the engine's forward passes between `begin` and `end` of a step.

    With events recorded on the engine's stream (`streams`), read once they
    have completed, never a synchronisation: on a GPU, CUDA's timing events;
    on the CPU, where the forward pass is synchronous, the wall clock.
    """

    PENDING_MAX = 64
    """Timed steps kept until their events complete; later ones are not sampled."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start: Event | None = None
        self._pending: list[tuple[Event, Event, float]] = []

    def begin(self) -> None:
        self._start = engine_stream(self.device).record(timing=True)

    def end(self, flops: float) -> None:
        start, self._start = self._start, None
        if start is None or flops <= 0 or len(self._pending) >= self.PENDING_MAX:
            return
        self._pending.append((start, engine_stream(self.device).record(timing=True), flops))

    def cancel(self) -> None:
        self._start = None

    def take(self) -> tuple[float, float]:
        """(FLOPs, seconds) of the timed steps that have completed since the last call."""
        flops = seconds = 0.0
        keep = []
        for start, end, step_flops in self._pending:
            if end.query():
                flops, seconds = flops + step_flops, seconds + start.seconds_until(end)
            else:
                keep.append((start, end, step_flops))
        self._pending = keep
        return flops, seconds
