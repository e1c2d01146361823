"""``python -m mpcache.bench isolation``: what publishing costs inside the cache process, counted instead of timed.

Two services at once, one whose cache process publishes into its ring (the telemetry process reading it) and one
whose cache process publishes nowhere; both cache processes run under valgrind's callgrind
(:mod:`mpcache.bench.callgrind_cache`).  LMCache's own adapters (``tests/lmcache/workload.py``) send every step to
both in turn (``--mirror``): first a warm-up, not instrumented, then the measured window, instrumented.  Per request:
instructions, data reads and writes, simulated first-level and last-level cache misses, on over off.  The counts
come from the same code and the same requests, so they move by fractions of a percent between runs where CPU time
on a shared VM moves by several percent (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mpcache.bench.lmcache import _run_workload
from mpcache.bench.lmcache_servers import Server, lmcache_python

TPS = (1, 2)
SECONDS = 60.0  # measured, per TP: several hundred requests at callgrind's pace
WARMUP_S = 15.0  # not instrumented: L1 fills, the interpreter's caches settle
L1_GB = 4.0
DUMP_TIMEOUT_S = 120.0
TARGET_INSTRUCTIONS_COST = 0.03  # publishing on vs off, instructions per request
COUNTERS = {  # what the report calls each sum of callgrind events
    "instructions": ("Ir",),
    "data_reads": ("Dr",),
    "data_writes": ("Dw",),
    "l1_instruction_misses": ("I1mr",),
    "l1_data_misses": ("D1mr", "D1mw"),
    "last_level_misses": ("ILmr", "DLmr", "DLmw"),
}


class ValgrindMissing(RuntimeError):
    """valgrind (with callgrind_control) is not installed: the benchmark cannot count (one line, for the user)."""


def _require_valgrind() -> None:
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise ValgrindMissing(f"{' and '.join(missing)} not found: install valgrind (Debian: apt-get install valgrind)")


def read_summary(path: str) -> dict[str, int]:
    """The event totals of one callgrind dump (its ``events:`` and ``summary:`` lines)."""
    names: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("events:"):
                names = line.split()[1:]
            elif line.startswith("summary:"):
                values = [int(value) for value in line.split()[1:]]
                if len(values) != len(names):
                    break
                return dict(zip(names, values))
    raise RuntimeError(f"{path}: not a callgrind dump with an events and a summary line")


def _callgrind_control(pid: int, *options: str) -> None:
    done = subprocess.run(["callgrind_control", *options, str(pid)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(options)} {pid} failed: {done.stderr.strip()[-300:]}")


def _read_dump(out_dir: str, pid: int, number: int) -> dict[str, int]:
    """The totals of dump ``number`` of process ``pid``, once callgrind has written it."""
    path = os.path.join(out_dir, f"callgrind.{pid}.{number}")
    deadline = time.monotonic() + DUMP_TIMEOUT_S
    while True:
        try:
            return read_summary(path)
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"callgrind did not write {path} within {DUMP_TIMEOUT_S:.0f} s") from None
            time.sleep(0.2)


def _cache_pid(server: Server) -> int:
    [pid] = server.cpu_pids()["server"]
    return pid


def _measure(python: str, servers: list[Server], out_dir: str, tp: int, dump: int, seconds: float, warmup_s: float,
             log_path: str) -> dict[str, Any]:
    """One TP: the warm-up, then the instrumented window; each cache process's counts and the requests."""
    _run_workload(python, servers, tp, warmup_s, 0.0, tp, log_path)
    pids = [_cache_pid(server) for server in servers]
    for pid in pids:
        _callgrind_control(pid, "--instr=on")
        _callgrind_control(pid, "--zero")  # turning instrumentation back on keeps stale costs: count from here
    try:
        result = _run_workload(python, servers, tp, seconds, 0.0, 100 + tp, log_path)
    finally:
        for pid in pids:
            _callgrind_control(pid, "--dump")
            _callgrind_control(pid, "--instr=off")
    sides = [result, *result["mirrors"]]
    if len({side["requests"] for side in sides}) != 1:
        raise RuntimeError(f"the mirrored servers saw different requests: {[side['requests'] for side in sides]}")
    counts = [_read_dump(out_dir, pid, dump) for pid in pids]
    return {"requests": result["requests"], "counts": dict(zip((s.kind for s in servers), counts))}


def _per_request(measured: dict[str, Any]) -> dict[str, Any]:
    requests = measured["requests"]
    per: dict[str, dict[str, float]] = {}
    for kind, counts in measured["counts"].items():
        per[kind] = {name: round(sum(counts.get(event, 0) for event in events) / requests, 1)
                     for name, events in COUNTERS.items()}
    on, off = per["mpcache"], per["mpcache_off"]
    return {"requests": requests, "per_request": per,
            "on_over_off": {name: round(on[name] / off[name], 4) if off[name] else None for name in COUNTERS}}


def run(repetitions: int = 1, progress: Callable[[str], None] = lambda _: None, seconds: float = SECONDS,
        warmup_s: float = WARMUP_S, l1_gb: float = L1_GB, tps: tuple[int, ...] = TPS) -> dict[str, Any]:
    """Both services under callgrind, each TP measured once per repetition (the counts barely move)."""
    _require_valgrind()
    python = lmcache_python()
    per_tp: dict[str, list[dict[str, Any]]] = {f"tp{tp}": [] for tp in tps}
    for repetition in range(repetitions):
        with tempfile.TemporaryDirectory(prefix="mpcache-isolation-") as tmp:
            out_dir = os.path.join(tmp, "callgrind")
            os.mkdir(out_dir, 0o700)
            servers = [Server(kind, tmp, python, index, l1_gb, callgrind_dir=out_dir)
                       for index, kind in enumerate(("mpcache", "mpcache_off"))]
            try:
                for server in servers:
                    server.wait_ready()
                for dump, tp in enumerate(tps, start=1):
                    progress(f"isolation: repetition {repetition + 1}/{repetitions}, TP={tp}: {warmup_s:.0f} s of "
                             f"warm-up, then {seconds:.0f} s counted (both cache processes under callgrind)")
                    measured = _measure(python, servers, out_dir, tp, dump, seconds, warmup_s,
                                        os.path.join(tmp, "workload.log"))
                    per_tp[f"tp{tp}"].append(_per_request(measured))
            finally:
                for server in servers:
                    server.stop()  # the dumps go with the temporary directory
    return _report(per_tp, repetitions, seconds, warmup_s)


def _report(per_tp: dict[str, list[dict[str, Any]]], repetitions: int, seconds: float,
            warmup_s: float) -> dict[str, Any]:
    """The last repetition's counts per TP, every repetition's ratios, and the verdict on the worst TP."""
    result: dict[str, Any] = {"repetitions": repetitions, "seconds": seconds, "warmup_s": warmup_s,
                              "tp": [int(name[2:]) for name in per_tp]}
    costs = []
    for name, rounds in per_tp.items():
        result[name] = {**rounds[-1], "instructions_on_over_off_by_repetition":
                        [entry["on_over_off"]["instructions"] for entry in rounds]}
        costs += [entry["on_over_off"]["instructions"] - 1 for entry in rounds]
    result["instructions_cost"] = round(max(costs), 4)
    result["targets_met"] = {"instructions_cost": result["instructions_cost"] <= TARGET_INSTRUCTIONS_COST}
    return result
