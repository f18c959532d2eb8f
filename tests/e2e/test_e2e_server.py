"""The OpenAI-compatible server with ``KVHARBOR=1`` and vLLM's defaults: stop it with Ctrl-C
right after a response, start it again within ``gateway.linger_s``, and the prompts come back
cached, from the RAM tier of the gateway the first server started.

Multiprocessing is on (the server's default): the front end, the engine core and the worker
each load the plugin. vLLM's shutdown (``--shutdown-timeout 0``) SIGKILLs every descendant of
its engine core and workers; the embedded gateway survives because it is none
(`kvharbor.gateway.detach`), and lingers. The engine SIGKILLed right after its last response
loses no save its steps finished (completion marks), and ``vllm:kvharbor_stored_chunks``
counts the last commit. The lab's only tier is RAM, so a restored prompt can only have come
from the gateway the first server started.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable

import pytest
from e2e_harness import CHUNK, Lab, bound, start_server, tokens, wait_for_metric

from kvharbor.demo.server import VllmServer
from kvharbor.gateway.detach import wait_for_exit

pytestmark = pytest.mark.e2e

PROMPT = tokens(1500, seed=50)
LAST = tokens(1300, seed=51)
"""Sent last before Ctrl-C, for one token: its saves are the ones a killed engine could lose."""
WAIT_S = 60.0


def ram_keys(lab: Lab) -> tuple[int, int]:
    """(gateway pid, keys its RAM tier holds), asked through a real client."""
    with contextlib.closing(lab.gateway_client()) as client:
        status = client.status()
    (ram,) = status.store.tiers
    return client.hello.gateway_pid, int(ram.keys)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Re-check ``condition`` (each check a real request or read) until it holds."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"


def test_a_restarted_server_restores_from_the_lingering_gateways_ram_tier(lab: Lab, servers: list[VllmServer]) -> None:
    lab.config_path = lab.write_config(tiers=[{"name": "ram", "type": "ram", "capacity_gb": 0.25}])
    servers.append(start_server(lab))  # Registered first: the fixture stops it whatever happens.
    first = servers[0].wait_ready().complete(PROMPT)
    assert first.prompt_tokens == len(PROMPT) and first.cached_tokens == 0
    # The engine's counter reaches every chunk with no request after this one: the commit
    # behind the last step is counted too.
    wait_for_metric(servers[0], "vllm:kvharbor_stored_chunks_total", len(PROMPT) // CHUNK)
    assert ram_keys(lab)[1] == len(PROMPT) // CHUNK
    last = servers[0].complete(LAST, max_tokens=1)
    assert last.cached_tokens == 0
    gateway_pid, _ = ram_keys(lab)

    servers[0].stop(signal.SIGINT)  # Ctrl-C right after the response: vLLM's default shutdown (0 s).
    assert not wait_for_exit(gateway_pid, 0), "the gateway survived vLLM's shutdown"
    wait_until(lambda: "kvharbor: last client detached; lingering 600 s" in lab.embedded_gateway_log(), "lingering")

    servers.append(start_server(lab))
    again = servers[1].wait_ready().complete(LAST, max_tokens=1)
    second = servers[1].complete(PROMPT)
    assert again.cached_tokens == bound(len(LAST)) > 0
    assert second.cached_tokens == bound(len(PROMPT)) > 0
    assert (second.text, again.text) == (first.text, last.text)
    assert ram_keys(lab)[0] == gateway_pid, "the same gateway served both"
    assert "kvharbor: a client attached to a lingering gateway" in lab.embedded_gateway_log()
    assert [s.log().count("kvharbor: started an embedded gateway") for s in servers] == [1, 0]
    for each in servers:
        log = each.log()
        assert "kvharbor: 4 cache tensors registered" in log
        assert "external KV cache turned off" not in log
