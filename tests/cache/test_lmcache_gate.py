"""The LMCache front end's peer check, driven with a socket table and monitor events the test makes up:
which connections are shut down, which handshakes are answered as which uid, which wait, and what a
refusal logs and counts."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from mpcache.cache.lmcache import sockets
from mpcache.cache.lmcache.gate import HOLD, REMOTE, PeerGate, descriptor_addresses

LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
PORT = 24555
LISTEN = ("127.0.0.1", PORT)
SERVICE_UID, ENGINE_UID, STRANGER_UID = 0, 1000, 4242


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


class World:
    """A gate over a made-up socket table and clock; ``connect`` is a connection ZeroMQ accepted on a
    descriptor (the monitor's ACCEPTED event)."""

    def __init__(self, allowed=(SERVICE_UID, ENGINE_UID), allow_remote: bool = False) -> None:
        self.table: list[sockets.TcpEnd] = []
        self.refused: list[int] = []
        self.shut: list[int] = []
        self.log = Log()
        self.now = 0.0
        self.gate = PeerGate(set(allowed), LISTEN, allow_remote=allow_remote, log=self.log,
                             on_refused=lambda: self.refused.append(1), handshake_timeout_s=5.0,
                             clock=lambda: self.now, table=lambda: list(self.table), shutdown=self.shut.append,
                             answered=lambda fd: fd in self.answered)
        self.answered: set[int] = set()

    def connect(self, fd: int, uid: int, client_port: int) -> None:
        self.table.append(sockets.TcpEnd((LOOPBACK, client_port), (LOOPBACK, PORT), uid, 100 + fd))
        self.table.append(sockets.TcpEnd((LOOPBACK, PORT), (LOOPBACK, client_port), SERVICE_UID, 200 + fd))
        self.gate.accepted(fd, LISTEN, ("127.0.0.1", client_port))


def test_an_allowed_connection_is_answered_as_its_uid() -> None:
    """The only connection waiting is the one asking: answered as its peer's uid, nothing shut down."""
    world = World()
    world.connect(7, ENGINE_UID, 40001)
    assert world.gate.decide("127.0.0.1") == ENGINE_UID
    assert (world.shut, world.refused) == ([], [])


def test_a_foreign_connection_is_shut_down_and_answers_wait_until_it_is_gone() -> None:
    """A foreign uid's connection is shut down at once, counted and logged with its uid; no handshake is
    answered (HOLD, never a refusal an allowed client would not recover from) until ZeroMQ reports it gone."""
    world = World()
    world.connect(7, ENGINE_UID, 40001)
    world.connect(8, STRANGER_UID, 40002)
    assert (world.shut, world.refused) == ([8], [1])
    assert [fields["uid"] for event, fields in world.log.lines if event == "lmcache.peer_refused"] == [STRANGER_UID]
    assert world.gate.decide("127.0.0.1") == HOLD
    world.gate.disconnected(8)
    assert world.gate.decide("127.0.0.1") == ENGINE_UID


def test_refusals_log_once_a_minute_per_uid_with_the_count() -> None:
    """Every refusal is counted; one line per uid per minute, the next one saying how many were not logged."""
    world = World()
    for fd in range(5):
        world.connect(10 + fd, STRANGER_UID, 40010 + fd)
    world.now = 61.0
    world.connect(20, STRANGER_UID, 40020)
    assert len(world.refused) == 6
    assert [fields["suppressed"] for _, fields in world.log.lines] == [0, 4]


def test_two_allowed_uids_waiting_at_once_are_never_guessed() -> None:
    """Connections of two allowed uids waiting together: which one asks is unknown, so the younger uid's
    are shut down (ZeroMQ reconnects them) and the answer waits; then it is the older uid."""
    world = World()
    world.connect(7, SERVICE_UID, 40001)
    world.now = 0.1
    world.connect(8, ENGINE_UID, 40002)
    assert world.gate.decide("127.0.0.1") == HOLD
    assert world.shut == [8] and world.refused == []
    world.gate.disconnected(8)
    assert world.gate.decide("127.0.0.1") == SERVICE_UID


def test_a_connection_whose_handshake_was_answered_no_longer_waits() -> None:
    """Once a connection's socket has sent more than a greeting, its handshake was answered: another allowed
    uid's new connection is then answered at once, nothing shut down."""
    world = World()
    world.connect(7, SERVICE_UID, 40001)
    assert world.gate.decide("127.0.0.1") == SERVICE_UID
    world.answered.add(7)
    world.connect(8, ENGINE_UID, 40002)
    assert (world.gate.decide("127.0.0.1"), world.shut) == (ENGINE_UID, [])


def test_waiting_connections_expire_after_the_handshake_timeout() -> None:
    """Past the handshake timeout a connection has finished its handshake (or ZeroMQ dropped it): it no longer
    stands beside a new one, and a shut-down one whose end was never reported no longer holds answers."""
    world = World()
    world.connect(7, SERVICE_UID, 40001)
    world.connect(8, STRANGER_UID, 40002)
    world.now = 7.0
    world.connect(9, ENGINE_UID, 40003)
    assert world.gate.decide("127.0.0.1") == ENGINE_UID


def test_descriptors_that_are_not_the_listener_are_never_touched() -> None:
    """An ACCEPTED event whose descriptor now belongs to another socket (reused since) changes nothing."""
    world = World()
    world.table.append(sockets.TcpEnd((LOOPBACK, 40009), (LOOPBACK, 6379), STRANGER_UID, 50))
    world.gate.accepted(9, ("127.0.0.1", 40009), ("127.0.0.1", 6379))
    assert (world.shut, world.refused, world.gate.decide("127.0.0.1")) == ([], [], HOLD)


def test_a_peer_missing_from_the_table_is_refused_unless_remote_peers_are_allowed() -> None:
    """A loopback peer with no end in the table (gone) is shut down; a non-loopback one is REMOTE only with
    --lmcache-allow-remote."""
    closed = World()
    closed.gate.accepted(7, LISTEN, ("127.0.0.1", 40001))
    assert closed.shut == [7]
    for allow_remote, shut, expected in ((False, [7], HOLD), (True, [], REMOTE)):
        world = World(allow_remote=allow_remote)
        world.gate._listen = (ipaddress.IPv4Address("0.0.0.0"), PORT)
        world.gate.accepted(7, ("192.0.2.1", PORT), ("192.0.2.7", 40001))
        assert (world.shut, world.gate.decide("192.0.2.7")) == (shut, expected)


@pytest.mark.parametrize(("uid", "expected"), [(ENGINE_UID, ENGINE_UID), (STRANGER_UID, None)])
def test_ipc_peers_are_named_by_the_kernel(uid, expected) -> None:
    """ZeroMQ passes an ipc:// peer's SO_PEERCRED as localhost:uid:gid:pid: decided at once."""
    world = World()
    assert world.gate.decide(f"localhost:{uid}:100:4321") == expected
    assert world.refused == ([] if expected is not None else [1])


def test_the_kernel_table_and_a_descriptor_name_both_ends_of_a_real_connection() -> None:
    """/proc/net/tcp shows a loopback connection made here as a client end owned by this uid whose remote
    end is the listener; the accepted descriptor's addresses find it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    peer = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    try:
        local, remote = descriptor_addresses(accepted.fileno())
        assert local == ("127.0.0.1", port) and remote == peer.getsockname()
        ends = sockets.established()
        mine = [end for end in ends if end.local == (LOOPBACK, remote[1]) and end.remote == (LOOPBACK, port)]
        assert [end.uid for end in mine] == [os.geteuid()]
        sockets.shutdown_fd(accepted.fileno())
        assert peer.recv(1) == b""  # the peer sees the connection end; the descriptor stays open for its owner
        assert accepted.fileno() >= 0
    finally:
        for sock in (peer, accepted, listener):
            sock.close()


def test_a_connection_that_could_not_be_checked_is_shut_out() -> None:
    """Fail closed: a connection whose peer could not be looked up is shut down, counted, and holds answers
    until it is gone, like a foreign one."""
    world = World()
    world.connect(7, ENGINE_UID, 40001)
    world.gate.refuse_unchecked(8)
    assert (world.shut, world.refused, world.gate.decide("127.0.0.1")) == ([8], [1], HOLD)
    world.gate.disconnected(8)
    assert world.gate.decide("127.0.0.1") == ENGINE_UID
