"""``python -m benchmarks peers``: whether a foreign local user can starve the engines a cache process serves
over ``--lmcache-port``.

A one-process service; an engine of the service's uid, connected first, asks ``get_chunk_size`` every 10 ms
(its round trips: p50, p99, max), and every ``SECONDS / FRESH`` s a fresh connection of the service's uid
connects, registers an engine_driven context and unregisters it (connect to registration reply: the worst).
Three phases side by side: no foreign peer; another uid holding ``CONNECTIONS`` connections to the port (each
refused) with ``TABLE_ROWS`` rows of its own loopback pairs in the host's socket table and ``TRICKLE_PER_S``
connections a second more; and ``FLOOD_PROCESSES`` processes of that uid connecting and resetting as fast as
they can.  The foreign side is :mod:`benchmarks.foreign_peers`, run as a throwaway system user made with
``useradd`` (so the benchmark needs root), in ``HOLD_PROCESSES`` processes whose RLIMIT_NOFILE is raised to
what they hold.  Targets: p99 ≤ 50 ms and every
fresh registration within 1 s in every phase.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from benchmarks import service as bench_service
from benchmarks.lmcache_servers import Server
from mpcache.cache.lmcache import zmtp

CONNECTIONS = 28_000
TABLE_ROWS = 28_000
TRICKLE_PER_S = 100
FLOOD_PROCESSES = 2
HOLD_PROCESSES = 4  # each holds a quarter: its descriptors stay under a hard RLIMIT_NOFILE of 20,000
SECONDS = 20.0
FRESH = 20
ASK_EVERY_S = 0.01
TIMEOUT_S = 10.0
TARGET_P99_MS = 50.0
TARGET_REGISTER_S = 1.0
DESCRIPTORS = (CONNECTIONS + TABLE_ROWS) // HOLD_PROCESSES + 1024  # per holding process
GET_CHUNK_SIZE, REGISTER, UNREGISTER = 21, 14, 15
_DEALER_READY = zmtp.command(b"READY", zmtp.ready_properties({b"Socket-Type": b"DEALER"}))


class SecondUserMissing(RuntimeError):
    """No second local user can be made (not root, or no useradd): one line, for the user."""


class Engine:
    """An LMCache client of the service's uid speaking ZMTP on a plain socket (a DEALER, as LMCache's is)."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(zmtp.GREETING + _DEALER_READY)
        self._reader = zmtp.FrameReader(1 << 20, 8)
        greeting = b""
        while len(greeting) < zmtp.GREETING_BYTES:
            greeting += self._receive()
        zmtp.check_greeting(greeting[:zmtp.GREETING_BYTES])
        self._reader.buffer += greeting[zmtp.GREETING_BYTES:]
        self._request = 0

    def _receive(self) -> bytes:
        data = self._sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the cache process closed the connection")
        return data

    def call(self, op: int, *args: Any) -> Any:
        self._request += 1
        self._sock.sendall(zmtp.encode([msgpack.packb(self._request), msgpack.packb(op),
                                        *(msgpack.packb(arg) for arg in args)]))
        while True:
            item = self._reader.next()
            if item is None:
                self._reader.buffer += self._receive()
            elif not isinstance(item, bytes):  # a message (bytes: a command, READY)
                return msgpack.unpackb(item[2]) if len(item) > 2 else None

    def close(self) -> None:
        self._sock.close()


def _registration(instance_id: int) -> dict[str, Any]:
    return {"instance_id": instance_id, "model_name": "bench/peers", "world_size": 1, "block_size": 16,
            "num_layers": 2, "hidden_dim_size": 64, "dtype_str": "float16", "use_mla": False,
            "num_physical_slots": 64}


def _fresh_registration(port: int, instance_id: int) -> float:
    """Seconds from connect to the registration's reply (inf when it failed)."""
    started = time.perf_counter()
    try:
        engine = Engine(port)
        try:
            reply = engine.call(REGISTER, _registration(instance_id))
            took = time.perf_counter() - started
            engine.call(UNREGISTER, instance_id)
        finally:
            engine.close()
    except (OSError, zmtp.ZmtpError):
        return float("inf")
    return took if isinstance(reply, dict) and reply.get("pool_size") else float("inf")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _measure(engine: Engine, port: int, seconds: float, first_id: int) -> dict[str, Any]:
    """The established engine's round trips and the fresh registrations over ``seconds``."""
    fresh: list[float] = []

    def register_fresh() -> None:
        for index in range(FRESH):
            next_at = started + index * seconds / FRESH
            time.sleep(max(0.0, next_at - time.monotonic()))
            fresh.append(_fresh_registration(port, first_id + index))

    started = time.monotonic()
    thread = threading.Thread(target=register_fresh, daemon=True)
    thread.start()
    round_trips: list[float] = []
    failures = 0
    next_at = started
    while time.monotonic() < started + seconds:
        asked = time.perf_counter()
        try:
            engine.call(GET_CHUNK_SIZE)
        except OSError:
            failures += 1
            break
        round_trips.append(time.perf_counter() - asked)
        next_at += ASK_EVERY_S
        time.sleep(max(0.0, next_at - time.monotonic()))
    thread.join(seconds + FRESH * TIMEOUT_S)
    return {"requests": len(round_trips), "request_failures": failures,
            "p50_ms": round(_percentile(round_trips, 0.5) * 1000, 2),
            "p99_ms": round(_percentile(round_trips, 0.99) * 1000, 2),
            "max_ms": round(max(round_trips) * 1000, 2),
            "fresh_registrations": len(fresh), "fresh_failed": sum(1 for t in fresh if t == float("inf")),
            "fresh_max_s": round(max(fresh), 3), "fresh_p50_s": round(_percentile(fresh, 0.5), 4)}


def _counters(prometheus_port: int) -> dict[str, float]:
    """The service's refused and unidentified LMCache connections, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    totals = {"refused": 0.0, "unidentified": 0.0}
    for line in text.splitlines():
        for name in totals:
            if line.startswith(f"mpcache_lmcache_{name}_connections_total"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _python_for_others() -> str:
    """This interpreter if every user can run it (a pyenv one under 0700 /root cannot), else the system's."""
    candidates = [sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}",
                  "/usr/bin/python3"]
    for candidate in candidates:
        real = os.path.realpath(candidate)
        parts = real.split(os.sep)
        reachable = all(os.stat(os.sep.join(parts[:depth]) or os.sep).st_mode & stat.S_IXOTH
                        for depth in range(1, len(parts)))
        if os.path.exists(real) and reachable and os.stat(real).st_mode & stat.S_IXOTH:
            return real
    raise SecondUserMissing("no Python that another user can run")


@contextlib.contextmanager
def _second_user() -> Iterator[int]:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        raise SecondUserMissing("the foreign peers run as a throwaway user made with useradd: run as root")
    name = f"mpcache-bench-{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _foreign(uid: int, *args: str) -> subprocess.Popen[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": bench_service.PACKAGE_ROOT, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([_python_for_others(), "-m", "benchmarks.foreign_peers", *args], user=uid, group=uid,
                            extra_groups=[], cwd="/", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _phase(name: str, server: Server, engine: Engine, start_foreign: Callable[[], list[subprocess.Popen[str]]],
           seconds: float, first_id: int, progress: Callable[[str], None]) -> dict[str, Any]:
    progress(f"peers: {name}, {seconds:.0f} s")
    before = _counters(server.prometheus_port)
    foreign = start_foreign()
    try:
        result = _measure(engine, server.port, seconds, first_id)
    finally:
        made = 0
        for process in foreign:
            out, _ = process.communicate("", timeout=120)
            made += int(out.split()[-1]) if out.split() else 0
    after = _counters(server.prometheus_port)
    result["foreign_connections"] = made
    result.update({f"{key}_delta": int(after[key] - before[key]) for key in after})
    return result


def run(repetitions: int = 1, progress: Callable[[str], None] = lambda message: None,
        seconds: float = SECONDS) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < DESCRIPTORS:
        raise SecondUserMissing(f"RLIMIT_NOFILE's hard limit is {hard}: each foreign process needs {DESCRIPTORS}")
    with _second_user() as uid:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, DESCRIPTORS), hard))  # the foreign inherit it
        with tempfile.TemporaryDirectory(prefix="mpcache-bench-peers-") as tmp:
            server = Server("mpcache", tmp, sys.executable, 0, l1_gb=0.25)
            try:
                server.wait_ready()
                engine = Engine(server.port)
                try:
                    engine.call(GET_CHUNK_SIZE)
                    phases = {
                        "alone": _phase("no foreign peer", server, engine, list, seconds, 1000, progress),
                        "held": _phase(
                            f"{CONNECTIONS:,} foreign connections held, {TABLE_ROWS:,} rows, {TRICKLE_PER_S}/s",
                            server, engine, lambda: [
                                _foreign(uid, "hold", str(server.port), str(CONNECTIONS // HOLD_PROCESSES),
                                         str(TABLE_ROWS // HOLD_PROCESSES), str(TRICKLE_PER_S / HOLD_PROCESSES))
                                for _ in range(HOLD_PROCESSES)],
                            seconds, 2000, progress),
                        "flood": _phase(
                            f"{FLOOD_PROCESSES} foreign processes flooding connects", server, engine,
                            lambda: [_foreign(uid, "flood", str(server.port), str(seconds))
                                     for _ in range(FLOOD_PROCESSES)], seconds, 3000, progress),
                    }
                finally:
                    engine.close()
            finally:
                server.stop()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    met_p99 = all(phase["p99_ms"] <= TARGET_P99_MS and not phase["request_failures"] for phase in phases.values())
    met_fresh = all(phase["fresh_max_s"] <= TARGET_REGISTER_S for phase in phases.values())
    return {**phases, "targets_met": {"p99": met_p99, "fresh": met_fresh},
            "held_p99_over_alone": round(phases["held"]["p99_ms"] / phases["alone"]["p99_ms"], 2),
            "flood_p99_over_alone": round(phases["flood"]["p99_ms"] / phases["alone"]["p99_ms"], 2)}


def render(result: dict[str, Any]) -> str:
    lines = [f"{'phase':<8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'fresh max s':>12} {'fresh failed':>13} "
             f"{'foreign made':>13} {'refused':>9} {'unidentified':>13}"]
    for name in ("alone", "held", "flood"):
        phase = result[name]
        lines.append(f"{name:<8} {phase['p50_ms']:>8} {phase['p99_ms']:>8} {phase['max_ms']:>8} "
                     f"{phase['fresh_max_s']:>12} {phase['fresh_failed']:>13} {phase['foreign_connections']:>13,} "
                     f"{phase['refused_delta']:>9,} {phase['unidentified_delta']:>13,}")
    lines.append(f"targets (p99 ≤ {TARGET_P99_MS:g} ms, fresh registration ≤ {TARGET_REGISTER_S:g} s): "
                 + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in result["targets_met"].items()))
    return "\n".join(lines)
