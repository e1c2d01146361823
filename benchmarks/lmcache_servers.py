"""The servers under test of the LMCache benchmark (``benchmarks.lmcache``): mpcache (through
``benchmarks.service``) or LMCache's MP server, started, their CPU-bearing pids found, stopped with their
shared memory removed; and the sampler of the telemetry process's drain lag.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import threading
import time
from typing import Any

from benchmarks import callgrind_cache
from benchmarks import service as bench_service
from benchmarks.children import stop
from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.shm.segment import Segment

OBJECT_BYTES = 2 * 8 * 256 * 256 * 2  # 2 planes x 8 layers x 256 tokens x (2 heads x 128) x fp16, per rank
LMCACHE_MAX_WORKERS = 2
START_TIMEOUT_S = 120.0
CALLGRIND_START_TIMEOUT_S = 600.0  # LMCache's server imports torch under valgrind: ~30 s alone, minutes when loaded
LAG_SAMPLE_S = 0.1
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mpcache", "lmcache-0.5.6-venv")
LMCACHE_SERVER = "lmcache.v1.multiprocess.server"
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


class LMCacheEnvMissing(RuntimeError):
    """The LMCache 0.5.6 venv this benchmark needs is not there (one line, for the user)."""


def lmcache_python() -> str:
    """The LMCache venv's python: ``$MPCACHE_TEST_LMCACHE_PYTHON``, else the complete venv ``.ci/lmcache-env`` built."""
    given = os.environ.get("MPCACHE_TEST_LMCACHE_PYTHON", "")
    if given:
        python, where = given, f"MPCACHE_TEST_LMCACHE_PYTHON={given}"
    else:
        venv = os.environ.get("MPCACHE_TEST_LMCACHE_VENV", "") or DEFAULT_VENV
        python, where = os.path.join(venv, "bin", "python"), f"the LMCache venv {venv}"
        if not os.path.isfile(os.path.join(venv, ".complete")):
            raise LMCacheEnvMissing(f"{where} is missing or incomplete: run .ci/lmcache-env first "
                                    "(or set MPCACHE_TEST_LMCACHE_PYTHON to a python that has lmcache 0.5.6)")
    if not os.access(python, os.X_OK):
        raise LMCacheEnvMissing(f"{where}: no python there: run .ci/lmcache-env first")
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('lmcache') is None)"],
                           capture_output=True, env={**os.environ, **LMCACHE_ENV}, timeout=60)
    if probe.returncode != 0:
        raise LMCacheEnvMissing(f"{where} cannot import lmcache: run .ci/lmcache-env first")
    return python


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _accepting(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """One server under test: started, its CPU-bearing pids found, stopped with its segments removed."""

    def __init__(self, kind: str, tmp: str, python: str, index: int, l1_gb: float, telemetry_nice: int = 0,
                 callgrind_dir: str | None = None, l1_policy: str | None = None) -> None:
        """``callgrind_dir``: an mpcache server's cache process, or LMCache's server, runs under callgrind, its
        output there.  ``l1_policy``: an mpcache server's ``--l1-policy`` (its kind then ends ``_<policy>``)."""
        self.kind = kind if l1_policy is None else f"{kind}_{l1_policy}"
        self.publishes = kind == "mpcache"
        self.start_timeout_s = START_TIMEOUT_S if callgrind_dir is None else CALLGRIND_START_TIMEOUT_S
        self.port = _free_port()
        self.log_path = os.path.join(tmp, f"{kind}-{index}.log")
        self.shm_name = f"mpcbench{os.getpid()}x{index}"  # LMCache's pool: /dev/shm/lmcache_l1_pool_<this>
        self.runtime_dir = os.path.join(tmp, f"run{index}")
        self.prometheus_port = _free_port()
        log = open(self.log_path, "wb")
        try:
            if kind.startswith("mpcache"):
                sink = "ring" if kind == "mpcache" else "none"
                env = bench_service.env()
                if callgrind_dir is not None:
                    sink += "-callgrind"
                    env[callgrind_cache.DIR_ENV] = callgrind_dir
                    env[callgrind_cache.PROGRAM_ENV] = (callgrind_cache.RING_PROGRAM if kind == "mpcache"
                                                        else callgrind_cache.NULL_PROGRAM)
                argv = bench_service.argv(
                    sink, "--workers", "1", "--lmcache-port", str(self.port),
                    "--prometheus-port", str(self.prometheus_port), "--runtime-dir", self.runtime_dir,
                    "--l1-size", str(int(l1_gb * 2**30)), "--chunk-bytes", str(OBJECT_BYTES), "--log-level", "warning")
                if kind == "mpcache" and telemetry_nice:
                    argv += ["--telemetry-nice", str(telemetry_nice)]
                if l1_policy is not None:
                    argv += ["--l1-policy", l1_policy]
                if callgrind_dir is not None:
                    argv += ["--hang-timeout", str(callgrind_cache.HANG_TIMEOUT_S)]
            else:
                args = ["--host", "127.0.0.1", "--port", str(self.port), "--supported-transfer-mode", "engine_driven",
                        "--shm-name", self.shm_name, "--l1-size-gb", str(l1_gb), "--no-l1-use-lazy",
                        "--eviction-policy", "LRU", "--max-workers", str(LMCACHE_MAX_WORKERS),
                        "--prometheus-port", str(self.prometheus_port)]
                if kind == "lmcache_off":
                    args.append("--disable-observability")
                if callgrind_dir is not None:  # the same pid: valgrind runs the server itself
                    argv = callgrind_cache.valgrind_argv(LMCACHE_SERVER, callgrind_dir, args, python)
                else:
                    argv = [python, "-m", LMCACHE_SERVER, *args]
                env = {**os.environ, **LMCACHE_ENV}
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env)
        finally:
            log.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited {self.process.returncode} while starting: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} did not start within {self.start_timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        if not self.kind.startswith("mpcache"):
            with open(self.log_path, "rb") as handle:
                if b"cache server is running" not in handle.read():
                    return False
        return _accepting(self.port)

    def cpu_pids(self) -> dict[str, list[int]]:
        """Processes whose CPU the workload reports: the server's request path, and telemetry apart."""
        if not self.kind.startswith("mpcache"):
            return {"server": [self.process.pid]}
        roles = bench_service.child_pids(self.process.pid)
        return {"server" if role == "cache" else role: pids for role, pids in roles.items()}

    def ring(self) -> Segment | None:
        """The cache process's event ring (mpcache with telemetry), attached read-only for lag sampling."""
        if not self.publishes:
            return None
        config = Config.load(os.path.join(self.runtime_dir, "config.json"))
        return Segment.attach(config.ring_name(0), layout.HEADER_SIZE)

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as handle:
                lines = handle.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:])[-600:] or "(empty log)"

    def stop(self) -> None:
        try:
            stop(self.process)
        finally:
            self.remove_segments()

    def remove_segments(self) -> None:
        """What a killed server could leave in /dev/shm: LMCache's pool, or the supervisor's segments."""
        patterns = [f"/dev/shm/lmcache_l1_pool_{self.shm_name}", f"/dev/shm/mpcache.{self.process.pid}.*"]
        for pattern in patterns:
            for path in glob.glob(pattern):
                try:
                    os.unlink(path)
                except OSError:
                    pass


class LagSampler:
    """Every LAG_SAMPLE_S: how far the telemetry process's drain is behind (now − the oldest unread record)."""

    def __init__(self, ring: Segment) -> None:
        self._ring = ring
        self._reader = RingReader(ring)  # read-only use: the oldest pending timestamp
        self._before = read_counters(ring)
        self._lags: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="lag-sampler")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(LAG_SAMPLE_S):
            oldest = self._reader.oldest_pending_timestamp_ns()
            self._lags.append(0.0 if oldest is None else max(0.0, (time.time_ns() - oldest) / 1e9))

    def finish(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        after = read_counters(self._ring)
        lost = sum(getattr(after, f) - getattr(self._before, f) for f in ("dropped", "torn", "malformed"))
        lags = sorted(self._lags) or [0.0]
        return {"lag_p50_ms": round(lags[len(lags) // 2] * 1000, 1),
                "lag_p99_ms": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1000, 1),
                "lag_max_ms": round(lags[-1] * 1000, 1), "records_lost": lost}
