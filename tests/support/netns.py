"""Test hosts as network namespaces: each its own network stack, joined by a bridge.

`HostNet` makes one namespace per host name, each with a veth pair whose other end
is on a bridge in the test's own namespace, and an address of a /24 of its own
(the bridge holds ``.254``, so the test reaches every host). Names start with a
unique prefix so that tests side by side never meet; `close` removes them all
(a namespace's end of each pair goes with it, the bridge last).

Processes run in a host with `prefix` (``ip netns exec NAME``): only the network
differs, so the filesystem (a gateway's socket, /dev/shm) is the same for all.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import uuid

IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str) -> None:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def netns_works() -> str | None:
    """None when namespaces can be made here; else why not (the error of ``ip netns add``)."""
    name = f"kvhp{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
    except (RuntimeError, OSError) as err:
        return str(err)
    _ip("netns", "del", name)
    return None


class HostNet:
    def __init__(self, hosts: list[str]) -> None:
        self.tag = f"kvh{uuid.uuid4().hex[:6]}"
        """Prefix of every name made here (interface names hold 15 characters)."""
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(0, 255)}"
        self.bridge = f"{self.tag}br"
        self.gateway_address = f"{subnet}.254"
        self.addresses: dict[str, str] = {}
        self.namespaces: dict[str, str] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for number, host in enumerate(hosts):
                self._add(number, host, f"{subnet}.{number + 1}")
        except BaseException:
            self.close()
            raise

    def _add(self, number: int, host: str, address: str) -> None:
        namespace = f"{self.tag}-{host}"
        outside, inside = f"{self.tag}{number}a", f"{self.tag}{number}b"
        _ip("netns", "add", namespace)
        self.namespaces[host] = namespace
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")  # Loopback servers (a dashboard) need it.
        self.addresses[host] = address

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a process in ``host``."""
        return [IP, "netns", "exec", self.namespaces[host]]

    def close(self) -> None:
        for namespace in self.namespaces.values():
            subprocess.run([IP, "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run([IP, "link", "del", self.bridge], capture_output=True, timeout=30)
        self.namespaces.clear()
