"""The LMCache front end's peer check on real accepted sockets, with a socket table the test makes up
(TCP) or the kernel's own credentials (Unix sockets): which connections are admitted as which uid, which
are refused, and what a refusal logs and counts."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

import pytest

from mpcache.cache.lmcache import sockets
from mpcache.cache.lmcache.gate import REMOTE, UNKNOWN_UID, PeerGate

LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
SERVICE_UID, ENGINE_UID, STRANGER_UID = os.geteuid(), 1000 if os.geteuid() != 1000 else 1001, 4242


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


class World:
    """A gate over a made-up socket table and clock, and a listener on loopback to connect to."""

    def __init__(self, allowed=(SERVICE_UID, ENGINE_UID), allow_remote: bool = False) -> None:
        self.table: list[sockets.TcpEnd] = []
        self.refused: list[int] = []
        self.unidentified: list[int] = []
        self.log = Log()
        self.now = 0.0
        self.gate = PeerGate(set(allowed), allow_remote=allow_remote, log=self.log,
                             on_refused=lambda: self.refused.append(1),
                             on_unidentified=lambda: self.unidentified.append(1), clock=lambda: self.now,
                             ends=self._find)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]

    def _find(self, local, peer):
        for end in self.table:
            if end.local == peer and end.remote == local:
                return end.uid, end.inode
        return None

    def connect(self, uid: int | None) -> socket.socket:
        """A connection accepted from a client the table says ``uid`` owns (None: absent from the table)."""
        client = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        accepted, _ = self.listener.accept()
        self.sockets += [client, accepted]
        client_port = client.getsockname()[1]
        if uid is not None:
            self.table.append(sockets.TcpEnd((LOOPBACK, client_port), (LOOPBACK, self.port), uid, 100))
        self.table.append(sockets.TcpEnd((LOOPBACK, self.port), (LOOPBACK, client_port), SERVICE_UID, 200))
        return accepted

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def world():
    made = World()
    yield made
    made.close()


def test_an_allowed_connection_is_admitted_as_its_peers_uid(world) -> None:
    assert world.gate.owner(world.connect(ENGINE_UID)) == ENGINE_UID
    assert world.gate.owner(world.connect(SERVICE_UID)) == SERVICE_UID
    assert (world.refused, world.log.lines) == ([], [])


def test_a_foreign_connection_is_refused_counted_and_logged_with_its_uid(world) -> None:
    assert world.gate.owner(world.connect(STRANGER_UID)) is None
    assert world.refused == [1]
    assert [(event, fields["uid"], fields["transport"]) for event, fields in world.log.lines] == [
        ("lmcache.peer_refused", STRANGER_UID, "tcp")]


def test_a_refused_engines_fix_names_its_uid_and_the_caches(world) -> None:
    """An engine of the wrong uid (vLLM's images run as root) sees only "cannot reach the server" (the handshake is
    refused before any message is read, tests/vllm shows it); the log line's fix is the one to act on: the flag
    with that uid, or the cache's own uid to run the engine as."""
    world.gate.owner(world.connect(STRANGER_UID))
    [(_, fields)] = world.log.lines
    assert f"--lmcache-allow-uid {STRANGER_UID}" in fields["fix"]
    assert f"run the engine as uid {os.getuid()}" in fields["fix"]


def test_refusals_log_once_a_minute_per_uid_with_the_count(world) -> None:
    """Every refusal is counted; one line per uid per minute, the next one saying how many were not logged."""
    for _ in range(5):
        world.gate.owner(world.connect(STRANGER_UID))
    world.now = 61.0
    world.gate.owner(world.connect(STRANGER_UID))
    assert len(world.refused) == 6
    assert [fields["suppressed"] for _, fields in world.log.lines] == [0, 4]


def test_a_peer_missing_from_the_table_is_refused(world) -> None:
    """Fail closed: a loopback peer whose end is not in the table is nobody allowed."""
    assert world.gate.owner(world.connect(None)) is None
    assert [fields["uid"] for _, fields in world.log.lines] == [UNKNOWN_UID]


@pytest.mark.parametrize(("allow_remote", "expected"), [(False, UNKNOWN_UID), (True, REMOTE)])
def test_a_non_loopback_peer_is_remote_only_with_allow_remote(allow_remote, expected) -> None:
    world = World(allow_remote=allow_remote)
    try:
        assert world.gate.tcp_owner(("192.0.2.1", 5555), ("192.0.2.7", 40001)) == expected
    finally:
        world.close()


def test_a_peer_that_is_gone_before_its_check_is_closed_and_counted_apart_not_refused(world) -> None:
    """A socket with no peer any more (getpeername fails: reset): closed unanswered, counted as unidentified,
    not as refused, not logged; no traceback."""
    unconnected = socket.socket()
    world.sockets.append(unconnected)
    assert world.gate.owner(unconnected) is None
    assert (world.unidentified, world.refused, world.log.lines) == ([1], [], [])


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_connect_and_close_of_the_services_own_uid_is_counted_apart_not_refused(how) -> None:
    """A health probe (the service's own uid connects and closes, or resets, before its connection is judged)
    against the kernel's real socket table: its closed end has no owner any more, so it cannot be admitted —
    closed unanswered — but it was never refused: it is counted as unidentified and not logged, and the
    refused count (which alerts watch) stays 0."""
    listener = socket.create_server(("127.0.0.1", 0))
    probe = socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=5)
    if how == "reset":
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    probe.close()
    accepted, _ = listener.accept()
    refused: list[int] = []
    unidentified: list[int] = []
    log = Log()
    gate = PeerGate({SERVICE_UID}, allow_remote=False, log=log, on_refused=lambda: refused.append(1),
                    on_unidentified=lambda: unidentified.append(1))
    try:
        assert gate.owner(accepted) is None
        assert (unidentified, refused, log.lines) == ([1], [], [])
    finally:
        accepted.close()
        listener.close()


@pytest.mark.parametrize("allowed_self", [True, False])
def test_ipc_peers_are_named_by_the_kernel(tmp_path, allowed_self) -> None:
    """A Unix-socket peer's uid is SO_PEERCRED's: this process's own uid, admitted only when allowed."""
    allowed = {SERVICE_UID} if allowed_self else {STRANGER_UID}
    refused: list[int] = []
    gate = PeerGate(allowed, allow_remote=True, log=Log(), on_refused=lambda: refused.append(1))
    path = str(tmp_path / "gate.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    accepted, _ = listener.accept()
    try:
        assert gate.owner(accepted) == (SERVICE_UID if allowed_self else None)
        assert refused == ([] if allowed_self else [1])
    finally:
        for sock in (client, accepted, listener):
            sock.close()


def test_the_kernel_table_names_both_ends_of_a_real_connection() -> None:
    """/proc/net/tcp shows a loopback connection made here as a client end owned by this uid whose remote
    end is the listener; the real gate finds its owner from the accepted socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    peer = socket.create_connection(("127.0.0.1", port), timeout=5)
    accepted, _ = listener.accept()
    try:
        mine = [end for end in sockets.ends(port)
                if end.local == (LOOPBACK, peer.getsockname()[1]) and end.remote == (LOOPBACK, port)]
        assert [end.uid for end in mine] == [os.geteuid()]
        gate = PeerGate({os.geteuid()}, allow_remote=False, log=Log(), on_refused=lambda: None)
        assert gate.owner(accepted) == os.geteuid()
    finally:
        for sock in (peer, accepted, listener):
            sock.close()


def _this_hosts_own_address() -> str:
    """A non-loopback address of this host (the source of its default route), or skip."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.1", 9))  # TEST-NET-2: a route lookup, nothing is sent
        address = probe.getsockname()[0]
    except OSError:
        pytest.skip("this host has no default route, so no non-loopback address of its own")
    finally:
        probe.close()
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this host's default route leaves from loopback")
    return address


@pytest.mark.parametrize("end", ["half-closed", "closed"])
def test_a_local_peer_that_ends_its_side_before_the_check_is_never_taken_for_a_remote_one(end) -> None:
    """With ``allow_remote``, a local process connecting to this host's own non-loopback address that
    half-closes (``shutdown(SHUT_WR)``: it can still read replies) or closes before its connection is judged
    has left ESTABLISHED but is still in the table: it is a local peer — of this uid (not allowed here) when
    half-closed, of no known uid when closed (counted apart, as unidentified) — never ``REMOTE``."""
    address = _this_hosts_own_address()
    listener = socket.create_server((address, 0))
    peer = socket.create_connection((address, listener.getsockname()[1]), timeout=5)
    if end == "half-closed":
        peer.shutdown(socket.SHUT_WR)
    else:
        peer.close()
    accepted, _ = listener.accept()
    counts: dict[str, int] = {"refused": 0, "unidentified": 0}
    log = Log()
    gate = PeerGate({STRANGER_UID}, allow_remote=True, log=log, on_refused=lambda: counts.update(refused=1),
                    on_unidentified=lambda: counts.update(unidentified=1))
    try:
        assert gate.owner(accepted) is None
        # a half-closed end still has its file, so its owner; a closed one's owner is not known (fail closed)
        if end == "half-closed":
            assert ({"refused": 1, "unidentified": 0}, [SERVICE_UID]) == (
                counts, [fields["uid"] for _, fields in log.lines])
        else:
            assert ({"refused": 0, "unidentified": 1}, []) == (counts, log.lines)
    finally:
        for sock in (peer, accepted, listener):
            sock.close()
