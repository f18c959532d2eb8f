"""One offline vLLM engine, driven by a JSON spec, reporting what happened as JSON lines.

    python tests/e2e/driver.py SPEC.json

The end-to-end tests run it as a fresh process per "engine start", with the
environment (``KVHARBOR=1``, ``KVHARBOR_CONFIG``, ...) deciding whether and how
kvharbor is on. Spec keys:

- ``model``: the model directory; ``llm``: extra ``LLM(...)`` keyword arguments.
- ``rounds``: a list of rounds, each a list of requests
  ``{"tokens": [...], "salt": str|null, "max_tokens": int, "logprobs": bool}``
  (``logprobs``: its report also has each output token's log-probability); a round is one
  ``LLM.generate`` call. Prints one ``E2E {"request": ...}`` line per request
  and one ``E2E {"round": ...}`` line per round with the change of vLLM's
  external prefix-cache counters over that round.
- ``stream``: optional ``{"requests": [...], "gateway_pid": int, "kill_after_steps": int}``:
  all requests are added at once and the engine is stepped by hand; after
  that many steps the gateway is sent SIGKILL (and its death awaited) while
  requests are still unfinished. One ``E2E {"request": ...}`` line per request.
- ``release``: optional; the gateway client announces this release in its
  HELLO instead of kvharbor's own (a gateway of another release, seen from here).
- ``die_before_commit``: optional; the engine (this process, the worker included:
  multiprocessing is off) SIGKILLs itself when its first save is about to be
  committed, its chunks copied and marked: vLLM's default shutdown at its worst.
- ``hang_up``: optional ``{"gateway_pid": int, "gateway_log": path, "client": str,
  "after_round": int}``: after that round, the service gateway's connections to
  the process of the client whose name starts with ``client`` (found in the
  gateway's log) are shut down inside the gateway process, as when the gateway
  hangs up on that client; one ``E2E {"hung_up": n, ...}`` line.

Last line: ``E2E {"metrics": {...}}``, the ``vllm:kvharbor_*`` and
``vllm:external_prefix_cache_*`` values.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import select
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

_EMITTING = threading.Lock()


def emit(record: dict[str, Any]) -> None:
    """One whole ``E2E`` line. Records come from several threads (a saver thread's beside
    the main thread's), and ``print`` writes the line and its newline apart: two records
    could then share one line."""
    with _EMITTING:
        sys.stdout.write("E2E " + json.dumps(record) + "\n")
        sys.stdout.flush()


def metrics(llm: Any) -> dict[str, float]:
    wanted = ("vllm:kvharbor_", "vllm:external_prefix_cache_")
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name.startswith(wanted) and hasattr(m, "value")}


def prompt_of(request: dict[str, Any]) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": request["tokens"]}
    if request.get("salt") is not None:
        prompt["cache_salt"] = request["salt"]
    return prompt


def report(tag: str, output: Any) -> None:
    completion = output.outputs[0]
    record = {
        "request": tag,
        "cached": output.num_cached_tokens,
        "tokens": list(completion.token_ids),
        "finished": bool(output.finished),
    }
    if completion.logprobs:
        chosen = zip(completion.logprobs, completion.token_ids, strict=True)
        record["logprobs"] = [step[token].logprob for step, token in chosen]
    emit(record)


def run_rounds(llm: Any, rounds: list[list[dict[str, Any]]], between: Callable[[int], None]) -> None:
    """Each round, then ``between(round number)``."""
    from vllm import SamplingParams

    for number, requests in enumerate(rounds):
        before = metrics(llm)
        params = [
            SamplingParams(
                max_tokens=r.get("max_tokens", 8), temperature=0.0, logprobs=0 if r.get("logprobs") else None
            )
            for r in requests
        ]
        outputs = llm.generate([prompt_of(r) for r in requests], params, use_tqdm=False)
        for index, output in enumerate(outputs):
            report(f"{number}.{index}", output)
        after = metrics(llm)
        emit(
            {
                "round": number,
                "external_hits": after.get("vllm:external_prefix_cache_hits", 0)
                - before.get("vllm:external_prefix_cache_hits", 0),
                "external_queries": after.get("vllm:external_prefix_cache_queries", 0)
                - before.get("vllm:external_prefix_cache_queries", 0),
            }
        )
        between(number)


def wait_dead(pid: int) -> None:
    """Block until ``pid`` (not our child) has exited: a pidfd becomes readable then."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], 30)
        assert ready, f"pid {pid} survived SIGKILL for 30 s"
    finally:
        os.close(fd)


def run_stream(llm: Any, stream: dict[str, Any]) -> None:
    from vllm import SamplingParams

    engine = llm.llm_engine
    for index, request in enumerate(stream["requests"]):
        params = SamplingParams(max_tokens=request.get("max_tokens", 8), temperature=0.0)
        engine.add_request(f"s{index}", prompt_of(request), params)
    steps = 0
    killed = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                report(output.request_id, output)
        steps += 1
        if steps == stream["kill_after_steps"] and not killed:
            unfinished = engine.get_num_unfinished_requests()
            os.kill(stream["gateway_pid"], signal.SIGKILL)
            wait_dead(stream["gateway_pid"])
            killed = True
            emit({"killed_gateway_after_steps": steps, "unfinished_at_kill": unfinished})
    emit({"steps": steps, "killed": killed})


SYS_PIDFD_GETFD = 438
"""pidfd_getfd(2): a copy of another process's file descriptor (same number on every Linux architecture)."""


def client_pid(gateway_log: str, client: str) -> int:
    """The pid of the client whose name starts with ``client``, from the gateway's "attached" line."""
    with open(gateway_log) as f:
        found = re.findall(rf"client '{re.escape(client)}[^']*' \(pid (\d+)\) attached", f.read())
    assert found, f"no client {client!r} attached in {gateway_log}"
    return int(found[-1])


def hang_up(gateway_pid: int, peer_pid: int) -> int:
    """Shut down, inside the gateway process, each of its connections whose peer is ``peer_pid``."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(gateway_pid)
    hung = 0
    try:
        for entry in os.scandir(f"/proc/{gateway_pid}/fd"):
            with contextlib.suppress(OSError):  # An fd closed meanwhile.
                if not os.readlink(entry.path).startswith("socket:"):
                    continue
                fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(entry.name), 0)
                if fd < 0:
                    continue
                with socket.socket(fileno=fd) as sock:  # Closing our copy leaves the gateway's open.
                    if sock.family != socket.AF_UNIX:
                        continue
                    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                    if pid == peer_pid:
                        sock.shutdown(socket.SHUT_RDWR)
                        hung += 1
    finally:
        os.close(pidfd)
    return hung


def after_round(spec: dict[str, Any]) -> Callable[[int], None]:
    cut = spec.get("hang_up")

    def after(number: int) -> None:
        if cut is not None and number == cut["after_round"]:
            pid = client_pid(cut["gateway_log"], cut["client"])
            emit({"hung_up": hang_up(cut["gateway_pid"], pid), "client_pid": pid})

    return after


def announce_release(release: str) -> None:
    from kvharbor.gateway.client import GatewayClient

    connect = GatewayClient.connect.__func__  # type: ignore[attr-defined]
    GatewayClient.connect = classmethod(functools.partial(connect, release=release))  # type: ignore[assignment]


def die_before_commit() -> None:
    from kvharbor.gateway.client import GatewayClient, PutBatch

    def commit_put(self: GatewayClient, batch: PutBatch) -> int:
        emit({"dying_before_commit": sum(view is not None for view in batch.views)})
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("SIGKILL returned")

    GatewayClient.commit_put = commit_put  # type: ignore[method-assign]


def kill_gateway_at_promise(gateway_pid: int) -> None:
    """SIGKILL the gateway once the scheduler has planned its first load, so that the load,
    later in that step, finds it dead (the window a promise cannot close)."""
    from kvharbor.connector.vllm.scheduler import SchedulerSide

    planned = SchedulerSide.update_state_after_alloc

    def update_state_after_alloc(self: SchedulerSide, request: Any, blocks: Any, num_external_tokens: int) -> None:
        planned(self, request, blocks, num_external_tokens)
        if num_external_tokens > 0 and not killed:
            killed.append(gateway_pid)
            os.kill(gateway_pid, signal.SIGKILL)
            wait_dead(gateway_pid)
            emit({"killed_gateway_at_promise": num_external_tokens})

    killed: list[int] = []
    SchedulerSide.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("release"):
        announce_release(spec["release"])
    if spec.get("die_before_commit"):
        die_before_commit()
    if spec.get("kill_gateway_at_promise"):
        kill_gateway_at_promise(spec["kill_gateway_at_promise"])
    from vllm import LLM

    options: dict[str, Any] = {
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 4096,
        "disable_log_stats": False,
    }
    options.update(spec.get("llm", {}))
    llm = LLM(model=spec["model"], **options)
    run_rounds(llm, spec.get("rounds", []), after_round(spec))
    if spec.get("stream"):
        run_stream(llm, spec["stream"])
    emit({"metrics": metrics(llm)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
