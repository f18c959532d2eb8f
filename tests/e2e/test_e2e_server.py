"""The OpenAI-compatible server with ``KVHARBOR=1``: restart only vLLM, and the prompt comes back cached.

Multiprocessing is on (the server's default): the front end, the engine core
and the worker each load the plugin, and the embedded gateway must still
start exactly once per server.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from e2e_harness import Lab, bound, start_server, tokens

from kvharbor.demo.server import VllmServer

pytestmark = pytest.mark.e2e

PROMPT = tokens(1500, seed=50)


@pytest.fixture
def servers(lab: Lab) -> Iterator[list[VllmServer]]:
    started: list[VllmServer] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()


def complete(server: VllmServer) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=server.name, prompt=PROMPT, max_tokens=8, temperature=0)


def cached_tokens(answer: openai.types.Completion) -> int:
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return int(answer.usage.prompt_tokens_details.cached_tokens or 0)


def test_restarted_server_restores_the_prompt(lab: Lab, servers: list[VllmServer]) -> None:
    servers.append(start_server(lab))  # Registered first: the fixture stops it whatever happens.
    first = complete(servers[0].wait_ready())
    assert first.usage is not None and first.usage.prompt_tokens == len(PROMPT)
    assert cached_tokens(first) == 0
    servers[0].stop()

    servers.append(start_server(lab))
    second = complete(servers[1].wait_ready())
    assert cached_tokens(second) == bound(len(PROMPT)) > 0
    assert second.choices[0].text == first.choices[0].text

    # The first server started the embedded gateway; the second attached to it, lingering.
    assert [each.log().count("kvharbor: started an embedded gateway") for each in servers] == [1, 0]
    for each in servers:
        log = each.log()
        assert "kvharbor: 4 cache tensors registered" in log
        assert "external KV cache turned off" not in log
