"""Typed streams and events: CUDA's on a GPU, no-ops on the CPU.

The copy pipeline orders its work with streams and events. On the CPU every
operation is synchronous, so a host stream runs work in place and a host event
has happened once it is recorded (it keeps the wall-clock time it was recorded
at, which is what `timing.StepTimer` measures there). One code path serves
both devices, and CI runs the GPU pipeline's logic on CPU tensors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch


class Event(Protocol):
    def synchronize(self) -> None:
        """Block the calling thread until the work before the event has run."""

    def query(self) -> bool:
        """Whether the work before the event has run (never blocks)."""

    def seconds_until(self, end: Event) -> float:
        """Seconds between this event and a later ``end`` of the same kind (both timed)."""


class Stream(Protocol):
    def on(self) -> AbstractContextManager[None]:
        """Queue the work issued inside the context on this stream (and its device)."""

    def record(self, timing: bool = False) -> Event:
        """An event after the work queued on this stream so far."""

    def wait(self, event: Event | None) -> None:
        """Queue a wait for ``event`` before this stream's later work (None: nothing to wait for)."""


class HostEvent:
    """Work on the CPU is done when it returns: the event has happened once recorded."""

    __slots__ = ("at_s",)

    def __init__(self) -> None:
        self.at_s = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def seconds_until(self, end: Event) -> float:
        if not isinstance(end, HostEvent):
            raise TypeError(f"a host event cannot be timed against a {type(end).__name__}")
        return end.at_s - self.at_s


class HostStream:
    """The CPU: work runs in place, in program order."""

    def on(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, timing: bool = False) -> Event:
        return HostEvent()

    def wait(self, event: Event | None) -> None:
        pass  # Whatever the event follows has already run.


class CudaEvent:
    __slots__ = ("event",)

    def __init__(self, stream: torch.cuda.Stream, timing: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=timing)
        self.event.record(stream)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())

    def seconds_until(self, end: Event) -> float:
        if not isinstance(end, CudaEvent):
            raise TypeError(f"a CUDA event cannot be timed against a {type(end).__name__}")
        return float(self.event.elapsed_time(end.event)) / 1000


class CudaStream:
    __slots__ = ("stream",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    @contextlib.contextmanager
    def _on(self) -> Iterator[None]:
        # The device too: the saver thread, whose current device is not the engine's, issues copies.
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            yield

    def on(self) -> AbstractContextManager[None]:
        return self._on()

    def record(self, timing: bool = False) -> Event:
        return CudaEvent(self.stream, timing)

    def wait(self, event: Event | None) -> None:
        if isinstance(event, CudaEvent):
            self.stream.wait_event(event.event)
        # None or a host event: nothing is pending.


def new_stream(device: torch.device) -> Stream:
    """A stream of its own on ``device``."""
    return CudaStream(torch.cuda.Stream(device=device)) if device.type == "cuda" else HostStream()


def engine_stream(device: torch.device) -> Stream:
    """The stream the engine's forward pass runs on (the current one) on ``device``."""
    return CudaStream(torch.cuda.current_stream(device)) if device.type == "cuda" else HostStream()


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
