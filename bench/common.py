"""What every benchmark shares: best-of timing and the ``--json`` closing line.

Benchmarks print ratios against the physical limit and against peers measured
in the same run; they never assert on time. The machines are noisy, so each
figure is the best of several repetitions: the least disturbed run. Where a
ratio's two sides are bound by a disk whose speed wanders by up to 2x within
minutes (these VMs' virtio disks), the best of each side is drawn from
whichever moment the disk was fastest for it, and one lucky repetition moves
the ratio by a third; such ratios come with a second figure,
`paired_median_ratio`: the median over rounds of the two sides' times taken
one right after the other.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENGINE_TIMEOUT_S = 900
"""Longest one benchmark engine process may run (a fresh vLLM start and its prompts, on CPU)."""
BENCH_LINE_PREFIX = "BENCH "
"""An engine process reports its figures as one line: this prefix, then JSON."""


def best_seconds(work: Callable[[], object], repeats: int, min_s: float = 0.05) -> float:
    """The fastest of ``repeats`` timings of ``work``, each looped for >= ``min_s``."""
    loops = 1
    while True:  # Calibrate: enough loops that one timing is well above timer noise.
        start = time.perf_counter()
        for _ in range(loops):
            work()
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            break
        loops *= 2
    best = elapsed / loops
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(loops):
            work()
        best = min(best, (time.perf_counter() - start) / loops)
    return best


def interleaved_seconds(works: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each of ``works`` timed once per round (`best_seconds` of one repetition), in turn,
    ``repeats`` rounds: per work, its seconds in round order.

    A figure and the reference it is divided by are then drawn from the same
    stretch of time, so a disturbance that lasts a while (another process's
    test run) cannot favour whichever was timed when it was quiet.
    """
    rounds: dict[str, list[float]] = {name: [] for name in works}
    for _ in range(repeats):
        for name, work in works.items():
            rounds[name].append(best_seconds(work, 1))
    return rounds


def best_seconds_interleaved(works: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The fastest round of each of ``works`` (see `interleaved_seconds`)."""
    return {name: min(seconds) for name, seconds in interleaved_seconds(works, repeats).items()}


def paired_median_ratio(reference_s: list[float], subject_s: list[float]) -> float:
    """The median over rounds of ``reference_s[i] / subject_s[i]``: how fast the subject ran
    against its reference timed beside it, in a typical round (see the module docstring)."""
    if len(reference_s) != len(subject_s) or not subject_s:
        raise ValueError(f"paired rounds: {len(reference_s)} reference timings and {len(subject_s)} subject timings")
    return statistics.median(ref / sub for ref, sub in zip(reference_s, subject_s, strict=True))


def emit(figures: dict[str, Any], ratios: dict[str, float], as_json: bool) -> None:
    """Print the figures and ratios; with ``as_json`` end with them as one JSON line."""
    width = max(len(name) for name in [*figures, *ratios])
    for name, value in figures.items():
        print(f"  {name:<{width}}  {value:,.3f}" if isinstance(value, float) else f"  {name:<{width}}  {value}")
    for name, value in ratios.items():
        print(f"  {name:<{width}}  {value:.3f}x")
    if as_json:
        print(json.dumps({"figures": figures, "ratios": ratios}))


@contextmanager
def gateway_process(
    config_path: Path, log_path: Path, start_timeout_s: float, prefix: Sequence[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``kvharbor gateway`` on ``config_path``, its output in ``log_path``, serving
    inside the block (its ready pipe answered); stopped with SIGTERM after it. ``prefix``: a
    command that execs it elsewhere (``ip netns exec NAME``: another host's network)."""
    read_end, write_end = os.pipe()
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    child = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "kvharbor",
            "gateway",
            "--config",
            str(config_path),
            "--ready-fd",
            str(write_end),
        ],
        pass_fds=(write_end,),
        stdout=log,
        stderr=log,
    )
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], start_timeout_s)
        if not ready or os.read(read_end, 16) != b"ready\n":
            raise SystemExit(f"the gateway did not start; see {log.name}")
        yield child
    finally:
        os.close(read_end)
        child.terminate()
        child.wait(60)
        log.close()


class EngineProcess:
    """A benchmark engine process started by `start_engine_process`."""

    def __init__(self, name: str, child: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.child = child
        self.log_path = log_path

    def report(self) -> dict[str, Any]:
        """Wait for it (at most `ENGINE_TIMEOUT_S` from now) and return the JSON of the last
        `BENCH_LINE_PREFIX` line it printed."""
        try:
            self.child.wait(ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        lines = [
            ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.startswith(BENCH_LINE_PREFIX)
        ]
        if not lines:
            raise SystemExit(f"bench: the engine {self.name} reported nothing; its log: {self.log_path}")
        return dict(json.loads(lines[-1][len(BENCH_LINE_PREFIX) :]))


def start_engine_process(
    script: str, spec: Mapping[str, Any], env: Mapping[str, str | None], workdir: Path, tmp: Path, name: str
) -> EngineProcess:
    """``script --engine SPEC`` as a fresh offline vLLM engine process, started and left
    running: ``spec`` as JSON in ``workdir``, none of this process's ``KVHARBOR``/``VLLM_``
    variables, vLLM in one process with its own ``TMPDIR`` (``tmp``: it leaves sockets
    there), ``env`` added (a None there leaves that variable unset); its output in
    ``workdir/engine-NAME.log``. Several may run at once (each ``name`` its own)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVHARBOR", "VLLM_"))}
    child_env.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2")
    child_env.update({k: v for k, v in env.items() if v is not None}, TMPDIR=str(tmp))
    for unset in (k for k, v in env.items() if v is None):
        child_env.pop(unset, None)
    spec_path = workdir / f"engine-spec-{name}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"engine-{name}.log"
    with open(log_path, "wb") as log:  # The child holds its own descriptor of it.
        child = subprocess.Popen(
            [sys.executable, script, "--engine", str(spec_path)], env=child_env, stdout=log, stderr=subprocess.STDOUT
        )
    return EngineProcess(name, child, log_path)


def run_engine_process(
    script: str, spec: Mapping[str, Any], env: Mapping[str, str], workdir: Path, tmp: Path, name: str
) -> dict[str, Any]:
    """`start_engine_process`, then its `EngineProcess.report`."""
    return start_engine_process(script, spec, env, workdir, tmp, name).report()
