"""Security properties of a live service.

* every shared-memory object, socket and file the service creates is private to the user running it
  (0600 files and sockets, 0700 directories), even under ``umask 0``, and so is a client's KV buffer;
* ``/metrics`` listens on loopback unless ``--prometheus-host`` says otherwise;
* no pickle on the client channel: a pickled request is refused with an error reply and never
  unpickled.  (That the package imports no pickle at all is tests/test_layering.py's job.)
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
import stat
import urllib.request
from pathlib import Path

import msgpack
import psutil
import pytest
from support.service import Service
from support.waiting import wait_for

from mpcache.client import CacheClient
from mpcache.contract import protocol

pytestmark = pytest.mark.slow

CHUNK = 4096


def started_as_an_operator_would(directory: Path, *flags: str, host: str | None = None) -> Service:
    """A service started the way an operator would: runtime dir left to the supervisor's default
    (``<tmp>/mpcache-<uid>/<pid>``), started under ``umask 0`` so that only the service's own modes
    decide who may read what."""
    return Service(directory, *flags, runtime_dir=False, umask=0, host=host)


def last_pid(service: Service, role: str) -> int | None:
    """The pid of the child last started in ``role`` (None before the log says so)."""
    pids = service.pids(role, index=None)
    return pids[-1] if pids else None


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One running 1-worker service for the module, stopped (or killed) at the end."""
    running = started_as_an_operator_would(tmp_path_factory.mktemp("security"), "--workers", "1",
                                           "--chunk-bytes", "4KiB", "--l1-size", "4MiB")
    try:
        running.ready(1)
        yield running
        assert 0 == running.stop()
    finally:
        running.teardown()


def _private(path: str | Path) -> tuple[int, int]:
    """(permission bits, owner uid) of a path, not following a final symlink."""
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid


def test_shared_memory_sockets_and_dirs_are_private_even_under_umask_0(service) -> None:
    """Under umask 0: the instance's 4 shared-memory objects (gauge board, telemetry state, event ring, L1 pool)
    are 0600 and owned by the running user, the cache socket is a socket, 0600 and owned by the user, the runtime
    dir and its parent are 0700, the child config file is 0600, and a client's KV buffer is 0600."""
    uid = os.getuid()
    entries = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"mpcache.{service.process.pid}."))
    sock = service.runtime_dir / "cache0.sock"
    previous = os.umask(0)
    try:
        with CacheClient(str(sock)) as client:
            kv = client.register_buffer(2, CHUNK)
            info = os.fstat(kv.fd)  # a memfd: no name in /dev/shm
            buffer_mode = stat.S_IMODE(info.st_mode), info.st_uid
            del kv
    finally:
        os.umask(previous)

    assert 4 == len(entries)
    assert {name: (0o600, uid) for name in entries} == {name: _private("/dev/shm/" + name) for name in entries}
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert (0o600, uid) == _private(sock)
    assert [(0o700, uid), (0o700, uid)] == [_private(service.runtime_dir), _private(service.runtime_dir.parent)]
    assert (0o600, uid) == _private(service.runtime_dir / "config.json")
    assert (0o600, uid) == buffer_mode


def _non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def _listening(pid: int | None) -> set[tuple[str, int]]:
    """The (address, port) pairs a process listens on (empty for no process)."""
    try:
        connections = psutil.Process(pid).net_connections(kind="inet") if pid else []
    except psutil.NoSuchProcess:
        return set()
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


def test_metrics_listens_on_loopback_only_by_default(service) -> None:
    """Without --prometheus-host the supervisor (its HTTP front) listens on exactly 127.0.0.1:<port> and
    nowhere else; neither telemetry (it serves the front through a 0600 socket in the runtime dir) nor any
    cache process listens on any network socket."""
    assert {("127.0.0.1", service.port)} == _listening(service.process.pid)
    assert (set(), set()) == (_listening(last_pid(service, "telemetry")), _listening(last_pid(service, "cache")))
    assert (0o600, os.getuid()) == _private(service.runtime_dir / "telemetry.sock")


def test_metrics_refuses_connections_on_a_non_loopback_address(service) -> None:
    """A connection to /metrics' port on the machine's non-loopback IPv4 address is refused."""
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect to")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, service.port), timeout=5).close()


def test_prometheus_host_flag_binds_where_it_says(tmp_path) -> None:
    """--prometheus-host <non-loopback address> serves /metrics on that address and only there (a
    connection to 127.0.0.1 is refused); without such an address, 0.0.0.0 is checked to listen on all."""
    address = _non_loopback_ipv4() or "0.0.0.0"
    bound = started_as_an_operator_would(tmp_path, "--workers", "1", "--chunk-bytes", "4KiB", "--l1-size", "4MiB",
                                         host=address)
    try:
        wait_for(lambda: _listening(bound.process.pid), 60, "the supervisor to listen")
        assert {(address, bound.port)} == _listening(bound.process.pid)
        if address != "0.0.0.0":
            url = f"http://{address}:{bound.port}/metrics"
            text = wait_for(lambda: urllib.request.urlopen(url, timeout=5).read(), 30, "/metrics on " + address)
            assert b"lmcache_mp_active_prefetch_jobs" in text
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", bound.port), timeout=5).close()
        assert 0 == bound.stop()
    finally:
        bound.teardown()


class _Exploit:
    """Unpickling this would create the marker file: proof the payload was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_requests_are_refused_with_an_error_reply_and_never_unpickled(service, tmp_path) -> None:
    """A frame whose payload is a pickle (protocols 0 to 5 of a ping request, and one whose unpickling
    would create a file) gets ok=False, error_type "protocol" and "malformed frame"; the file is never
    created, and the same connection then answers a msgpack ping."""
    marker = tmp_path / "unpickled"
    payloads = [pickle.dumps({"op": "ping", "id": 1}, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    payloads.append(pickle.dumps({"op": "ping", "id": 1, "x": _Exploit(marker)}))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(service.runtime_dir / "cache0.sock"))
    reader = sock.makefile("rb")

    def reply() -> dict:
        (length,) = protocol.FRAME_HEADER.unpack(reader.read(4))
        return msgpack.unpackb(reader.read(length), raw=False)

    try:
        answers = []
        for payload in payloads:
            sock.sendall(protocol.FRAME_HEADER.pack(len(payload)) + payload)
            answer = reply()
            answers.append((answer["ok"], answer["error_type"], "malformed frame" in answer["error"]))
        sock.sendall(protocol.encode_frame({"op": "ping", "id": 9}))
        pong = reply()
    finally:
        reader.close()
        sock.close()

    assert [(False, "protocol", True)] * len(payloads) == answers
    assert (True, 9) == (pong["ok"], pong["id"])
    assert not marker.exists()
