"""What one client can take from a cache process is bounded: connections, unfinished frames, the size of
an error's echo, file descriptors — and every other client keeps being served."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import msgpack
import pytest
from support.cache_harness import CHUNK_BYTES, MODEL
from support.waiting import wait_for

from mpcache.contract import protocol
from mpcache.errors import RequestError


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def _closed_by_server(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while data := sock.recv(65536):
            del data
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_frame_left_unfinished_closes_that_connection_only(cache):
    """Slowloris: a client that starts a 1 MiB frame and stalls is disconnected after the partial-frame
    timeout (its buffer freed); a client connected all along is served throughout."""
    harness = cache(server_kwargs={"partial_frame_timeout_s": 0.5, "heartbeat_interval_s": 0.1})
    good = harness.client()
    stalled = _raw(harness.config.socket_path(0))
    stalled.sendall(protocol.FRAME_HEADER.pack(protocol.MAX_FRAME_BYTES) + b"\x81" * 1000)
    assert _closed_by_server(stalled)
    assert 0 == good.ping().worker
    stalled.close()


def test_connections_over_the_cap_are_closed_at_accept(cache):
    harness = cache(server_kwargs={"max_connections": 3})
    kept = [harness.client() for _ in range(3)]
    extra = _raw(harness.config.socket_path(0))
    assert _closed_by_server(extra)
    assert [0, 0, 0] == [client.ping().worker for client in kept]
    assert 1 == harness.server.shed_connections
    extra.close()


def test_idle_connections_are_closed_after_the_idle_timeout_so_new_clients_get_in(cache):
    """Connections that send nothing fill the cap (a new one is shed); once they have been idle for
    --idle-timeout the server closes them, and a new client is served.  A client that keeps talking
    meanwhile is never closed."""
    harness = cache(server_kwargs={"max_connections": 3, "heartbeat_interval_s": 0.1}, idle_timeout_s=0.5)
    talking = harness.client()
    idle = [_raw(harness.config.socket_path(0)) for _ in range(2)]
    shed = _raw(harness.config.socket_path(0))
    assert _closed_by_server(shed)

    def idle_ones_closed() -> bool:
        assert 0 == talking.ping().worker  # every poll: never idle for 0.5 s
        return all(_closed_by_server(sock, timeout_s=0.01) for sock in idle)

    wait_for(idle_ones_closed, 10, "the idle connections to be closed", tolerate=())
    assert (0, 0) == (harness.client().ping().worker, talking.generation)
    for sock in [shed, *idle]:
        sock.close()


def test_a_client_whose_idle_connection_was_closed_goes_on_at_its_next_call_without_an_error(cache):
    """The client finds its connection closed before it sends and the same process answering again: no
    CacheConnectionLost, its buffer is registered again, a prefetch job from before the close is retrieved
    into it by the id the caller holds, and ``generation`` stays 0 (every id of the process is still good)."""
    harness = cache(server_kwargs={"heartbeat_interval_s": 0.1}, idle_timeout_s=0.3)
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    assert 2 == client.store(kv, request_id="w", model_name=MODEL, chunk_hashes=[1, 2], block_ids=[0, 1]).stored
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, chunk_hashes=[1, 2])
    assert 2 == client.wait_prefetch(job).found_count
    later = _raw(harness.config.socket_path(0))  # idle since after the client's last call
    assert _closed_by_server(later)
    later.close()
    got = client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3]).retrieved
    assert (2, True, 0) == (got, bool((kv.blocks[:2] == kv.blocks[2:]).all()), client.generation)


def test_an_error_echoes_a_bounded_part_of_a_huge_request(cache):
    """80 000 unexpected keys: the error reply is one short line, the connection stays open."""
    harness = cache()
    client = harness.client()
    message = {"op": "ping", "id": 1, **{f"k{i:06d}xx": 1 for i in range(80_000)}}
    payload = msgpack.packb(message)
    assert len(payload) < protocol.MAX_FRAME_BYTES
    sock = _raw(harness.config.socket_path(0))
    sock.sendall(protocol.FRAME_HEADER.pack(len(payload)) + payload)
    header = sock.recv(4, socket.MSG_WAITALL)
    reply = msgpack.unpackb(sock.recv(protocol.FRAME_HEADER.unpack(header)[0], socket.MSG_WAITALL))
    assert reply["ok"] is False and len(reply["error"]) <= protocol.ERROR_MAX_CHARS
    assert "and 79992 more" in reply["error"]
    assert 0 == client.ping().worker
    sock.close()


RUN_WITH_FEW_FDS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
from mpcache.cache.__main__ import main
sys.exit(main(["--config", sys.argv[1], "--worker", "0"]))
"""


def test_running_out_of_file_descriptors_sheds_new_connections_and_keeps_serving(provisioned, tmp_path):
    """With a 48-descriptor limit, 80 connections: those past the limit are closed at once (no busy loop,
    no crash); once they go, new clients are served again."""
    config = provisioned()
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    process = subprocess.Popen([sys.executable, "-c", RUN_WITH_FEW_FDS, str(path)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        wait_for(lambda: os.path.exists(config.socket_path(0)), timeout_s=5, what="the cache socket", tolerate=())
        socks = [_raw(config.socket_path(0)) for _ in range(80)]
        shed = [s for s in socks[40:] if _closed_by_server(s, timeout_s=2.0)]
        assert shed, "connections past the descriptor limit must be closed"
        assert process.poll() is None
        for s in socks:
            s.close()
        from mpcache.client import CacheClient

        def pings() -> bool:
            try:
                with CacheClient(config.socket_path(0)) as client:
                    return client.ping().worker == 0
            except OSError:
                return False

        wait_for(pings, timeout_s=5, what="a new client to be served again", tolerate=())
        assert process.poll() is None
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
    shed_lines = [json.loads(line) for line in stderr.decode(errors="replace").splitlines()
                  if '"error_type": "resource"' in line]
    assert shed_lines and "no file descriptor left" in shed_lines[0]["error"]


def test_prefetch_jobs_are_bounded_by_the_hashes_they_hold(cache):
    """Lookups that are never retrieved cannot hold more than max_job_hashes chunk hashes between them:
    the oldest jobs give way (their locks released, their ids unknown), the newest stay usable."""
    harness = cache(server_kwargs={"max_job_hashes": 3 * 4096})
    client = harness.client()
    jobs = [client.call("lookup_prefetch", request_id=f"r{i}", model_name="m", cache_salt="",
                        chunk_hashes=list(range(i << 20, (i << 20) + 4096)))["job_id"] for i in range(5)]
    sessions = harness.server.ctx.sessions
    assert 2 == sessions.trimmed
    assert 3 * 4096 == sessions.job_hashes
    for job_id in jobs[:2]:
        with pytest.raises(RequestError, match="unknown or expired prefetch job"):
            client.call("query_prefetch_status", job_id=job_id)
    assert [True, True, True] == [client.call("query_prefetch_status", job_id=job_id)["done"] for job_id in jobs[2:]]
