"""Fixtures for the L2 adapters: adapter factories and a real redis-server (helpers: support.l2).

Every adapter a factory makes is closed at teardown; fs directories are pytest
temp dirs.  ``redis_server`` starts one ``redis-server`` on a free loopback
port (no persistence, a temp dir) for the whole ``tests/l2`` run and stops it
at the end; tests that need it are skipped only when the binary is missing.
Each redis adapter a test makes gets a key prefix no other test uses, so tests
sharing the server never see each other's chunks unless they ask to.
``other_user`` is a second local user (``mpcache-other``, created when absent
and we are root) for tests where someone else owns a file or directory.
"""

from __future__ import annotations

import os
import pwd
import select
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from support.ports import free_port

from mpcache.cache.l2.base import L2Adapter
from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.cache.l2.mock import MockL2Adapter

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                else None)


# -- redis-server ----------------------------------------------------------------------------------


def _start_redis(directory: str, config: Callable[[int], str] | None = None) -> tuple[subprocess.Popen, int]:
    """Start redis-server and return once it logs that it accepts connections.  ``config(port)``, if given,
    is the text of a configuration file to start it with (it must set that port)."""
    last_log = ""
    for _ in range(5):  # another process may still take the port between probe and bind: new port, again
        port = free_port()
        argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", directory, "--daemonize", "no", "--logfile", ""]
        if config is not None:
            config_path = os.path.join(directory, "redis.conf")
            with open(config_path, "w", encoding="utf-8") as handle:
                handle.write(config(port))
            argv = [REDIS_SERVER, config_path]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


class SecuredRedis:
    """A redis-server that wants a password (``requirepass``), knows an ACL user limited to one key pattern,
    and, where openssl and the server's TLS support allow, also listens with TLS (``tls_port``)."""

    root_password = "root-pw-7d1e"
    user, user_password = "mpcache", "mpcache-pw-9c4a"
    acl_prefix = "acl-tier:"  # the user may touch keys matching acl-tier:* only

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.port = 0
        self.tls_port: int | None = None
        self.tls_skip_reason = ""
        self.ca = os.path.join(directory, "ca.crt")
        self.client_cert = os.path.join(directory, "client.crt")
        self.client_key = os.path.join(directory, "client.key")

    def acl_line(self) -> str:
        """The ACL docs/L2.md recommends, for this user and prefix."""
        return (f"user {self.user} on >{self.user_password} resetkeys ~{self.acl_prefix}* resetchannels "
                "-@all +@read +@write +@scripting +ping +hello")

    def make_certificates(self) -> bool:
        """A CA, a server certificate for IP 127.0.0.1 and a client certificate; False without openssl."""
        openssl = shutil.which("openssl")
        if openssl is None:
            self.tls_skip_reason = "openssl not found: cannot make certificates for the TLS test"
            return False
        d = self.directory
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        steps = [
            [openssl, "req", "-x509", *ec, "-days", "1", "-subj", "/CN=mpcache-test-ca", "-keyout",
             f"{d}/ca.key", "-out", self.ca],
            [openssl, "req", *ec, "-subj", "/CN=127.0.0.1", "-keyout", f"{d}/server.key", "-out", f"{d}/server.csr"],
            [openssl, "x509", "-req", "-in", f"{d}/server.csr", "-CA", self.ca, "-CAkey", f"{d}/ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", f"{d}/server.ext", "-out", f"{d}/server.crt"],
            [openssl, "req", *ec, "-subj", "/CN=mpcache-client", "-keyout", self.client_key, "-out", f"{d}/c.csr"],
            [openssl, "x509", "-req", "-in", f"{d}/c.csr", "-CA", self.ca, "-CAkey", f"{d}/ca.key",
             "-CAcreateserial", "-days", "1", "-out", self.client_cert],
        ]
        with open(f"{d}/server.ext", "w", encoding="utf-8") as handle:
            handle.write("subjectAltName=IP:127.0.0.1\n")
        for step in steps:
            completed = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if completed.returncode != 0:
                self.tls_skip_reason = f"openssl failed: {completed.stderr.strip()[-300:]}"
                return False
        return True

    def config(self, port: int) -> str:
        lines = [f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {self.directory}",
                 f"requirepass {self.root_password}", self.acl_line()]
        if self.tls_port is not None:
            d = self.directory
            lines += [f"tls-port {self.tls_port}", f"tls-cert-file {d}/server.crt", f"tls-key-file {d}/server.key",
                      f"tls-ca-cert-file {self.ca}", "tls-auth-clients optional"]
        return "\n".join(lines) + "\n"

    def url(self, *, user: str | None = None, password: str = "", tls: bool = False) -> str:
        credentials = f"{user or ''}:{password}@" if password else ""
        scheme, port = ("rediss", self.tls_port) if tls else ("redis", self.port)
        return f"{scheme}://{credentials}127.0.0.1:{port}/0"


@pytest.fixture(scope="session")
def secured_redis() -> Iterator[SecuredRedis]:
    """A :class:`SecuredRedis` for the session (TLS only where possible: ``tls_skip_reason`` says why not)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found (install redis-server to run the redis adapter tests)")
    directory = tempfile.mkdtemp(prefix="mpcache-l2-secured-")
    server = SecuredRedis(directory)
    if server.make_certificates():
        server.tls_port = free_port()
    try:
        process, port = _start_redis(directory, server.config)
    except RuntimeError:
        if server.tls_port is None:
            raise
        server.tls_port = None  # a redis-server built without TLS refuses tls-port: try again without it
        server.tls_skip_reason = "this redis-server does not accept tls-port (built without TLS)"
        process, port = _start_redis(directory, server.config)
    server.port = port
    try:
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


# -- a second local user ------------------------------------------------------------------------------

OTHER_USER = "mpcache-other"


@pytest.fixture(scope="session")
def other_user():
    """An :class:`support.l2.OtherUser` for ``mpcache-other`` (created with ``useradd -M`` if absent);
    skipped, saying why, unless we are root with setpriv."""
    from support.l2 import OtherUser

    if os.geteuid() != 0:
        pytest.skip("needs root: a second local user must own files and directories for this test")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not found: cannot run a command as a second local user")
    try:
        return OtherUser(pwd.getpwnam(OTHER_USER))
    except KeyError:
        pass
    useradd = shutil.which("useradd") or shutil.which("useradd", path="/usr/sbin:/sbin")
    if useradd is None:
        pytest.skip("useradd not found: cannot create a second local user")
    subprocess.run([useradd, "-M", "-s", "/usr/sbin/nologin", OTHER_USER], capture_output=True, timeout=30)
    try:  # a concurrent test run may have created it meanwhile: either way it must exist now
        return OtherUser(pwd.getpwnam(OTHER_USER))
    except KeyError:
        pytest.skip(f"could not create the local user {OTHER_USER}")


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

    from support.l2 import MAC_KEY  # here, not at the top: tests/cache loads this file for _start_redis

    def make(capacity_bytes: int = 4000, path=None, **options) -> FsL2Adapter:
        options.setdefault("mac_key", MAC_KEY)
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
    from support.l2 import MAC_KEY

    from mpcache.cache.l2.redis_adapter import RedisL2Adapter

    url = request.getfixturevalue("redis_server")

    def make(capacity_bytes: int = 4000, **options) -> RedisL2Adapter:
        options.setdefault("key_prefix", redis_prefix)
        options.setdefault("url", url)
        options.setdefault("mac_key", MAC_KEY)
        return closing(RedisL2Adapter(options.pop("url"), capacity_bytes, **options))

    return make


@pytest.fixture(params=["fs", "mock", "redis"])
def make_adapter(request) -> Callable[..., L2Adapter]:
    """``make_adapter(capacity_bytes=4000)``: each adapter type in turn (redis only with a server)."""
    return request.getfixturevalue(f"make_{request.param}")
