"""``kvharbor status`` against real gateway processes, run as users run it (a subprocess):
what a gateway says, what is said when none answers, and the layout registry across restarts."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway_harness import Lab, closing_client, wait_until
from ops_harness import CHUNK, LAYOUT, kvharbor_cmd, store_prompt, tree, two_tier_config

from kvharbor.cache.keys import chunk_keys
from kvharbor.gateway.client import GatewayClient
from kvharbor.gateway.layouts import read_registry_file, registry_path
from kvharbor.gateway.query import GatewayQuery
from kvharbor.gateway.status import AttachedClient, GatewayStatus

PROMPT = list(range(800))
"""Three full chunks of 256 and a tail."""


def test_status_names_the_gateway_its_clients_hit_rate_tiers_and_layouts(lab: Lab) -> None:
    config = two_tier_config(lab)
    gateway = lab.gateway(config).start()
    with closing_client(GatewayClient.connect(gateway.config.gateway, "engine-a", layouts=[LAYOUT])) as engine:
        assert store_prompt(engine, PROMPT) == 3
        assert engine.lookup(chunk_keys(LAYOUT.digest(), CHUNK, PROMPT), CHUNK) == 3
        assert engine.lookup(chunk_keys(LAYOUT.digest(), CHUNK, PROMPT[1:]), CHUNK) == 0
        human = kvharbor_cmd("status", "--config", str(config))
        assert human.returncode == 0, human.stderr
        for line in (
            f"pid {gateway.pid}, release",
            "1 attached: 'engine-a'",
            "recent 300 s: 50.0% (768 of 1536 tokens)",
            "total: 50.0% (768 of 1536 tokens), 2 lookups",
            "ram [ram]: ok;",
            "files [file]: ok;",
            f"{LAYOUT.short()}: by 'engine-a'",
            ", this run; objects: ram 3, files 3\n",
            "start-clean=0",
        ):
            assert line in human.stdout, (line, human.stdout)
        machine = kvharbor_cmd("status", "--config", str(config), "--json")
        assert machine.returncode == 0, machine.stderr
        status = GatewayStatus.from_json(machine.stdout)
    assert status.pid == gateway.pid and status.socket == gateway.config.gateway.socket
    assert status.clients == [AttachedClient("engine-a", os.getpid())], "a status query attaches no client"
    assert (status.hit_rate.hit_tokens, status.hit_rate.lookup_tokens, status.hit_rate.lookups) == (768, 1536, 2)
    assert [(t.name, t.keys, status.tier_conditions()[t.name], t.layouts) for t in status.store.tiers] == [
        ("ram", 3, "ok", {LAYOUT.digest().hex(): 3}),
        ("files", 3, "ok", {LAYOUT.digest().hex(): 3}),
    ]
    (layout,) = status.layouts
    assert layout.fingerprint == LAYOUT and layout.digest == LAYOUT.digest().hex() and layout.this_run
    assert not status.start_clean and status.ranks_cache_off == []
    # The engine's connection closed while its process lives on: a rank with its cache off
    # (asked without attaching, as the CLI asks: an attached client of this pid would hide it).
    with GatewayQuery.connect(gateway.config.gateway) as query:
        wait_until(lambda: bool(query.status().ranks_cache_off), "the gateway sees the engine detach")
        (off,) = query.status().ranks_cache_off
    assert (off.name, off.pid, off.unclean) == ("engine-a", os.getpid(), False)


@contextmanager
def impostor(path: Path, listen: bool, answer: bytes = b"") -> Iterator[None]:
    """A Unix socket at ``path`` that is no gateway's: bound but not listening (refused),
    or a server that answers ``answer`` to whatever it is sent."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    done = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(answer)
            done.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    if listen:
        server.listen(1)
        thread.start()
    try:
        yield
    finally:
        done.set()
        server.close()
        if listen:
            thread.join(30)
        path.unlink()


def test_with_no_gateway_status_says_why_exits_1_and_shows_the_file_tier_on_disk(lab: Lab) -> None:
    config = two_tier_config(lab)
    gateway = lab.gateway(config).start()
    with closing_client(GatewayClient.connect(gateway.config.gateway, "engine-a", layouts=[LAYOUT])) as engine:
        assert store_prompt(engine, PROMPT) == 3
    assert gateway.stop() == 0
    files = lab.tmp_path / "gw" / "files"
    before = tree(files)
    sock = Path(gateway.config.gateway.socket)

    missing = kvharbor_cmd("status", "--config", str(config))
    assert missing.returncode == 1
    assert f"kvharbor: no gateway answers at {sock}: socket missing" in missing.stderr
    assert f"files at {files}: 3 objects" in missing.stdout and LAYOUT.short() in missing.stdout
    report = json.loads(kvharbor_cmd("status", "--config", str(config), "--json").stdout)
    assert report["absence"] == "socket missing" and report["socket"] == str(sock)
    (tier,) = report["on_disk"]
    assert (tier["name"], tier["objects"], tier["problem"]) == ("files", 3, "")
    assert [layout["digest"] for layout in tier["layouts"]] == [LAYOUT.digest().hex()]

    with impostor(sock, listen=False):
        refused = kvharbor_cmd("status", "--config", str(config))
    assert refused.returncode == 1 and "connection refused: nothing listens on" in refused.stderr
    assert f"files at {files}: 3 objects" in refused.stdout

    with impostor(sock, listen=True, answer=b"HTTP/1.1 400 Bad Request\r\n\r\n"):
        garbage = kvharbor_cmd("status", "--config", str(config))
    assert garbage.returncode == 1 and "not a gateway:" in garbage.stderr, garbage.stderr
    assert "Traceback" not in garbage.stderr and f"files at {files}: 3 objects" in garbage.stdout

    sock.write_text("a stray file")
    stray = kvharbor_cmd("status", "--config", str(config))
    assert stray.returncode == 1 and f"not a socket: {sock} is not a Unix socket" in stray.stderr
    assert tree(files) == before, "status read the tier without changing it"


def test_the_layout_registry_survives_a_restart_and_start_clean_empties_it(lab: Lab) -> None:
    config = two_tier_config(lab)
    first = lab.gateway(config).start()
    with closing_client(GatewayClient.connect(first.config.gateway, "engine-a", layouts=[LAYOUT])):
        pass
    assert first.stop() == 0
    registry = registry_path(lab.tmp_path / "gw" / "files")
    assert [layout.fingerprint for layout in read_registry_file(registry)] == [LAYOUT]

    again = lab.gateway(config).start()
    with closing_client(again.client("observer")) as observer:
        (layout,) = observer.status().layouts
    assert layout.fingerprint == LAYOUT and layout.registered_by == "engine-a" and not layout.this_run
    assert again.stop() == 0

    clean = lab.gateway(config, "--start-clean=1").start()
    with closing_client(clean.client("observer")) as observer:
        status = observer.status()
    assert status.start_clean and status.layouts == []
    assert read_registry_file(registry) == [], "the emptied tier's registry names no layout"
    prompt = lab.tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, PROMPT)))
    doctor = kvharbor_cmd("doctor", "--config", str(config), "--prompt-file", str(prompt))
    assert doctor.returncode == 1, doctor.stderr
    assert "problem  start_clean: the gateway was started with --start-clean=1" in doctor.stdout
    assert "problem  engine: no engine registered a layout with this gateway" in doctor.stdout
    assert "problem  layout: no registered layout has engine.key_namespace 'default'" in doctor.stdout
