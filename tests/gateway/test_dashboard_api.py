"""The dashboard's HTTP API against a real gateway process, over real HTTP.

One gateway with a token serves the read-only tests; the config-edit tests and the
start-up decisions (ports taken, a bind beyond loopback) start gateways of their own.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from dashboard_harness import TOKEN, Ports, http, ports_of, raw_request
from gateway_harness import (
    FINGERPRINT,
    GatewayProcess,
    Lab,
    closing_client,
    keys_of,
    put_values,
    wait_for_exit,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

from kvharbor import __version__
from kvharbor.config import load_config
from kvharbor.gateway.client import GatewayClient, GatewayRefused
from kvharbor.gateway.protocol import PROTOCOL_VERSION
from kvharbor.gateway.status import GatewayStatus

UNAUTHORIZED = {"error": "unauthorized"}
BAD_HOST = {"error": "bad Host header"}
CHUNK_TOKENS = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, Ports]]:
    lab = Lab(tmp_path_factory.mktemp("dashboard"))
    try:
        dashboard = {"auth_token": TOKEN, "history_interval_s": 0.1, "log_lines_max": 50}
        gateway = lab.gateway(lab.config(dashboard=dashboard)).start()
        ports = ports_of(gateway)
        assert ports is not None and ports.metrics is not None, gateway.log()
        yield gateway, ports
    finally:
        lab.close()


def lookups(gateway: GatewayProcess, hits: int, misses: int) -> None:
    """One LOOKUP of ``hits`` stored keys followed by ``misses`` absent ones, through a real client."""
    with closing_client(gateway.client("lookups")) as client:
        stored = keys_of(hits, tag=7)
        put_values(client, [(key, 1000) for key in stored])
        client.lookup(stored + keys_of(misses, tag=8), CHUNK_TOKENS)


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, by name and labels, parsed by prometheus_client's own parser."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def test_every_endpoint_answers(served: tuple[GatewayProcess, Ports]) -> None:
    gateway, ports = served
    with http(ports.dashboard) as web:
        page = web.get("/", params={"token": TOKEN})
        assert page.status_code == 200 and "<title>kvharbor</title>" in page.text
        assert f"static/dashboard.js?token={TOKEN}" in page.text, "the page's own files need the token too"
        assert web.get(f"/static/dashboard.js?token={TOKEN}").status_code == 200
        assert "uPlot" in web.get("/static/vendor/uplot/uPlot.iife.min.js").text
        status = GatewayStatus.from_json(web.get("/api/status").text)  # The one JSON form of the status.
        assert status.pid == gateway.pid and status.dashboard_url == f"http://127.0.0.1:{ports.dashboard}/"
        assert status.metrics_url == f"http://127.0.0.1:{ports.metrics}/metrics"
        history = web.get("/api/history").json()
        assert history["interval_s"] == 0.1 and list(history["tiers"]) == ["ram"]
        assert len(history["t"]) == len(history["hit_rate"]) == len(history["tiers"]["ram"]["used_bytes"]) >= 1
        lines = [line["message"] for line in web.get("/api/log").json()["lines"]]
        assert any(line.startswith("kvharbor: dashboard at http://127.0.0.1:") for line in lines), lines
        assert web.get("/healthz").json() == {"status": "ok"}
        assert web.get("/readyz").json() == {"status": "ready"}
        config = web.get("/api/config").json()
        assert config["path"] == str(gateway.config_path) and config["allow_config_edit"] is False
        assert config["config"]["dashboard"]["history_interval_s"] == 0.1


def test_history_shows_the_hit_rate_of_each_interval(served: tuple[GatewayProcess, Ports]) -> None:
    gateway, ports = served
    lookups(gateway, hits=3, misses=1)
    with http(ports.dashboard) as web:

        def rates() -> list[float]:
            return [rate for rate in web.get("/api/history").json()["hit_rate"] if rate is not None]

        wait_until(lambda: 0.75 in rates(), "a sample with the lookup's hit rate (3 of 4 chunks)")
        used = web.get("/api/history").json()["tiers"]["ram"]["used_bytes"]
        assert used[-1] >= 3 * 1000, "the values just stored count in the RAM tier's usage"


def test_metrics_parse_on_both_ports(served: tuple[GatewayProcess, Ports]) -> None:
    gateway, ports = served
    assert ports.metrics is not None
    with http(ports.dashboard) as web, http(ports.metrics) as scraper:
        before = samples(web.get("/metrics").text)
        lookups(gateway, hits=1, misses=1)
        for port_client in (web, scraper):
            answer = port_client.get("/metrics")
            assert answer.headers["content-type"].startswith("text/plain")
            found = samples(answer.text)
            info = f"kvharbor_gateway_info{{protocol={PROTOCOL_VERSION},release={__version__}}}"
            assert found[info] == 1, sorted(found)[:20]
            for name, grew in (("kvharbor_lookups_total{}", 1), ("kvharbor_lookup_tokens_total{}", 2 * CHUNK_TOKENS)):
                assert found[name] == before.get(name, 0) + grew, name
        assert scraper.get("/api/status").status_code == 404, "the Prometheus port serves /metrics alone"


def test_the_token_is_required(served: tuple[GatewayProcess, Ports]) -> None:
    _, ports = served
    assert ports.metrics is not None
    paths = ["/", "/api/status", "/api/history", "/api/log", "/api/config", "/static/dashboard.js", "/metrics"]
    for port, path in [*((ports.dashboard, path) for path in paths), (ports.metrics, "/metrics")]:
        with http(port, token=None) as anonymous, http(port, token="wrong") as wrong:
            for answer in (anonymous.get(path), wrong.get(path), anonymous.get(path, params={"token": "wrong"})):
                assert answer.status_code == 401 and answer.json() == UNAUTHORIZED, (port, path)
            assert anonymous.get(path, params={"token": TOKEN}).status_code == 200, (port, path)
    with http(ports.dashboard, token=None) as probe:
        assert probe.get("/healthz").status_code == 200, "probes need no token"
        assert probe.get("/readyz").status_code == 200


def test_the_host_header_is_checked(served: tuple[GatewayProcess, Ports]) -> None:
    _, ports = served
    with http(ports.dashboard) as web:
        for host in ("evil.example", "127.0.0.2", "localhost.evil.example"):
            answer = web.get("/api/status", headers={"Host": f"{host}:{ports.dashboard}"})
            assert answer.status_code == 403 and answer.json() == BAD_HOST, host
        assert web.get("/api/status", headers={"Host": f"LOCALHOST:{ports.dashboard}"}).status_code == 200
        assert web.get("/healthz", headers={"Host": "10.1.2.3:9400"}).status_code == 200, "a kubelet's probe"


def test_config_edit_is_refused_unless_allowed(served: tuple[GatewayProcess, Ports]) -> None:
    gateway, ports = served
    before = gateway.config_path.read_bytes()
    with http(ports.dashboard) as web:
        for body in ('{"engine": {"chunk_size": 512}}', "{not json", "x" * 3_000_000):
            answer = web.post("/api/config", content=body)
            assert answer.status_code == 403 and "dashboard.allow_config_edit" in answer.json()["error"]
    assert gateway.config_path.read_bytes() == before


def test_malformed_and_oversized_requests_are_refused(served: tuple[GatewayProcess, Ports]) -> None:
    gateway, ports = served
    port = ports.dashboard
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    head = b"GET /api/status HTTP/1.1\r\nHost: localhost\r\n" + auth
    # Over dashboard.request_header_bytes_max (16 KiB), arriving at once: the guard's 431.
    large = raw_request(port, head + b"X: " + b"a" * 20_000 + b"\r\n\r\n")
    assert large.startswith(b"HTTP/1.1 431 ") and b"dashboard.request_header_bytes_max" in large, large[:300]
    # Far over it: uvicorn stops buffering, answers 400 and hangs up (maybe resetting before we read).
    huge = raw_request(port, head + b"X: " + b"a" * 1_000_000 + b"\r\n\r\n")
    assert huge == b"" or huge.startswith(b"HTTP/1.1 400 "), huge[:300]
    assert b"Traceback" not in large + huge
    tls_hello = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"
    for garbage in (tls_hello, b"GET\r\n\r\n", b"NOT HTTP AT ALL\r\n\r\n"):
        answer = raw_request(port, garbage)
        assert answer.startswith(b"HTTP/1.1 400 ") and b"Traceback" not in answer, answer[:200]
    with http(port) as web:
        assert web.get("/nowhere").json() == {"error": "Not Found"}
        wrong_method = web.delete("/api/status")
        assert wrong_method.status_code == 405 and wrong_method.json() == {"error": "Method Not Allowed"}
        assert web.put("/api/config", content="{}").status_code == 405
        # The gateway, and its dashboard, serve on.
        assert web.get("/api/status").json()["pid"] == gateway.pid
    lookups(gateway, hits=1, misses=0)


# -- config edits (gateways of their own) --------------------------------------


def editable(lab: Lab, **dashboard: object) -> tuple[GatewayProcess, Ports]:
    gateway = lab.gateway(lab.config(dashboard={"auth_token": TOKEN, "allow_config_edit": True, **dashboard})).start()
    ports = ports_of(gateway)
    assert ports is not None, gateway.log()
    return gateway, ports


def test_a_config_edit_applies_live_keys_at_once_and_writes_the_file(lab: Lab) -> None:
    gateway, ports = editable(lab)
    patch = {"dashboard": {"auth_token": "new-token"}, "gateway": {"clients_max": 1}, "engine": {"chunk_size": 512}}
    with http(ports.dashboard) as web:
        answer = web.post("/api/config", json=patch)
        assert answer.status_code == 200, answer.text
    outcome = answer.json()
    assert outcome["applied_now"] == ["dashboard.auth_token", "gateway.clients_max"]
    assert outcome["at_next_start"] == ["engine.chunk_size"]
    assert outcome["written"] == str(gateway.config_path)
    written = load_config(gateway.config_path, environ={})
    assert written.dashboard.auth_token == "new-token"
    assert (written.gateway.clients_max, written.engine.chunk_size) == (1, 512)
    assert yaml.safe_load(gateway.config_path.read_text())["storage"]["tiers"][0]["name"] == "ram", "the rest is kept"
    # dashboard.auth_token: at once.
    with http(ports.dashboard) as old, http(ports.dashboard, token="new-token") as new:
        assert old.get("/api/status").status_code == 401
        assert new.get("/api/status").status_code == 200
        assert new.get("/api/config").json()["config"]["engine"]["chunk_size"] == 256, "at the next start"
    # gateway.clients_max: at once; a second client is refused while one is attached.
    with closing_client(gateway.client("first")) as first:
        with pytest.raises(GatewayRefused, match="BUSY"):
            gateway.client("second")
        assert first.lookup([FINGERPRINT]) == 0


def test_allow_config_edit_turned_off_applies_at_once(lab: Lab) -> None:
    _, ports = editable(lab)
    with http(ports.dashboard) as web:
        assert web.post("/api/config", json={"dashboard": {"allow_config_edit": False}}).status_code == 200
        answer = web.post("/api/config", json={"dashboard": {"allow_config_edit": True}})
        assert answer.status_code == 403 and "dashboard.allow_config_edit" in answer.json()["error"]


def test_a_bad_config_edit_changes_nothing(lab: Lab) -> None:
    gateway, ports = editable(lab, request_body_bytes_max=4096)
    before = gateway.config_path.read_bytes()
    refusals = {
        '{"engine": {"chunk_size": -1}}': (400, "engine.chunk_size"),
        '{"engine": {"chunk_sise": 512}}': (400, "engine.chunk_sise"),
        '{"dashboard": {"host": "0.0.0.0", "auth_token": null}}': (400, "dashboard.auth_token is not set"),
        '{"storage": {"tiers": [{"name": "x", "type": "tape", "capacity_gb": 1}]}}': (400, "unknown tier type"),
        "[1, 2]": (400, "must be a JSON object"),
        "{not json": (400, "not JSON"),
        '{"engine": {"key_namespace": "' + "n" * 5000 + '"}}': (413, "dashboard.request_body_bytes_max (4096 bytes)"),
    }
    with http(ports.dashboard) as web:
        for body, (status, named) in refusals.items():
            answer = web.post("/api/config", content=body)
            assert answer.status_code == status and named in answer.json()["error"], (body[:60], answer.text)

        def chunks() -> Iterator[bytes]:  # No Content-Length: the limit holds while reading.
            yield b'{"engine": {"key_namespace": "'
            yield b"n" * 8192
            yield b'"}}'

        assert web.post("/api/config", content=chunks()).status_code == 413
        assert web.get("/api/config").json()["config"]["engine"]["chunk_size"] == 256
    assert gateway.config_path.read_bytes() == before
    lookups(gateway, hits=1, misses=0)


# -- start-up decisions --------------------------------------------------------


def test_ports_taken_leave_the_gateway_serving(lab: Lab) -> None:
    with socket.socket() as dashboard_port, socket.socket() as metrics_port:
        for sock in (dashboard_port, metrics_port):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        taken, metrics_taken = dashboard_port.getsockname()[1], metrics_port.getsockname()[1]
        first = lab.gateway(lab.config("a", telemetry={"prometheus": {"port": metrics_taken}})).start()
        ports = ports_of(first)
        assert ports is not None and ports.metrics is None
        assert f"kvharbor: prometheus port {metrics_taken} unavailable (address already in use); /metrics is " \
               "still on the dashboard port" in first.log()  # fmt: skip
        with http(ports.dashboard, token=None) as web:
            assert "kvharbor_lookups_total" in web.get("/metrics").text
        second = lab.gateway(lab.config("b", dashboard={"port": taken})).start()
        assert ports_of(second) is None
        assert f"kvharbor: dashboard port {taken} unavailable (address already in use)" in second.log()
        lookups(second, hits=1, misses=0)


def test_a_bind_beyond_loopback_needs_a_token(lab: Lab) -> None:
    bare = lab.gateway(lab.config("bare", dashboard={"host": "0.0.0.0"})).start()
    assert ports_of(bare) is None
    assert "kvharbor: dashboard not started: dashboard.host 0.0.0.0 is not a loopback address and " \
           "dashboard.auth_token is not set" in bare.log()  # fmt: skip
    lookups(bare, hits=1, misses=0)
    guarded = lab.gateway(lab.config("guarded", dashboard={"host": "0.0.0.0", "auth_token": TOKEN})).start()
    ports = ports_of(guarded)
    assert ports is not None
    with http(ports.dashboard) as web:
        assert web.get("/api/status").json()["pid"] == guarded.pid


def test_dashboard_disabled(lab: Lab) -> None:
    gateway = lab.gateway(lab.config(dashboard={"enabled": False})).start()
    assert ports_of(gateway) is None
    assert "dashboard at" not in gateway.log()


@pytest.mark.parametrize("missing", ["uvicorn", "starlette"])
def test_a_gateway_without_the_web_stack_serves_engines(lab: Lab, tmp_path: Path, missing: str) -> None:
    """An install that left out the dashboard's packages (seen on a GPU image without uvicorn):
    no dashboard, said once naming the package; engines are served as ever."""
    shadow = tmp_path / "without"
    shadow.mkdir()
    absent = f"raise ModuleNotFoundError(\"No module named '{missing}'\", name={missing!r})\n"
    (shadow / f"{missing}.py").write_text(absent)
    path = os.pathsep.join([str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])])
    gateway = lab.gateway(lab.config(), prefix=["env", f"PYTHONPATH={path}"]).start()
    assert ports_of(gateway) is None
    assert gateway.log().count(f"kvharbor: dashboard not started: {missing} is not installed") == 1
    assert "Traceback" not in gateway.log()
    with closing_client(gateway.client("engine")) as client:
        stored = keys_of(3, tag=9)
        put_values(client, [(key, 1000) for key in stored])
        assert client.lookup(stored, CHUNK_TOKENS) == 3


def test_the_dashboard_stops_with_the_gateway(lab: Lab, tmp_path: Path) -> None:
    gateway = lab.gateway(lab.config()).start()
    ports = ports_of(gateway)
    assert ports is not None
    assert gateway.stop() == 0
    with pytest.raises(httpx.ConnectError), http(ports.dashboard) as web:
        web.get("/healthz")


def test_an_embedded_gateway_serves_the_dashboard_too(lab: Lab) -> None:
    config_path = lab.config(mode="embedded", linger_s=0, dashboard={"auth_token": TOKEN})
    config = load_config(config_path, environ={})
    lab.shm.add((Path(config.gateway.shm_dir), config.gateway.shm_name))
    starter = lab.worker("embedded", str(config_path))
    gateway_pid = int(starter.line().split()[0])
    lab.detached.add(gateway_pid)
    with closing_client(GatewayClient.connect(config.gateway, "look")) as client:
        url = client.status().dashboard_url
    assert url is not None
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as web:
        assert web.get("/api/status").json()["pid"] == gateway_pid
        # Its file: the copy of the engine's config the starter wrote beside the socket.
        assert web.get("/api/config").json()["path"] == str(
            Path(config.gateway.socket).with_suffix(".sock.config.json")
        )
        starter.kill()
        wait_for_exit(gateway_pid)
        with pytest.raises(httpx.ConnectError):
            web.get("/healthz")
