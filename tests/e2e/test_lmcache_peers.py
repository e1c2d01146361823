"""A foreign local user against a running ``bin/start-cache --lmcache-port``: its connection is refused
before any message is handled, the refusal shows in /metrics and the log, and the service's own user is
served throughout."""

from __future__ import annotations

import json
import socket
import struct

import pytest
from support.lmcache_client import LMClient
from support.ports import free_port
from support.waiting import wait_for


@pytest.mark.slow
def test_a_foreign_uid_is_refused_counted_and_logged(start_service, second_user):
    """The foreign user's ping gets no reply; ``mpcache_lmcache_refused_connections_total{worker="0"}``
    counts it and ``lmcache.peer_refused`` names its uid; the service's own client is answered after."""
    port = free_port()
    service = start_service("--workers", "1", "--lmcache-port", str(port))
    url = f"tcp://127.0.0.1:{port}"
    wait_for(lambda: service.lines("cache.start"), 60, "the cache process to listen")
    own = LMClient(url)
    assert "OK" == own.call("noop")
    attacker = second_user.popen("support.lmcache_attacker", url)
    try:
        attacker.stdin.write(json.dumps({"calls": [["ping", None]], "timeout_s": 3.0}) + "\n")
        attacker.stdin.flush()
        wait_for(lambda: service.lines("lmcache.peer_refused", uid=second_user.uid), 30,
                 "the refusal in the log")
        attacker.stdin.close()
        output = [json.loads(line) for line in attacker.stdout.read().splitlines() if line.startswith("{")]
    finally:
        attacker.kill()
        attacker.wait()
    assert [{"op": "ping", "no_reply": True}] == [line for line in output if "op" in line]
    wait_for(lambda: service.scrape().total("mpcache_lmcache_refused_connections_total", worker="0") >= 1, 30,
             "the refusal counted in /metrics")
    try:
        assert "OK" == own.call("noop")
    finally:
        own.close()


@pytest.mark.slow
def test_health_probes_of_the_services_own_uid_are_never_counted_as_refused(start_service):
    """20 connect-and-close probes (half of them resets) from the service's own uid, as a load balancer's
    health check makes them, then an engine's call: the call is answered and
    ``mpcache_lmcache_refused_connections_total`` stays 0 (the probes used to count as refused peers)."""
    port = free_port()
    service = start_service("--workers", "1", "--lmcache-port", str(port))
    wait_for(lambda: service.lines("cache.start"), 60, "the cache process to listen")
    for index in range(20):
        probe = socket.create_connection(("127.0.0.1", port), timeout=5)
        if index % 2:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        probe.close()
    own = LMClient(f"tcp://127.0.0.1:{port}")  # accepted after every probe: they were judged first
    try:
        assert "OK" == own.call("noop")
    finally:
        own.close()
    assert 0 == service.scrape().total("mpcache_lmcache_refused_connections_total", worker="0")
    assert [] == service.lines("lmcache.peer_refused")
