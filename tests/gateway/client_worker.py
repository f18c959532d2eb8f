"""A gateway client in a process of its own, driven by the gateway tests.

    python client_worker.py MODE CONFIG [ARGS...]

It says what it is doing on stdout, one line at a time, so the test can act
(SIGKILL it, kill the gateway) at a known point; then it waits for its stdin
to close, the test's cue to end.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from gateway_harness import (
    FINGERPRINT,
    VALUE_BYTES,
    fill,
    get_values,
    keys_of,
    put_values,
    roundtrip,
    shared_items,
    value_for,
)

from kvharbor.config import load_config
from kvharbor.gateway import embedded
from kvharbor.gateway import protocol as p
from kvharbor.gateway.client import GatewayClient, GatewayError
from kvharbor.gateway.protocol import PutCommit
from kvharbor.gateway.wire import send_message

# Run as a script, this file's folder is on the path, not the repository's (where `tests` is).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.as_user import ENV, become


def say(text: str) -> None:
    print(text, flush=True)


def wait_for_cue() -> None:
    sys.stdin.read()


def main(mode: str, config_path: str, *args: str) -> int:
    if ENV in os.environ:
        become(os.environ[ENV])  # A client of another user (tests/support/as_user.py).
    config = load_config(config_path, environ={})
    if mode == "embedded":
        client = embedded.connect(config, "worker")
        started = client.hello.gateway_pid in embedded.started_here()
        say(f"{client.hello.gateway_pid} {'started' if started else 'attached'}")
        if args and args[0] == "put":
            # Values for the next engine, then the cue to end.
            put_values(client, [(key, VALUE_BYTES) for key in keys_of(int(args[1]))])
            say("stored")
        elif args and args[0] == "commit-and-die":
            # A commit in flight when this client dies: sent, its answer never read (the test SIGKILLs us).
            items = [(key, VALUE_BYTES) for key in keys_of(int(args[1]))]
            batch = client.prepare_put(FINGERPRINT, items)
            fill(batch, items)
            send_message(client._sock, PutCommit(batch.batch, []), 999)
            say("committing")
        elif args == ("fork",):
            # A child of the engine (a worker it forks) that outlives it, holding
            # copies of its descriptors but not its pipes to the test; it ends on SIGTERM.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            child = os.fork()
            if child == 0:
                for fd in (0, 1, 2):
                    os.close(fd)
                signal.sigwait({signal.SIGTERM})
                os._exit(0)
            say(f"{child}")
        wait_for_cue()
        try:
            client.lookup([FINGERPRINT])
            say("lookup-ok")
        except GatewayError as err:
            say(f"gateway-error {type(err).__name__}")
        return 0
    if mode == "embedded-store":
        # An engine of its own config: stores values, then (on its cue) looks them up again.
        tag, count = int(args[0]), int(args[1])
        items = [(key, 1000 + i) for i, key in enumerate(keys_of(count, tag))]
        client = embedded.connect(config, f"worker-{tag}")
        say(f"{client.hello.gateway_pid} {config.gateway.socket} stored {put_values(client, items)}")
        wait_for_cue()
        try:
            say(f"holds {client.lookup([key for key, _ in items])}")
        except GatewayError as err:
            say(f"gateway-error {type(err).__name__}")
        return 0
    if mode == "probe":
        # Whether this process (maybe of another user) may use the gateway: a round trip, or the reason.
        try:
            client = embedded.connect(config, "probe")
            say(f"admitted: checked {roundtrip(client, 7, shared_items(), 1)}")
        except GatewayError as err:
            say(f"refused {type(err).__name__}: {err}")
        wait_for_cue()
        return 0
    client = GatewayClient.connect(config.gateway, f"worker-{mode}")
    if mode == "roundtrip":
        say(f"checked {roundtrip(client, int(args[0]), shared_items(), int(args[1]))}")
    elif mode == "put-forever":
        # Key n = n.to_bytes(16), one value per put, each acknowledged once stored, until killed.
        nbytes = int(args[0])
        for n in range(1 << 30):
            key = n.to_bytes(16, "big")
            stored = put_values(client, [(key, nbytes)])
            say(f"stored {n} {stored}")
    elif mode == "hold-put":
        nbytes, count = int(args[0]), int(args[1])
        items = [(bytes([i]) * 16, nbytes) for i in range(count)]
        batch = client.prepare_put(FINGERPRINT, items)
        for view, (key, size) in zip(batch.views, items, strict=True):
            assert view is not None, "the test sizes the ring for this batch"
            view[: size // 2] = value_for(key, size)[: size // 2]  # Half-written when killed.
        say("prepared")
        wait_for_cue()
    elif mode == "marked-put":
        # The five fates of a value whose writer dies before the commit, one per value.
        nbytes = int(args[0])
        items = [(bytes([0xA0 + i]) * 16, nbytes) for i in range(5)]
        batch = client.prepare_put(FINGERPRINT, items)
        views = [view for view in batch.views if view is not None]
        assert len(views) == len(items) and batch.marks is not None, "the test sizes the ring for this batch"
        batch.write(0, value_for(*items[0]))  # Copied with its checksum, marked with it.
        views[1][:] = value_for(*items[1])
        batch.mark(1)  # Filled by other means (a gather, a DMA), marked without a checksum.
        views[2][: nbytes // 2] = value_for(*items[2])[: nbytes // 2]  # Half-written, unmarked.
        batch.write(3, value_for(*items[3]))
        views[3][0] ^= 0xFF  # Damaged after its writer took the checksum.
        views[4][:] = value_for(*items[4])
        p.write_mark(batch.marks, 4, batch.offsets[0], nbytes, None)  # Names another value's place.
        say("prepared")
        wait_for_cue()
    elif mode == "hold-get":
        keys = [bytes.fromhex(k) for k in args]
        held = client.get(FINGERPRINT, keys)
        say(f"holding {len(held.views)}")
        wait_for_cue()
    elif mode == "get-stream":
        # Gets until the gateway fails; the test kills it mid-stream.
        items = [(bytes.fromhex(k), int(n)) for k, n in (a.split(":") for a in args)]
        keys = [k for k, _ in items]
        rounds = 0
        try:
            while True:
                for value, (key, size) in zip(get_values(client, keys), items, strict=False):
                    assert value == value_for(key, size)
                rounds += 1
                if rounds == 3:
                    say("streaming")
        except GatewayError as err:
            say(f"gateway-error {type(err).__name__} after {rounds} rounds")
        wait_for_cue()
    else:
        raise SystemExit(f"unknown mode {mode}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
