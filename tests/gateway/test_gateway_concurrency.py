"""Many clients at once, in threads and processes, against one real gateway."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from gateway_harness import GatewayProcess, Lab, closing_client, roundtrip, shared_items

pytestmark = pytest.mark.timeout(120)

THREADS = 8
PROCESSES = 4
ROUNDS = 15


def test_many_clients_read_back_exactly_what_was_written(lab: Lab, started: Callable[..., GatewayProcess]) -> None:
    gateway = started(ring_mb=16)  # Small enough that transfers compete for room.
    config_path = gateway.config_path
    workers = [lab.worker("roundtrip", str(config_path), str(100 + i), str(ROUNDS)) for i in range(PROCESSES)]
    errors: list[BaseException] = []
    checked: list[int] = []

    def client_thread(seed: int) -> None:
        try:
            with closing_client(gateway.client(f"thread-{seed}")) as client:
                checked.append(roundtrip(client, seed, shared_items(), ROUNDS))
        except BaseException as err:  # Reported below, with the others.
            errors.append(err)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    assert not errors, errors
    assert len(checked) == THREADS and all(n > 0 for n in checked)
    for worker in workers:
        code, out, err = worker.finish()
        assert code == 0, err
        assert out.startswith("checked "), out

    with closing_client(gateway.client()) as client:
        status = client.status()
    assert status.counters["clients_total"] == THREADS + PROCESSES + 1
    assert status.rejected == {}
    assert status.shm.free_bytes == status.shm.ring_bytes, "every transfer gave its room back"
    assert status.shm.in_place_bytes == 0, "every put written in place was committed"
    assert status.transfers_open == 0


def test_one_client_shared_by_threads(started: Callable[..., GatewayProcess]) -> None:
    """A client used by several threads at once (requests are serialised per connection)."""
    gateway = started()
    errors: list[BaseException] = []
    with closing_client(gateway.client()) as client:

        def work(seed: int) -> None:
            try:
                roundtrip(client, seed, shared_items(), 10)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
