"""Bad scenario files are refused before anything runs, naming the file, the line and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvharbor.cli import main
from kvharbor.scenario.catalog import shipped
from kvharbor.scenario.schema import ScenarioError, load_scenario, parse_scenario

HEAD = "name: bad\nsymptom: s\nreplays: r\n"


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            "steps:\n  - start_gateway: {}\n  - explode: {}\n  - expect: {cache_off: false}\n",
            "x.yaml:6: steps[1]: unknown action 'explode'",
        ),
        (
            "steps:\n  - start_gateway: {}\n  - send: {prompts: [{name: a, tokens: 10}]}\n"
            "  - expect: {cache_off: false}\n",
            "x.yaml:6: steps[1].send: the engine is not running here",
        ),
        (
            "setup: {card: {}}\nsteps:\n  - target_up: {}\n  - expect: {cache_off: false}\n",
            "x.yaml:6: steps[0].target_up: the target was never taken down",
        ),
        ("steps:\n  - start_gateway: {}\n  - start_engine: {}\n", "x.yaml:1: steps: no expectations"),
        (
            "steps:\n  - start_gateway: {}\n  - expect: {cached_tokenz: {eq: 0}}\n",
            "x.yaml:6: steps[1].expect.cached_tokenz: unknown key",
        ),
        (
            "steps:\n  - start_gateway: {}\n  - expect:\n      log:\n        - {source: gateway, contain: x}\n",
            "x.yaml:8: steps[1].expect.log[0].contain: unknown key",
        ),
        ("setup: {ram_mbs: 3}\nsteps:\n  - expect: {cache_off: false}\n", "x.yaml:4: setup.ram_mbs: unknown key"),
        (
            "steps:\n  - kill_gateway: {}\n  - expect: {cache_off: true}\n",
            "x.yaml:5: steps[0].kill_gateway: the gateway is not running here",
        ),
        (
            "steps:\n  - fill_card: {ratio: 1}\n  - expect: {cache_off: true}\n",
            "x.yaml:5: steps[0].fill_card: needs the simulated card",
        ),
        ("steps:\n  - expect: {}\n", "x.yaml:5: steps[0].expect: Value error, an expect step needs at least one of"),
        (
            "steps:\n  - start_gateway: {}\n  - start_engine: {}\n  - send: {prompts: [{name: a, tokens: 10}]}\n"
            "  - expect: {same_output: true}\n",
            "x.yaml:8: steps[3].expect: same_output needs the vllm driver",
        ),
        (
            "steps:\n  - wait_status: {field: store.tiers.ram.keys, range: {min: 1}}\n  - expect: {cache_off: true}\n",
            "x.yaml:5: steps[0].wait_status: the gateway is not running here",
        ),
        (
            "setup: {driver: vllm, engine: {kv_dtype: float16}}\nsteps:\n  - expect: {cache_off: true}\n",
            "x.yaml:4: setup: Value error, engine: the vllm driver cannot set kv_dtype",
        ),
        (
            "setup: {driver: vllm}\nsteps:\n  - start_gateway: {}\n  - start_engine: {}\n"
            "  - restart_engine: {release: 0.0.1, chunk_size: 512}\n  - expect: {cache_off: true}\n",
            "x.yaml:8: steps[2].restart_engine: the vllm driver cannot set release",
        ),
        (
            "setup: {card: {device: file}}\nsteps:\n  - supercap: {ok: false}\n  - expect: {cache_off: true}\n",
            "x.yaml:6: steps[0].supercap: needs the simulated card (setup.card with device: sim)",
        ),
        (
            "setup: {card: {device: file, supercap_ok: false}}\nsteps:\n  - expect: {cache_off: true}\n",
            "x.yaml:4: setup.card: Value error, supercap_ok: only the simulated card has it (device: sim)",
        ),
        (
            "setup: {card: {device: file}}\nsteps:\n  - start_gateway: {}\n  - set_card: {fragment_bytes: 1048576}\n"
            "  - expect: {cache_off: true}\n",
            "x.yaml:7: steps[1].set_card: the gateway is already running here",
        ),
        (
            "steps:\n  - set_card: {fragment_bytes: 1048576}\n  - expect: {cache_off: true}\n",
            "x.yaml:5: steps[0].set_card: needs a card tier",
        ),
        ("steps: [\n", "x.yaml:"),
    ],
)
def test_a_bad_scenario_is_refused_naming_file_line_and_key(body: str, said: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(HEAD + body, "x.yaml")
    assert str(caught.value).startswith(said), str(caught.value)


def test_the_cli_refuses_a_bad_file_with_exit_2_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(HEAD + "steps:\n  - start_gateway: {}\n  - explode: {}\n  - expect: {cache_off: false}\n")
    assert main(["scenario", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"kvharbor: error: {path}:6: steps[1]: unknown action 'explode'" in err and "Traceback" not in err


def test_every_shipped_scenario_is_valid_and_names_its_seed_symptom() -> None:
    files = shipped()
    assert len(files) >= 20
    for path in files:
        scenario = load_scenario(path)
        assert scenario.name == path.stem and scenario.replays


def test_a_failing_expectation_exits_1_and_says_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fails.yaml"
    path.write_text(HEAD + "steps:\n  - expect: {gateway_running: true}\n")
    assert main(["scenario", "run", str(path)]) == 1
    out = capsys.readouterr().out
    assert "scenario bad" in out and "FAIL" in out and "[FAIL] gateway_running is True: False" in out
