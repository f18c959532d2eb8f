"""Where a restore's time goes: one request profiled, cut into the steps it passes.

`profile_request(run)` runs ``run()`` (one ``LLM.generate``) under the torch
profiler with named ranges around the engine's and kvharbor's steps, and
`summarize` turns the trace into a step-by-step breakdown on one clock:

- CPU ranges (``record_function`` around methods, patched in for the profiled
  request only): vLLM's input processing, scheduling (kvharbor's lookup and
  load planning inside it), the model runner's input preparation, kvharbor's
  load (each gateway ``GET`` inside it), the forward pass and sampling;
- GPU work, attributed to the range that launched it (the CUDA runtime call
  and the kernel or copy share a correlation id): the load's host-to-device
  copies (the DMA) and scatters, the forward's kernels, sampling's kernels.

The profiler adds CPU time to every operation, so the profiled request is
slower than the timed ones; the GPU intervals and the order of the steps are
what it is for. `clock_request` is the light twin: the same ranges timed with
the wall clock (and the forward pass with CUDA events), at full speed. Used
by ``bench/gpu.py`` (its restart part); runs on the CPU too (the smoke test).
"""

from __future__ import annotations

import functools
import gzip
import importlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RANGES: tuple[tuple[str, str, str], ...] = (
    # (module, Class.method, range name); those a version does not have are skipped.
    ("vllm.v1.engine.llm_engine", "LLMEngine.add_request", "vllm.add_request"),
    ("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", "vllm.process_inputs"),
    ("vllm.v1.engine.core", "EngineCore.preprocess_add_request", "vllm.preprocess_add_request"),  # block hashes
    ("vllm.v1.engine.core", "EngineCore.add_request", "vllm.core_add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", "vllm.schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "vllm.update_from_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", "vllm.execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states", "vllm.update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs", "vllm.prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward", "vllm.forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", "vllm.sample_tokens"),
    # vLLM 0.26 on the H200 runs the second model runner (its forward is inline in execute_model).
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", "vllm.execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs", "vllm.prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", "vllm.sample_tokens"),
    ("kvharbor.connector.vllm.scheduler", "SchedulerSide.get_num_new_matched_tokens", "kvh.lookup"),
    ("kvharbor.connector.vllm.scheduler", "SchedulerSide.update_state_after_alloc", "kvh.plan_load"),
    ("kvharbor.connector.vllm.scheduler", "SchedulerSide.build_meta", "kvh.build_meta"),
    ("kvharbor.connector.vllm.worker", "WorkerSide.prepare_load", "kvh.prepare_load"),
    ("kvharbor.connector.vllm.worker", "WorkerSide.load", "kvh.load"),
    ("kvharbor.connector.vllm.datapath", "DataPath.load", "kvh.path_load"),
    ("kvharbor.gateway.client", "GatewayClient.lookup", "kvh.lookup_rpc"),
    ("kvharbor.gateway.client", "GatewayClient.get", "kvh.get"),
    ("kvharbor.gateway.client", "GatewayClient.release", "kvh.release"),
)
REQUEST = "bench.request"
DMA_BYTES_MIN = 1 << 20
"""Copies at least this large are the load's DMA; smaller ones are its index tensors."""


Wrap = Callable[[Any, str], Any]
"""Makes the wrapper of one method: ``wrap(original, range name)``."""


@contextmanager
def _wrapped(wrap: Wrap) -> Iterator[list[str]]:
    """Wrap every method of `RANGES` that exists; unwrap after. Yields the names wrapped."""
    undo: list[tuple[type, str, Any]] = []
    found: list[str] = []
    for module_name, path, name in RANGES:
        class_name, method = path.split(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get(method)
        if original is None:
            continue
        setattr(cls, method, functools.wraps(original)(wrap(original, name)))
        undo.append((cls, method, original))
        found.append(name)
    try:
        yield found
    finally:
        for cls, method, original in undo:
            setattr(cls, method, original)


def _record_function(original: Any, name: str) -> Any:
    from torch.profiler import record_function

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return original(*args, **kwargs)

    return wrapper


GPU_MARKS = ("kvh.load", "vllm.sample_tokens")
"""Ranges whose end `clock_request` also marks on the engine's stream: from the load's end
(its copies have landed) to sampling's end is the GPU time of the forward pass and sampling."""


class _Clock:
    """The light alternative to the profiler: wall-clock spans of the wrapped methods (a
    microsecond each), and CUDA events on the engine's stream at the ends of `GPU_MARKS`."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.gpu_marks: list[tuple[str, Any]] = []

    def wrap(self, original: Any, name: str) -> Any:
        import torch

        marked = name in GPU_MARKS and torch.cuda.is_available()

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if marked:
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    self.gpu_marks.append((name, event))
                self.spans.append((name, begin, time.perf_counter()))

        return wrapper

    def after_load_gpu_ms(self) -> float | None:
        """GPU time from the end of the (last) load that moved data to the end of sampling."""
        loads = [e for n, e in self.gpu_marks if n == "kvh.load"]
        samples = [e for n, e in self.gpu_marks if n == "vllm.sample_tokens"]
        if not loads or not samples:
            return None
        return round(loads[0].elapsed_time(samples[-1]), 3)


def profile_request(run: Callable[[], Any], trace_out: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """``run()`` profiled; returns its result and `summarize` of the trace (kept
    gzipped at ``trace_out`` when given)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with _wrapped(_record_function) as found, profile(activities=activities) as prof:
        with record_function(REQUEST):
            result = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(name)
        trace = json.loads(Path(name).read_text())
    finally:
        os.unlink(name)
    if trace_out is not None:  # Kept first: a trace this code misreads can be summarized again.
        with gzip.open(trace_out, "wt") as sink:
            json.dump(trace, sink)
    try:
        summary = summarize(trace)
    except Exception as err:  # A bench must not lose the run's timed figures to its own analysis.
        summary = {"error": f"{type(err).__name__}: {err}", "steps_ms": {}}
    summary["ranges_wrapped"] = found
    return result, summary


def clock_request(run: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``run()`` with wall-clock spans only (no profiler: the CPU runs at its own speed);
    returns its result and the steps in ms from its start, as `summarize` names them where
    the CPU can see them (the load's span ends when its last copy has landed)."""
    import torch

    clock = _Clock()
    with _wrapped(clock.wrap) as found:
        t0 = time.perf_counter()
        result = run()
        t_end = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    def ms(t: float) -> float:
        return round((t - t0) * 1000, 3)

    cpu: dict[str, dict[str, float]] = {}
    for name, begin, end in sorted(clock.spans, key=lambda s: s[1]):
        entry = cpu.setdefault(name, {"first_start_ms": ms(begin), "total_ms": 0.0, "count": 0})
        entry["total_ms"] = round(entry["total_ms"] + (end - begin) * 1000, 3)
        entry["count"] += 1
        entry["last_end_ms"] = ms(end)
    gets = sorted((s for s in clock.spans if s[0] == "kvh.get"), key=lambda s: s[1])
    summary: dict[str, Any] = {"request_ms": ms(t_end), "cpu": cpu, "ranges_wrapped": found}
    summary["gets_ms"] = [[ms(begin), round((end - begin) * 1000, 3)] for _, begin, end in gets]
    if clock.gpu_marks:
        summary["after_load_gpu_ms"] = clock.after_load_gpu_ms()
    marks = [
        ("until_lookup", cpu.get("kvh.lookup", {}).get("first_start_ms")),
        ("lookup", cpu.get("kvh.lookup", {}).get("last_end_ms")),
        # The data path's load starts on the loader thread, before the worker's `load` waits for it.
        ("until_load", cpu.get("kvh.path_load", cpu.get("kvh.load", {})).get("first_start_ms")),
        ("first_get", ms(gets[0][2]) if gets else None),
        ("load_rest", cpu.get("kvh.load", {}).get("last_end_ms")),
        ("forward_cpu", cpu.get("vllm.forward", {}).get("last_end_ms")),
        ("sample_tokens", cpu.get("vllm.sample_tokens", {}).get("last_end_ms")),
        ("until_request_end", summary["request_ms"]),
    ]
    summary["steps_ms"] = _cut(marks)
    return result, summary


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """The steps of the profiled request, in ms from its start (see the module doc)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    request = next((e for e in ranges if e["name"] == REQUEST), None)
    if request is None:
        return {"error": f"no {REQUEST} range in the trace"}
    t0, t_end = float(request["ts"]), float(request["ts"]) + float(request["dur"])

    def ms(t: float) -> float:
        return round((t - t0) / 1000, 3)

    cpu: dict[str, dict[str, float]] = {}
    for e in sorted(ranges, key=lambda e: e["ts"]):
        if e["name"] == REQUEST or not t0 <= e["ts"] <= t_end:
            continue
        entry = cpu.setdefault(e["name"], {"first_start_ms": ms(e["ts"]), "total_ms": 0.0, "count": 0})
        entry["total_ms"] = round(entry["total_ms"] + e["dur"] / 1000, 3)
        entry["count"] += 1
        entry["last_end_ms"] = ms(e["ts"] + e["dur"])
    gets = sorted((e for e in ranges if e["name"] == "kvh.get" and t0 <= e["ts"] <= t_end), key=lambda e: e["ts"])

    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_correlation: dict[int, list[dict[str, Any]]] = {}
    for e in device:
        corr = e.get("args", {}).get("correlation")
        if corr is not None:
            by_correlation.setdefault(int(corr), []).append(e)

    def launched_in(name: str) -> list[dict[str, Any]]:
        """GPU work launched from inside the named CPU ranges."""
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == name]
        found: list[dict[str, Any]] = []
        for call in runtime:
            corr = call.get("args", {}).get("correlation")
            if corr is not None and any(a <= call["ts"] <= b for a, b in spans):
                found += by_correlation.get(int(corr), [])
        return sorted(found, key=lambda e: e["ts"])

    def interval(work: list[dict[str, Any]]) -> dict[str, float] | None:
        if not work:
            return None
        busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in work])
        end = max(e["ts"] + e["dur"] for e in work)
        return {"start_ms": ms(work[0]["ts"]), "end_ms": ms(end), "busy_ms": round(busy / 1000, 3), "ops": len(work)}

    # Launched by the data path's load, on the loader thread (or inline, in an older connector).
    load = launched_in("kvh.path_load") or launched_in("kvh.load")
    # The DMA by what it is, whichever thread's ranges the profiler kept: every large copy
    # into the device in the request (its saves copy the other way).
    dma = [
        e
        for e in device
        if e.get("cat") == "gpu_memcpy"
        and "HtoD" in str(e.get("name", ""))
        and int(e.get("args", {}).get("bytes", 0)) >= DMA_BYTES_MIN
    ]
    dma_bytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in dma)
    scatter = [e for e in load if e not in dma]
    gpu = {
        "load_dma": interval(dma),
        "load_scatter": interval(scatter),
        "forward": interval(launched_in("vllm.forward") or _without(launched_in("vllm.execute_model"), load)),
        "sample": interval(launched_in("vllm.sample_tokens")),
        "all": interval(device),
    }
    summary: dict[str, Any] = {"request_ms": ms(t_end), "cpu": cpu, "gpu": gpu, "dma_bytes": dma_bytes}
    if gets:
        summary["first_get_reply_ms"] = ms(gets[0]["ts"] + gets[0]["dur"])
        summary["get_ms"] = {"count": len(gets), "median": _median([e["dur"] / 1000 for e in gets])}
    if dma and gpu["load_dma"] is not None:
        span_s = (gpu["load_dma"]["end_ms"] - gpu["load_dma"]["start_ms"]) / 1000
        summary["dma_GBps_over_span"] = round(dma_bytes / span_s / 1e9, 2) if span_s > 0 else None
        summary["dma_GBps_busy"] = round(dma_bytes / (gpu["load_dma"]["busy_ms"] / 1000) / 1e9, 2)
    if dma:
        summary["dma_gaps"] = _dma_gaps(dma, cpu, ms)
    summary["gets_ms"] = [[ms(e["ts"]), round(e["dur"] / 1000, 3)] for e in gets]
    summary["steps_ms"] = _steps(summary)
    return summary


GAPS_SHOWN = 16
"""The DMA's largest idle gaps listed, each ``[start_ms, ms]``."""


def _dma_gaps(
    dma: list[dict[str, Any]], cpu: dict[str, dict[str, float]], ms: Callable[[float], float]
) -> dict[str, Any]:
    """Where the copy engine stood idle between the load's first and last copy: the gaps'
    total, split at the worker's ``start_load_kv`` (before it the engine's thread runs vLLM's
    step preparation; after its end, the forward pass) and the largest gaps."""
    gaps = _gaps_us([(e["ts"], e["ts"] + e["dur"]) for e in dma])
    spans = [(ms(a), round((b - a) / 1000, 3)) for a, b in gaps]
    load = cpu.get("kvh.load", {})
    load_start, load_end = load.get("first_start_ms"), load.get("last_end_ms")

    def idle(lo: float, hi: float) -> float:
        """Idle ms between ``lo`` and ``hi`` (ms from the request's start)."""
        return round(sum(max(0.0, min(s + d, hi) - max(s, lo)) for s, d in spans), 3)

    largest = sorted(sorted(spans, key=lambda g: -g[1])[:GAPS_SHOWN])
    return {
        "idle_ms": idle(-math.inf, math.inf),
        "idle_ms_before_start_load_kv": None if load_start is None else idle(-math.inf, load_start),
        "idle_ms_during_start_load_kv": None if load_start is None else idle(load_start, load_end or math.inf),
        "idle_ms_after_start_load_kv": None if load_end is None else idle(load_end, math.inf),
        "count": len(spans),
        "largest": [list(g) for g in largest],
    }


def _gaps_us(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The holes between the first and the last of ``spans``, as ``(start, end)``."""
    holes: list[tuple[float, float]] = []
    end = math.inf
    for a, b in sorted(spans):
        if a > end:
            holes.append((end, a))
        end = b if end == math.inf else max(end, b)
    return holes


def _steps(s: dict[str, Any]) -> dict[str, float | None]:
    """The request cut at the moments that matter, each step's duration in ms."""
    cpu, gpu = s["cpu"], s["gpu"]

    def at(group: dict[str, Any], name: str, key: str) -> float | None:
        entry = group.get(name)
        return None if entry is None else entry.get(key)

    marks = [
        ("until_lookup", at(cpu, "kvh.lookup", "first_start_ms")),
        ("lookup", at(cpu, "kvh.lookup", "last_end_ms")),
        ("until_load", at(cpu, "kvh.path_load", "first_start_ms") or at(cpu, "kvh.load", "first_start_ms")),
        ("first_get", s.get("first_get_reply_ms")),
        ("until_first_dma", at(gpu, "load_dma", "start_ms")),
        ("dma", at(gpu, "load_dma", "end_ms")),
        ("last_scatter", at(gpu, "load_scatter", "end_ms")),
        ("forward", at(gpu, "forward", "end_ms")),
        ("sample", at(gpu, "sample", "end_ms")),
        ("until_request_end", s["request_ms"]),
    ]
    return _cut(marks)


def _cut(marks: list[tuple[str, float | None]]) -> dict[str, float | None]:
    """Each mark's distance from the one before it that exists (None where it is missing)."""
    steps: dict[str, float | None] = {}
    previous = 0.0
    for name, mark in marks:
        if mark is None:
            steps[name] = None
            continue
        steps[name] = round(mark - previous, 3)
        previous = mark
    return steps


def _without(work: list[dict[str, Any]], taken: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``work`` less the events of ``taken`` (the forward is execute_model's work less the load's
    where the model runner calls the model inline)."""
    ids = {id(e) for e in taken}
    return [e for e in work if id(e) not in ids]


def _union_us(spans: list[tuple[float, float]]) -> float:
    """How long at least one of ``spans`` runs: from the first start to the last end, less the holes."""
    if not spans:
        return 0.0
    whole = max(b for _, b in spans) - min(a for a, _ in spans)
    return whole - sum(b - a for a, b in _gaps_us(spans))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return round(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2, 3)
