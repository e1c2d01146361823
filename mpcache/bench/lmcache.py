"""Requests per second through LMCache's own vLLM adapters: mpcache against LMCache 0.5.6's MP server.

Four servers, each started fresh for every round and driven in turn (the order rotates from
round to round, so none always runs first or last on a shared machine):

* ``mpcache``: ``bin/start-cache --workers 1 --lmcache-port P --event-sink ring`` — the
  product, with its telemetry process draining the rings and exporting every metric;
* ``mpcache_off``: the same with ``--event-sink none`` (nothing published, no telemetry
  process);
* ``lmcache``: ``python -m lmcache.v1.multiprocess.server`` (engine-driven transfer, CPU,
  LRU, ``--max-workers 2`` request threads), observability on (its default);
* ``lmcache_off``: the same with ``--disable-observability``.

Every server gets the same 256 MiB L1 (``--l1-size 256MiB`` / ``--l1-size-gb 0.25``); mpcache's
slots are one rank's chunk object (``--chunk-bytes 2MiB``). The load is
``tests/lmcache/workload.py`` run with the LMCache venv's python (``.ci/lmcache-env``): LMCache's
scheduler and worker adapters with paged CPU KV caches, 4 new requests per step (half of new
conversations open with one of 4 shared 2-chunk system prompts, a quarter of requests continue a
recent conversation), each one lookup → prefetch status → retrieve the hits → store the misses
→ end_session, with a sample of every retrieved chunk's bytes checked. It runs at TP=1 (8
layers, 2 KV heads of 128) and TP=2 (a model with 4 KV heads, 2 per rank), so every rank's
chunk object is 2 MiB, for ``WARMUP_S`` and then ``seconds`` measured, against each server.

A round's value for a server is the mean of its TP=1 and TP=2 runs; the headline numbers are
medians over rounds. ``ratio_vs_lmcache`` = ``mpcache_rps / lmcache_rps`` and
``telemetry_on_over_off`` = ``mpcache_rps / mpcache_off_rps``, from the reported values.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import psutil

from mpcache.bench.children import kill_running, stop

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOAD = os.path.join(REPO, "tests", "lmcache", "workload.py")
SERVERS = ("mpcache", "mpcache_off", "lmcache", "lmcache_off")
TPS = (1, 2)
SECONDS = 10.0
WARMUP_S = 3.0
BATCH = 4
L1_GB = 0.25
L1_BYTES = int(L1_GB * 2**30)
OBJECT_BYTES = 2 * 8 * 256 * 256 * 2  # 2 planes x 8 layers x 256 tokens x (2 heads x 128) x fp16, per rank
LMCACHE_MAX_WORKERS = 2
TARGET_RATIO_VS_LMCACHE = 1.0
TARGET_TELEMETRY_ON_OVER_OFF = 0.97
START_TIMEOUT_S = 120.0
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mpcache", "lmcache-0.5.6-venv")
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


class LMCacheEnvMissing(RuntimeError):
    """The LMCache 0.5.6 venv this benchmark needs is not there (one line, for the user)."""


def lmcache_python() -> str:
    """The LMCache venv's python: ``$MPCACHE_LMCACHE_PYTHON``, else the complete venv ``.ci/lmcache-env`` built."""
    given = os.environ.get("MPCACHE_LMCACHE_PYTHON", "")
    if given:
        python, where = given, f"MPCACHE_LMCACHE_PYTHON={given}"
    else:
        venv = os.environ.get("MPCACHE_LMCACHE_VENV", "") or DEFAULT_VENV
        python, where = os.path.join(venv, "bin", "python"), f"the LMCache venv {venv}"
        if not os.path.isfile(os.path.join(venv, ".complete")):
            raise LMCacheEnvMissing(f"{where} is missing or incomplete: run .ci/lmcache-env first "
                                    "(or set MPCACHE_LMCACHE_PYTHON to a python that has lmcache 0.5.6)")
    if not os.access(python, os.X_OK):
        raise LMCacheEnvMissing(f"{where}: no python there: run .ci/lmcache-env first")
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('lmcache') is None)"],
                           capture_output=True, env={**os.environ, **LMCACHE_ENV}, timeout=60)
    if probe.returncode != 0:
        raise LMCacheEnvMissing(f"{where} cannot import lmcache: run .ci/lmcache-env first")
    return python


def _free_port(span: int = 1) -> int:
    """A loopback port that is free (and, with ``span`` > 1, whose next ports were free too)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + span <= 65535 and all(_port_free(port + i) for i in range(1, span)):
            return port
    raise RuntimeError("no free loopback port")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _accepting(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """One server under test: started, its CPU-bearing pids found, stopped with its segments removed."""

    def __init__(self, kind: str, tmp: str, python: str, index: int) -> None:
        self.kind = kind
        self.port = _free_port()
        self.log_path = os.path.join(tmp, f"{kind}-{index}.log")
        self.shm_name = f"mpcbench{os.getpid()}x{index}"  # LMCache's pool: /dev/shm/lmcache_l1_pool_<this>
        log = open(self.log_path, "wb")
        try:
            if kind.startswith("mpcache"):
                argv = [sys.executable, os.path.join(REPO, "bin", "start-cache"), "--workers", "1",
                        "--lmcache-port", str(self.port), "--event-sink", "ring" if kind == "mpcache" else "none",
                        "--prometheus-port", str(_free_port()), "--runtime-dir", os.path.join(tmp, f"run{index}"),
                        "--l1-size", f"{L1_BYTES}", "--chunk-bytes", str(OBJECT_BYTES), "--log-level", "warning"]
                env = None
            else:
                argv = [python, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port",
                        str(self.port), "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name,
                        "--l1-size-gb", str(L1_GB), "--no-l1-use-lazy", "--eviction-policy", "LRU",
                        "--max-workers", str(LMCACHE_MAX_WORKERS), "--prometheus-port", str(_free_port())]
                if kind == "lmcache_off":
                    argv.append("--disable-observability")
                env = {**os.environ, **LMCACHE_ENV}
            self.argv = argv
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env)
        finally:
            log.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited {self.process.returncode} while starting: "
                                   f"{self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} did not start within {START_TIMEOUT_S:.0f} s: {self._log_tail()}")
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
        groups: dict[str, list[int]] = {"server": [], "telemetry": []}
        for child in psutil.Process(self.process.pid).children():
            cmdline = " ".join(child.cmdline())
            groups["telemetry" if "mpcache.telemetry" in cmdline else "server"].append(child.pid)
        return {name: pids for name, pids in groups.items() if pids}

    def _log_tail(self) -> str:
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


def _run_workload(python: str, server: Server, tp: int, seconds: float, warmup_s: float, seed: int,
                  log_path: str) -> dict[str, Any]:
    argv = [python, WORKLOAD, "--url", f"tcp://127.0.0.1:{server.port}", "--tp", str(tp),
            "--seconds", str(seconds), "--warmup", str(warmup_s), "--batch", str(BATCH), "--seed", str(seed)]
    for name, pids in server.cpu_pids().items():
        argv += [arg for pid in pids for arg in ("--cpu-pid", f"{name}={pid}")]
    with open(log_path, "ab") as log:
        client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                  env={**os.environ, **LMCACHE_ENV})
        try:
            out, _ = client.communicate(timeout=warmup_s + seconds + 180)
        finally:
            kill_running([client])
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the workload against {server.kind} (TP={tp}) exited {client.returncode} "
                           f"without a result; see {log_path}") from None
    if not result.get("ok"):
        raise RuntimeError(f"the workload against {server.kind} (TP={tp}) failed: {result.get('reason')}")
    return result


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    """What a round keeps of one workload run."""
    return {
        "rps": run["requests_per_s"],
        "store_gb_per_s": run["store_gb_per_s"],
        "retrieve_gb_per_s": run["retrieve_gb_per_s"],
        "latency_p50_ms": run["latency_p50_ms"],
        "latency_p99_ms": run["latency_p99_ms"],
        "op_p50_ms": {op: v["p50"] for op, v in run["op_latency_ms"].items()},
        "op_p99_ms": {op: v["p99"] for op, v in run["op_latency_ms"].items()},
        "hit_chunk_ratio": run["hit_chunk_ratio"],
        "store_accepted_ratio": _accepted(run["counts"]),
        "requests": run["requests"],
        "cpu_share": run.get("cpu_share", {}),
    }


def _accepted(counts: dict[str, int]) -> float:
    """Of the chunk objects the workload asked to store, the fraction the server reserved (the rest it refused)."""
    asked = counts["stored_objects"] + counts["store_skipped_objects"]
    return round(counts["stored_objects"] / asked, 4) if asked else 1.0


METRICS = ("rps", "store_gb_per_s", "retrieve_gb_per_s", "latency_p50_ms", "latency_p99_ms")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None, seconds: float = SECONDS,
        warmup_s: float = WARMUP_S, tps: tuple[int, ...] = TPS) -> dict[str, Any]:
    python = lmcache_python()
    rounds = max(1, repetitions)
    progress(f"lmcache: servers {', '.join(SERVERS)} (L1 {L1_BYTES >> 20} MiB each), TP {tps}, "
             f"{warmup_s:g} s warm-up + {seconds:g} s per server and TP, {rounds} rounds (order rotates)")
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mpcache-lmbench-") as tmp:
        index = 0
        for r in range(rounds):
            order = [SERVERS[(r + i) % len(SERVERS)] for i in range(len(SERVERS))]
            this_round: dict[str, Any] = {"order": order}
            seed = 1000 + r  # every server sees the same request sequence in a round
            for kind in order:
                index += 1
                server = Server(kind, tmp, python, index)
                try:
                    server.wait_ready()
                    runs = {}
                    for tp in tps:
                        result = _run_workload(python, server, tp, seconds, warmup_s, seed,
                                               os.path.join(tmp, f"workload-{kind}-{index}.log"))
                        runs[f"tp{tp}"] = _summary(result)
                        cpu = ", ".join(f"{k} {v:.2f}" for k, v in result.get("cpu_share", {}).items()
                                        if v is not None)
                        progress(f"  round {r + 1}: {kind:11s} TP={tp} {result['requests_per_s']:7.1f} req/s, "
                                 f"store {result['store_gb_per_s']:.2f} GB/s, retrieve "
                                 f"{result['retrieve_gb_per_s']:.2f} GB/s, p50 {result['latency_p50_ms']:.1f} ms, "
                                 f"p99 {result['latency_p99_ms']:.1f} ms; hits {result['hit_chunk_ratio']:.0%} of chunks, "
                                 f"stores accepted {_accepted(result['counts']):.0%}; CPU (cores) {cpu}")
                finally:
                    server.stop()
                runs.update({m: round(statistics.fmean(runs[f"tp{tp}"][m] for tp in tps), 4) for m in METRICS})
                this_round[kind] = runs
            per_round.append(this_round)
    return _report(per_round, rounds, seconds, warmup_s, tps)


def _report(per_round: list[dict[str, Any]], rounds: int, seconds: float, warmup_s: float,
            tps: tuple[int, ...]) -> dict[str, Any]:
    servers: dict[str, Any] = {}
    for kind in SERVERS:
        entry: dict[str, Any] = {m: round(_median([rd[kind][m] for rd in per_round]), 4) for m in METRICS}
        for tp in tps:
            key = f"tp{tp}"
            entry[key] = {m: round(_median([rd[kind][key][m] for rd in per_round]), 4) for m in METRICS}
            entry[key]["op_p50_ms"] = {op: round(_median([rd[kind][key]["op_p50_ms"][op] for rd in per_round]), 3)
                                       for op in per_round[0][kind][key]["op_p50_ms"]}
            for name in ("hit_chunk_ratio", "store_accepted_ratio"):
                entry[key][name] = round(_median([rd[kind][key][name] for rd in per_round]), 4)
            shares = {name for rd in per_round for name in rd[kind][key]["cpu_share"]}
            entry[key]["cpu_share"] = {
                name: round(_median([v for rd in per_round
                                     if (v := rd[kind][key]["cpu_share"].get(name)) is not None]), 3)
                for name in sorted(shares)}
        servers[kind] = entry
    rps = {kind: round(servers[kind]["rps"], 2) for kind in SERVERS}
    ratio = round(rps["mpcache"] / rps["lmcache"], 4) if rps["lmcache"] else 0.0
    on_off = round(rps["mpcache"] / rps["mpcache_off"], 4) if rps["mpcache_off"] else 0.0
    return {
        "benchmark": "lmcache",
        "rounds": rounds,
        "seconds_per_run": seconds,
        "warmup_s": warmup_s,
        "tp": list(tps),
        "batch": BATCH,
        "object_bytes_per_rank": OBJECT_BYTES,
        "l1_bytes": L1_BYTES,
        "lmcache_max_workers": LMCACHE_MAX_WORKERS,
        "mpcache_rps": rps["mpcache"],
        "mpcache_off_rps": rps["mpcache_off"],
        "lmcache_rps": rps["lmcache"],
        "lmcache_off_rps": rps["lmcache_off"],
        "ratio_vs_lmcache": ratio,
        "telemetry_on_over_off": on_off,
        "lmcache_observability_on_over_off": round(rps["lmcache"] / rps["lmcache_off"], 4) if rps["lmcache_off"] else 0.0,
        "servers": servers,
        "target_ratio_vs_lmcache": TARGET_RATIO_VS_LMCACHE,
        "target_telemetry_on_over_off": TARGET_TELEMETRY_ON_OVER_OFF,
        "targets_met": {"ratio_vs_lmcache": ratio >= TARGET_RATIO_VS_LMCACHE,
                        "telemetry_on_over_off": on_off >= TARGET_TELEMETRY_ON_OVER_OFF},
        "per_round": per_round,
    }
