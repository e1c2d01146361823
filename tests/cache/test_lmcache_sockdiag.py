"""The kernel's owner of one TCP socket, asked by its address pair (sock_diag): checked against what the
socket's own descriptor says (``fstat``'s inode, this process's uid), over IPv4, IPv6 and IPv4-mapped IPv6."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from mpcache.cache.lmcache import sockets
from mpcache.cache.lmcache.sockdiag import EndOwners, SockDiag, end


@pytest.mark.parametrize(("family", "listen_on", "connect_to"), [
    (socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET6, "::1", "::1"),
    (socket.AF_INET6, "::", "127.0.0.1")])  # a dual-stack listener: the accepted end's addresses are v4-mapped
def test_the_kernel_names_the_owner_and_inode_of_a_connections_other_end(family, listen_on, connect_to) -> None:
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6")
    listener = socket.create_server((listen_on, 0), family=family, dualstack_ipv6=listen_on == "::")
    client = socket.create_connection((connect_to, listener.getsockname()[1]), timeout=5)
    accepted, _ = listener.accept()
    owners = EndOwners()
    try:
        local, peer = end(accepted.getsockname()), end(accepted.getpeername())
        assert owners.peer_end(local, peer) == (os.geteuid(), os.fstat(client.fileno()).st_ino)
        # the same end, as the socket table has it (the slow way, kept for kernels without sock_diag)
        assert [(e.uid, e.inode) for e in sockets.ends(local[1]) if e.local == peer and e.remote == local] == [
            (os.geteuid(), os.fstat(client.fileno()).st_ino)]
        client.close()  # closed: still found, with no file (inode 0), so no owner to trust
        found = owners.peer_end(local, peer)
        assert found is not None and found[1] == 0
    finally:
        owners.close()
        for sock in (client, accepted, listener):
            sock.close()


def test_no_such_socket_is_none() -> None:
    diag = SockDiag()
    loopback = ipaddress.IPv4Address("127.0.0.1")
    try:
        with socket.create_server(("127.0.0.1", 0)) as unused:
            port = unused.getsockname()[1]
        assert diag.owner((loopback, port), (loopback, 1)) is None
    finally:
        diag.close()
