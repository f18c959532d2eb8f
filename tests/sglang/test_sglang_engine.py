"""A real SGLang engine with kvharbor as its HiCache storage: a restarted engine reads the
prompt back from kvharbor.

Two engine processes (`engine_rig`: SGLang's offline `Engine` on the CPU, the tiny random
Llama the tests build, ``KVHARBOR=1``) run one after the other. The first answers the
prompt, flushes SGLang's own caches and answers it again from storage; its gateway exits
with it (``gateway.linger_s: 0``). The second starts a new gateway and reads the prompt
back from the file tier. SGLang on CPU needs the test shims (tests/sglang/shims: two
stand-in modules and four small patches, each documented there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.engine_rig import ENGINE_WAIT_S, PROMPT_TOKENS, bound_tokens, run_engine, write_config

pytestmark = pytest.mark.timeout(2 * ENGINE_WAIT_S + 60)


def test_a_restarted_sglang_engine_reads_the_prompt_back_from_kvharbor(tiny_model: Path, tmp_path: Path) -> None:
    model = tiny_model
    config = write_config(tmp_path)
    cold, flushed = run_engine(model, config, asks=2, log=tmp_path / "engine-1.log")
    assert (cold.cached_tokens, cold.storage_tokens) == (0, 0), "a new cache hits nothing"
    # SGLang's device and host caches flushed: the same prompt is read back from kvharbor.
    assert flushed.storage_backend == "KVHarborStorage"
    assert flushed.storage_tokens == flushed.cached_tokens == bound_tokens(PROMPT_TOKENS)
    assert flushed.output_ids == cold.output_ids
    log = (tmp_path / "engine-1.log").read_text()
    assert "kvharbor: KVHARBOR=1: kvharbor is SGLang's HiCache storage backend" in log
    assert any(p.is_file() for p in (tmp_path / "files").rglob("*")), "the pages reached the file tier"

    (restarted,) = run_engine(model, config, asks=1, log=tmp_path / "engine-2.log")
    assert restarted.storage_tokens == restarted.cached_tokens == bound_tokens(PROMPT_TOKENS)
    assert restarted.output_ids == cold.output_ids
