"""Who may connect: ``gateway.access``, tried with a second local user.

The tests run as root (here and in CI) and create the user ``kvharbor-test``
and the group ``kvharbor-test-peers`` if absent; real client processes run as
that user (tests/support/as_user.py: started by root, they drop to it for
good before they connect), and a real gateway runs as it to show that the
credential check, not only the file modes, refuses others.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import GatewayProcess, Lab, segments_of, write_config

from kvharbor.config import load_config
from kvharbor.connector.link import CacheLink, RankSwitch
from kvharbor.gateway.client import AccessDenied, GatewayClient
from tests.support import as_user

pytestmark = pytest.mark.timeout(90)

USER = "kvharbor-test"
PEERS = "kvharbor-test-peers"


@dataclass(frozen=True)
class OtherUser:
    uid: int
    gid: int
    """Its own primary group."""
    peers_gid: int
    """A group it may be given as a supplementary one."""

    def spec(self, member: bool = False) -> str:
        return as_user.spec(self.uid, self.gid, [self.gid, self.peers_gid] if member else [self.gid])

    def popen(self, member: bool = False) -> dict[str, Any]:
        """`Worker` arguments that make the client process this user's, in `PEERS` or not."""
        return {"env": {**os.environ, as_user.ENV: self.spec(member)}}

    def prefix(self) -> list[str]:
        """A command prefix that runs ``python -m kvharbor ...`` as this user (a gateway)."""
        return [sys.executable, as_user.__file__, self.spec(), "--"]


def _ensure(kind: str, name: str, create: list[str]) -> None:
    if subprocess.run(["getent", kind, name], capture_output=True).returncode != 0:
        subprocess.run(create, check=True, capture_output=True)


@pytest.fixture(scope="module")
def other_user() -> OtherUser:
    if os.geteuid() != 0:
        pytest.skip("creates a local user and runs processes as it: needs root (as in CI)")
    _ensure("group", PEERS, ["groupadd", "--system", PEERS])
    _ensure("passwd", USER, ["useradd", "--system", "--user-group", "--no-create-home", "--groups", PEERS, USER])
    entry = pwd.getpwnam(USER)
    return OtherUser(entry.pw_uid, entry.pw_gid, grp.getgrnam(PEERS).gr_gid)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is root's alone)."""
    directory = Path(tempfile.mkdtemp(prefix="kvh-acc-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def serve(lab: Lab, shared: Path, name: str = "gw", prefix: list[str] | None = None, **gateway: Any) -> GatewayProcess:
    return lab.gateway(write_config(shared / name, **gateway), prefix=prefix).start()


def probe(lab: Lab, gateway: GatewayProcess, popen: dict[str, Any]) -> str:
    """What a client process (of ``popen``'s user) says: ``admitted: ...`` or ``refused Class: reason``."""
    return lab.worker("probe", str(gateway.config_path), **popen).line()


def test_another_user_is_refused_by_default_with_a_reason(lab: Lab, shared: Path, other_user: OtherUser) -> None:
    gateway = serve(lab, shared)
    socket = gateway.config.gateway.socket
    (segment,) = segments_of(gateway.config)
    assert mode(socket) == mode(segment) == 0o600, "owner-only"
    said = probe(lab, gateway, other_user.popen(member=True))
    assert said.startswith("refused AccessDenied: permission denied on the gateway socket " + socket)
    assert f"user {USER} (uid {other_user.uid})" in said
    assert "gateway.access.users" in said and "gateway.access.group" in said, "names the setting"


def test_a_group_admits_its_members_and_only_them(lab: Lab, shared: Path, other_user: OtherUser) -> None:
    gateway = serve(lab, shared, access={"group": PEERS})
    (segment,) = segments_of(gateway.config)
    lock = Path(gateway.config.gateway.socket + ".lock")
    for path in (gateway.config.gateway.socket, segment, lock):
        assert (mode(path), os.stat(path).st_gid) == (0o660, other_user.peers_gid), path
    # A member by a supplementary group puts and gets through the shared memory.
    assert probe(lab, gateway, other_user.popen(member=True)).startswith("admitted: checked ")
    said = probe(lab, gateway, other_user.popen(member=False))
    assert said.startswith("refused AccessDenied: permission denied on the gateway socket")


def test_listed_users_are_admitted(lab: Lab, shared: Path, other_user: OtherUser) -> None:
    """By uid or name: POSIX ACL entries grant exactly them the socket and the segment."""
    gateway = serve(lab, shared, access={"users": [USER]})
    (segment,) = segments_of(gateway.config)
    assert mode(segment) == 0o660 and os.stat(segment).st_gid == 0, "the group bits are the ACL's mask"
    assert os.getxattr(segment, "system.posix_acl_access")
    assert probe(lab, gateway, other_user.popen()).startswith("admitted: checked ")
    # Narrowed again, the next gateway on that socket leaves no grant of the old setting behind
    # (its lock file is the old one's).
    lock = gateway.config.gateway.socket + ".lock"
    old_lock = os.stat(lock).st_ino
    assert gateway.stop() == 0
    narrowed = serve(lab, shared)
    assert narrowed.config.gateway.socket + ".lock" == lock and os.stat(lock).st_ino == old_lock
    assert "system.posix_acl_access" not in os.listxattr(lock) and mode(lock) == 0o600
    assert probe(lab, narrowed, other_user.popen()).startswith("refused AccessDenied")


def test_the_gateway_checks_credentials_not_only_file_modes(
    lab: Lab, shared: Path, other_user: OtherUser, caplog: pytest.LogCaptureFixture
) -> None:
    """root passes any file mode; the gateway (run as the other user, owner-only) still
    refuses it, from SO_PEERCRED, naming the setting. The engine's link turns its cache
    off once and keeps answering (misses)."""
    config_path = write_config(shared / "service")
    os.chown(config_path.parent, other_user.uid, other_user.gid)  # Where it makes its socket and lock.
    gateway = lab.gateway(config_path, prefix=other_user.prefix()).start()
    section = gateway.config.gateway
    assert os.stat(section.socket).st_uid == other_user.uid
    with pytest.raises(AccessDenied) as caught:
        GatewayClient.connect(section, "root-engine")
    message = str(caught.value)
    assert message.startswith(f"ACCESS_DENIED: the gateway at {section.socket}")
    assert "user root (uid 0)" in message and f"gateway.access is owner-only: only user {USER}" in message
    assert "gateway.access.users" in message

    link = CacheLink(gateway.config, "root-engine", switch=RankSwitch())
    with caplog.at_level(logging.ERROR, logger="kvharbor.connector"):
        assert not link.start()
        assert link.lookup([b"k" * 16], 256).hits == 0
    assert "ACCESS_DENIED" in link.off_reason
    (said,) = [r.message for r in caplog.records if "external KV cache turned off on this rank" in r.message]
    assert "gateway.access is owner-only" in said
    assert gateway.log().count("refused a client") == 1, "said once per user, not per attempt"


def test_a_segment_the_user_may_not_open_is_explained(lab: Lab, shared: Path, other_user: OtherUser) -> None:
    gateway = serve(lab, shared, access={"group": PEERS})
    (segment,) = segments_of(gateway.config)
    segment.chmod(0o600)  # By hand: the socket admits the user, the segment does not.
    said = probe(lab, gateway, other_user.popen(member=True))
    assert said.startswith(f"refused AccessDenied: permission denied on the gateway's shared memory {segment}")
    assert "gateway.access" in said


def test_a_socket_directory_the_user_cannot_write_is_explained(lab: Lab, shared: Path, other_user: OtherUser) -> None:
    locked = shared / "root-only"
    locked.mkdir(mode=0o755)
    # An engine of that user in embedded mode cannot start a gateway there...
    config_path = write_config(shared / "engine", mode="embedded", socket=str(locked / "sub" / "gw.sock"))
    lab.shm.add((Path("/dev/shm"), load_config(config_path, environ={}).gateway.shm_name))
    said = lab.worker("probe", str(config_path), **other_user.popen()).line()
    assert said.startswith(f"refused GatewayError: cannot start an embedded gateway: {locked / 'sub'}")
    assert "choose a gateway.socket in a directory this user can write" in said
    # ...and neither can `kvharbor gateway` run as that user.
    service = lab.gateway(write_config(shared / "svc", socket=str(locked / "gw.sock")), prefix=other_user.prefix())
    service.start(expect_ready=False)
    assert service.wait() == 2
    assert f"cannot open the gateway's lock {locked / 'gw.sock.lock'} (Permission denied)" in service.log()
    assert "check gateway.socket" in service.log()


def test_a_group_the_gateway_user_is_not_in_stops_the_start(lab: Lab, shared: Path, other_user: OtherUser) -> None:
    config_path = write_config(shared / "service", access={"group": "root"})
    os.chown(config_path.parent, other_user.uid, other_user.gid)
    gateway = lab.gateway(config_path, prefix=other_user.prefix())
    gateway.start(expect_ready=False)
    assert gateway.wait() == 2
    assert "the gateway's user is not a member of gateway.access.group 'root'" in gateway.log()
    assert not segments_of(gateway.config), "nothing left behind"
