"""Fixtures for the L2 adapters: adapter factories and a real redis-server (helpers: l2_helpers).

Every adapter a factory makes is closed at teardown; fs directories are pytest
temp dirs.  ``redis_server`` starts one ``redis-server`` on a free loopback
port (no persistence, a temp dir) for the whole ``tests/l2`` run and stops it
at the end; tests that need it are skipped only when the binary is missing.
Each redis adapter a test makes gets a key prefix no other test uses, so tests
sharing the server never see each other's chunks unless they ask to.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from mpcache.cache.l2.base import L2Adapter
from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.cache.l2.mock import MockL2Adapter

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                else None)


# -- redis-server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_redis(directory: str) -> tuple[subprocess.Popen, int]:
    """Start redis-server and return once it logs that it accepts connections."""
    last_log = ""
    for _ in range(5):  # another process may take the port between probe and bind
        port = _free_port()
        process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", directory, "--daemonize", "no", "--logfile", ""],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        log = b""
        deadline = time.monotonic() + 10
        while b"Ready to accept connections" not in log and process.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([process.stdout], [], [], remaining)[0]:
                break
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                break
            log += chunk
        if b"Ready to accept connections" in log:
            # keep draining its log so it never blocks on a full pipe
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, port
        process.kill()
        process.wait()
        process.stdout.close()
        last_log = log.decode(errors="replace")[-2000:]
    raise RuntimeError(f"redis-server did not start:\n{last_log}")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """``redis://127.0.0.1:<port>/0`` of a private redis-server, stopped after the run."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found (install redis-server to run the redis adapter tests)")
    directory = tempfile.mkdtemp(prefix="mpcache-l2-redis-")
    process, port = _start_redis(directory)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


# -- adapter factories --------------------------------------------------------------------------------


@pytest.fixture
def closing() -> Iterator[Callable[[L2Adapter], L2Adapter]]:
    """``closing(adapter)``: close ``adapter`` at teardown (returns it)."""
    adapters: list[L2Adapter] = []

    def register(adapter: L2Adapter) -> L2Adapter:
        adapters.append(adapter)
        return adapter

    yield register
    for adapter in reversed(adapters):
        adapter.close()


@pytest.fixture
def make_fs(tmp_path, closing) -> Callable[..., FsL2Adapter]:
    """``make_fs(capacity_bytes=4000, path=None, **options)``: an fs adapter (default dir: tmp_path/l2)."""

    def make(capacity_bytes: int = 4000, path=None, **options) -> FsL2Adapter:
        return closing(FsL2Adapter(str(path or tmp_path / "l2"), capacity_bytes, **options))

    return make


@pytest.fixture
def make_mock(closing) -> Callable[..., MockL2Adapter]:
    """``make_mock(capacity_bytes=4000, **options)``: a mock adapter."""

    def make(capacity_bytes: int = 4000, **options) -> MockL2Adapter:
        return closing(MockL2Adapter(capacity_bytes, **options))

    return make


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix no other test uses."""
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def make_redis(request, closing, redis_prefix) -> Callable[..., L2Adapter]:
    """``make_redis(capacity_bytes=4000, key_prefix=<this test's>, url=<the server>, **options)``."""
    from mpcache.cache.l2.redis_adapter import RedisL2Adapter

    url = request.getfixturevalue("redis_server")

    def make(capacity_bytes: int = 4000, **options) -> RedisL2Adapter:
        options.setdefault("key_prefix", redis_prefix)
        options.setdefault("url", url)
        return closing(RedisL2Adapter(options.pop("url"), capacity_bytes, **options))

    return make


@pytest.fixture(params=["fs", "mock", "redis"])
def make_adapter(request) -> Callable[..., L2Adapter]:
    """``make_adapter(capacity_bytes=4000)``: each adapter type in turn (redis only with a server)."""
    return request.getfixturevalue(f"make_{request.param}")
