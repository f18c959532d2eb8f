"""The OpenAI-compatible server with ``KVHARBOR=1`` and vLLM's defaults: stop it with Ctrl-C
right after a response, start it again, and the prompts come back cached.

Multiprocessing is on (the server's default): the front end, the engine core
and the worker each load the plugin. The embedded gateway the first server
starts outlives it (``gateway.linger_s``); the engine SIGKILLed by vLLM's
default shutdown (``--shutdown-timeout 0``) loses no save its steps finished
(completion marks), and ``vllm:kvharbor_stored_chunks`` counts the last commit.
"""

from __future__ import annotations

import signal

import openai
import pytest
from e2e_harness import CHUNK, Lab, bound, start_server, tokens, wait_for_metric

from kvharbor.demo.server import VllmServer

pytestmark = pytest.mark.e2e

PROMPT = tokens(1500, seed=50)
LAST = tokens(1300, seed=51)
"""Sent last before Ctrl-C: its saves are the ones a killed engine could lose."""


def complete(server: VllmServer, prompt: list[int], max_tokens: int = 8) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=server.name, prompt=prompt, max_tokens=max_tokens, temperature=0)


def cached_tokens(answer: openai.types.Completion) -> int:
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return int(answer.usage.prompt_tokens_details.cached_tokens or 0)


def test_restarted_server_restores_the_prompt(lab: Lab, servers: list[VllmServer]) -> None:
    servers.append(start_server(lab))  # Registered first: the fixture stops it whatever happens.
    first = complete(servers[0].wait_ready(), PROMPT)
    assert first.usage is not None and first.usage.prompt_tokens == len(PROMPT)
    assert cached_tokens(first) == 0
    # The engine's counter reaches every chunk with no request after this one: the
    # commit behind the last step is counted too.
    wait_for_metric(servers[0], "vllm:kvharbor_stored_chunks_total", len(PROMPT) // CHUNK)
    last = complete(servers[0], LAST, max_tokens=1)
    assert cached_tokens(last) == 0
    servers[0].stop(signal.SIGINT)  # Ctrl-C right after the response, vLLM's default shutdown (0 s).

    servers.append(start_server(lab))
    again = complete(servers[1].wait_ready(), LAST, max_tokens=1)
    second = complete(servers[1], PROMPT)
    assert cached_tokens(again) == bound(len(LAST)) > 0
    assert cached_tokens(second) == bound(len(PROMPT)) > 0
    assert second.choices[0].text == first.choices[0].text
    assert again.choices[0].text == last.choices[0].text

    # The first server started the embedded gateway; the second attached to it, lingering.
    assert [each.log().count("kvharbor: started an embedded gateway") for each in servers] == [1, 0]
    for each in servers:
        log = each.log()
        assert "kvharbor: 4 cache tensors registered" in log
        assert "external KV cache turned off" not in log
