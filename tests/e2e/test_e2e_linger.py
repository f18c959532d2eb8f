"""vLLM's defaults (the embedded gateway, ``--shutdown-timeout 0``): the gateway outlives the
server, and a server restarted within ``gateway.linger_s`` restores the prompt from its RAM tier.

vLLM's shutdown SIGKILLs every descendant of its engine core and workers; the gateway
survives because it is none (`kvharbor.gateway.detach`). The lab's only tier is RAM, so
a restored prompt can only have come from the gateway the first server started.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable

import pytest
from e2e_harness import CHUNK, Lab, bound, start_server, tokens

from kvharbor.demo.server import VllmServer
from kvharbor.gateway.detach import wait_for_exit

pytestmark = pytest.mark.e2e

PROMPT = tokens(1500, seed=60)
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
    servers.append(start_server(lab))
    first = servers[0].wait_ready().complete(PROMPT)
    assert first.prompt_tokens == len(PROMPT) and first.cached_tokens == 0
    # The chunks are in the RAM tier before the stop (that the last saves land at
    # --shutdown-timeout 0 is another test's matter).
    wait_until(lambda: ram_keys(lab)[1] == len(PROMPT) // CHUNK, "the prompt's chunks in the RAM tier")
    gateway_pid, _ = ram_keys(lab)

    servers[0].stop(signal.SIGINT)  # As Ctrl-C does: the whole process group.
    assert not wait_for_exit(gateway_pid, 0), "the gateway survived vLLM's shutdown"
    wait_until(lambda: "kvharbor: last client detached; lingering 600 s" in lab.embedded_gateway_log(), "lingering")

    servers.append(start_server(lab))
    second = servers[1].wait_ready().complete(PROMPT)
    assert second.cached_tokens == bound(len(PROMPT)) > 0
    assert second.text == first.text
    assert ram_keys(lab)[0] == gateway_pid, "the same gateway served both"
    assert "kvharbor: a client attached to a lingering gateway" in lab.embedded_gateway_log()
    assert [s.log().count("kvharbor: started an embedded gateway") for s in servers] == [1, 0]
    assert all("external KV cache turned off" not in s.log() for s in servers)
