"""The LMCache front end's peer check, decided from a socket table the test writes: which handshakes are
accepted as which uid, which are refused, and what a refusal logs and counts."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from mpcache.cache.lmcache import sockets
from mpcache.cache.lmcache.gate import REMOTE, PeerGate

LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
PORT = 24555
SERVICE_UID, ENGINE_UID, STRANGER_UID = 0, 1000, 4242


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def client(port: int, uid: int, inode: int) -> sockets.TcpEnd:
    """A client's end of a loopback connection to the listener."""
    return sockets.TcpEnd((LOOPBACK, port), (LOOPBACK, PORT), uid, inode)


def server(port: int, inode: int) -> sockets.TcpEnd:
    """The listener's end of the same connection (owned by the service)."""
    return sockets.TcpEnd((LOOPBACK, PORT), (LOOPBACK, port), SERVICE_UID, inode)


@pytest.fixture
def gate():
    table: list[sockets.TcpEnd] = []
    refused: list[int] = []
    log = Log()
    now = [0.0]
    made = PeerGate({SERVICE_UID, ENGINE_UID}, ("127.0.0.1", PORT), allow_remote=False, log=log,
                    on_refused=lambda: refused.append(1), clock=lambda: now[0], table=lambda: list(table))
    return made, table, refused, log, now


def test_one_waiting_connection_is_accepted_as_its_owner(gate) -> None:
    """The only connection not accepted before is the one asking: accepted as its uid, and only once."""
    decide, table, refused, _, _ = gate
    table += [client(40001, ENGINE_UID, 11), server(40001, 12)]
    assert decide.decide("127.0.0.1") == ENGINE_UID
    assert decide.decide("127.0.0.1") is None  # nothing is waiting any more: a second ask is not trusted
    assert refused == []


def test_a_foreign_connection_waiting_refuses_every_handshake(gate) -> None:
    """While a foreign uid's connection waits, no handshake is accepted (the allowed one retries), and the
    refusal is counted and logged naming the foreign uid."""
    decide, table, refused, log, _ = gate
    table += [client(40001, ENGINE_UID, 11), client(40002, STRANGER_UID, 13)]
    assert decide.decide("127.0.0.1") is None
    assert refused == [1]
    assert [fields["uid"] for event, fields in log.lines if event == "lmcache.peer_refused"] == [STRANGER_UID]
    table.remove(client(40002, STRANGER_UID, 13))  # the foreign connection is gone: the allowed one retries
    assert decide.decide("127.0.0.1") == ENGINE_UID


def test_refusals_log_once_a_minute_per_uid_with_the_count(gate) -> None:
    """Every refusal is counted; one line per uid per minute, the next one saying how many were not logged."""
    decide, table, refused, log, now = gate
    table.append(client(40002, STRANGER_UID, 13))
    for _ in range(5):
        decide.decide("127.0.0.1")
    now[0] = 61.0
    decide.decide("127.0.0.1")
    assert len(refused) == 6
    assert [fields["suppressed"] for _, fields in log.lines] == [0, 4]


def test_connections_accepted_before_do_not_count(gate) -> None:
    """An accepted connection stays accounted for while it lives: a later engine connection is judged
    alone; a new connection of another allowed uid next to a waiting one of a third uid is not guessed."""
    decide, table, _, _, _ = gate
    table.append(client(40001, SERVICE_UID, 11))
    assert decide.decide("127.0.0.1") == SERVICE_UID
    table.append(client(40003, ENGINE_UID, 15))
    assert decide.decide("127.0.0.1") == ENGINE_UID
    table += [client(40004, SERVICE_UID, 17), client(40005, ENGINE_UID, 19)]
    assert decide.decide("127.0.0.1") is None  # two allowed uids waiting: which one asks is unknown


def test_connections_to_other_ports_and_the_listener_ends_are_ignored(gate) -> None:
    """Only client ends of connections to this listener count: a foreign uid's connection elsewhere, and
    the service's own ends of accepted connections, change nothing."""
    decide, table, _, _, _ = gate
    elsewhere = sockets.TcpEnd((LOOPBACK, 40010), (LOOPBACK, 6379), STRANGER_UID, 21)
    table += [elsewhere, server(40001, 12), client(40001, ENGINE_UID, 11)]
    assert decide.decide("127.0.0.1") == ENGINE_UID


def test_ipc_peers_are_named_by_the_kernel(gate) -> None:
    """ZeroMQ passes an ipc:// peer's SO_PEERCRED as localhost:uid:gid:pid."""
    decide, _, refused, _, _ = gate
    assert decide.decide(f"localhost:{ENGINE_UID}:100:4321") == ENGINE_UID
    assert decide.decide(f"localhost:{STRANGER_UID}:100:4321") is None
    assert refused == [1]


def test_remote_peers_only_with_allow_remote() -> None:
    """A non-loopback peer is accepted (as REMOTE) only when the operator allowed remote peers."""
    for allow_remote, expected in ((False, None), (True, REMOTE)):
        gate = PeerGate({SERVICE_UID}, ("0.0.0.0", PORT), allow_remote=allow_remote, log=Log(),
                        on_refused=lambda: None, table=list)
        assert gate.decide("192.0.2.7") == expected


def test_the_kernel_table_shows_both_ends_of_a_real_connection() -> None:
    """Parsing /proc/net/tcp: a loopback connection made here appears as a client end owned by this uid
    (remote = the listener) and a server end (local = the listener)."""
    import os

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    peer = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    try:
        ends = sockets.established()
        mine = [end for end in ends if end.remote == (LOOPBACK, port) and end.local[1] == peer.getsockname()[1]]
        theirs = [end for end in ends if end.local == (LOOPBACK, port)]
        assert [end.uid for end in mine] == [os.geteuid()]
        assert [end.remote[1] for end in theirs] == [peer.getsockname()[1]]
        inodes = sockets.own_socket_inodes()
        assert mine[0].inode in inodes and theirs[0].inode in inodes
    finally:
        for sock in (peer, accepted, listener):
            sock.close()
