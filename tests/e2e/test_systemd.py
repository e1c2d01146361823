"""The supervisor under systemd's protocols, spoken by real sockets and streams: ``Type=notify``
(``READY=1`` once every cache process serves, ``STATUS=`` on changes, ``STOPPING=1``) over a datagram
socket at ``$NOTIFY_SOCKET``, and journal priorities on stderr when ``$JOURNAL_STREAM`` names it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from support.buffer_client import round_trip
from support.ports import free_port
from support.service import REPO, SMALL, START_CACHE
from support.waiting import wait_for

from mpcache.client import CacheClient


def _datagrams(sock: socket.socket, until: str, timeout_s: float) -> list[dict[str, str]]:
    """Every notification received until one carries ``until`` (KEY=VALUE), each as a dict."""
    got: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout_s
    while not any(until in "\n".join(f"{k}={v}" for k, v in message.items()) for message in got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {until} within {timeout_s} s; got {got}"
        sock.settimeout(remaining)
        data = sock.recv(4096).decode()
        got.append(dict(line.split("=", 1) for line in data.splitlines()))
    return got


def _start(tmp_path, env: dict[str, str], stderr, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, START_CACHE, "--runtime-dir", str(tmp_path / "run"), "--prometheus-port", str(free_port()),
         *SMALL, *flags], env=env, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)


@pytest.mark.slow
def test_ready_status_and_stopping_are_notified_and_children_do_not_inherit_the_socket(tmp_path):
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        env = dict(os.environ, NOTIFY_SOCKET=address)
        with open(tmp_path / "stderr.log", "wb") as stderr:
            service = _start(tmp_path, env, stderr, "--workers", "2", "--log-file", str(tmp_path / "log"))
            try:
                messages = _datagrams(sock, "READY=1", 60)
                assert {"READY": "1", "STATUS": "2/2 cache processes serving"} == messages[-1]
                # READY means serving: both sockets complete a verified round trip right away
                for worker in range(2):
                    with CacheClient(str(tmp_path / "run" / f"cache{worker}.sock")) as client:
                        result = round_trip(client)
                    assert (2, 2, 2, True) == (result["stored"], result["found"], result["retrieved"],
                                               result["equal"])
                lines = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
                cache1 = [line["pid"] for line in lines if line.get("event") == "child.started"
                          and line.get("child_role") == "cache" and line.get("index") == 1][-1]
                environ = (open(f"/proc/{cache1}/environ", "rb").read()).split(b"\0")
                assert not [entry for entry in environ if entry.startswith(b"NOTIFY_SOCKET=")]
                os.kill(cache1, signal.SIGKILL)
                down = _datagrams(sock, "STATUS=1/2 cache processes serving", 30)[-1]
                assert down["STATUS"].startswith("1/2 cache processes serving; cache[1] ")
                assert {"STATUS": "2/2 cache processes serving"} == _datagrams(
                    sock, "STATUS=2/2 cache processes serving", 60)[-1]
                service.send_signal(signal.SIGTERM)
                assert "1" == _datagrams(sock, "STOPPING=1", 30)[-1]["STOPPING"]
                assert 0 == service.wait(60)
            finally:
                service.kill()
                service.wait()


@pytest.mark.slow
def test_a_notify_socket_that_is_gone_is_logged_once_and_the_service_serves(tmp_path):
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "nobody-listens.sock"))
    with open(tmp_path / "stderr.log", "wb") as stderr:
        service = _start(tmp_path, env, stderr, "--workers", "1", "--log-file", str(tmp_path / "log"))
        try:
            def events() -> list[dict]:
                return [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()] \
                    if (tmp_path / "log").exists() else []
            wait_for(lambda: any(line["event"] == "cache.ready" for line in events()), 60, "cache.ready")
            with CacheClient(str(tmp_path / "run" / "cache0.sock")) as client:
                assert round_trip(client)["equal"]
            service.send_signal(signal.SIGTERM)
            assert 0 == service.wait(60)
        finally:
            service.kill()
            service.wait()
    failed = [line for line in events() if line["event"] == "systemd.notify_failed"]
    assert 1 == len(failed) and "nobody-listens.sock" in failed[0]["error"]


@pytest.mark.slow
def test_stderr_lines_carry_journal_priorities_only_when_stderr_is_the_journal(tmp_path):
    """JOURNAL_STREAM=dev:inode of our stderr: every line is "<priority>" + the JSON line, the priority
    the syslog one of its level (journald strips the prefix: journalctl -o cat shows the JSON as before)."""
    syslog = {"debug": 7, "info": 6, "warning": 4, "error": 3}
    for name, journal in (("journal", True), ("not-journal", False)):
        path = tmp_path / f"{name}.log"
        (tmp_path / name).mkdir()
        with open(path, "wb") as stderr:
            st = os.fstat(stderr.fileno())
            stream = f"{st.st_dev}:{st.st_ino}" if journal else f"{st.st_dev}:{st.st_ino + 1}"
            env = dict(os.environ, JOURNAL_STREAM=stream)
            # 0.0.0.0 makes the supervisor warn (metrics.public_bind), and a child's lines are at info
            service = _start(tmp_path / name, env, stderr, "--workers", "1", "--prometheus-host", "0.0.0.0")
            try:
                wait_for(lambda path=path: all(word in path.read_bytes() for word in (b"public_bind", b"cache.ready")),
                         60, "a warning and cache.ready on stderr")
                service.send_signal(signal.SIGTERM)
                assert 0 == service.wait(60)
            finally:
                service.kill()
                service.wait()
        lines = path.read_text().splitlines()
        if journal:
            prefixes = [(line[:3], syslog[json.loads(line[3:])["level"]]) for line in lines]
            assert [] == [line for line, (prefix, level) in zip(lines, prefixes) if prefix != f"<{level}>"]
            assert {"<4>", "<6>"} <= {prefix for prefix, _ in prefixes}
        else:
            assert all(json.loads(line)["level"] in syslog for line in lines)


def _journal_stream(stderr) -> dict[str, str]:
    """The environment of a start whose stderr (a file here) is what systemd would call the journal."""
    st = os.fstat(stderr.fileno())
    return dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")


@pytest.mark.slow
def test_a_configuration_error_and_a_killed_cache_process_are_errors_in_the_journal(tmp_path):
    """``journalctl -p err`` shows why a unit failed and that a cache process was killed: under the journal,
    start-cache's one error line (a bad setting, a refused value, --check-config's) carries priority 3,
    and so does the ``child.exited`` line of a cache process killed by SIGKILL (its restart stays info)."""
    refused = []
    for argv in (["--workers", "0"], ["--l1-size", "1KiB"], ["--check-config", "--l1-size", "1KiB"]):
        with open(tmp_path / "refused.log", "wb") as stderr:
            assert 2 == _start(tmp_path, _journal_stream(stderr), stderr, *argv).wait(60)
        refused.append((tmp_path / "refused.log").read_text())
    with open(tmp_path / "stderr.log", "wb") as stderr:
        service = _start(tmp_path, _journal_stream(stderr), stderr, "--workers", "1", "--log-file",
                         str(tmp_path / "log"))
        try:
            def lines(event: str) -> list[dict]:
                log = tmp_path / "log"
                return [line for line in map(json.loads, log.read_text().splitlines()) if line["event"] == event] \
                    if log.exists() else []
            # the cache process logs cache.start once it serves: after the socket cache.ready waits for (killed
            # between the two, it would leave one cache.start, the restarted process's)
            wait_for(lambda: lines("cache.ready") and lines("cache.start"), 60, "cache.ready and cache.start")
            [cache] = [line["pid"] for line in lines("child.started") if line["child_role"] == "cache"]
            os.kill(cache, signal.SIGKILL)
            wait_for(lambda: len(lines("cache.start")) == 2, 60, "the cache process to be restarted")
            service.send_signal(signal.SIGTERM)
            assert 0 == service.wait(60)
        finally:
            service.kill()
            service.wait()
    journal = {json.loads(line[3:])["event"]: line[:3] for line in (tmp_path / "stderr.log").read_text().splitlines()
               if line[3:].startswith("{") and json.loads(line[3:]).get("pid") == cache
               and json.loads(line[3:])["role"] == "supervisor"}

    assert [1, 1, 1] == [len(text.splitlines()) for text in refused]
    assert [] == [text for text in refused if not text.startswith("<3>start-cache: error: ")]
    assert {"child.started": "<6>", "child.exited": "<3>"} == journal
