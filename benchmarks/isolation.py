"""``python -m benchmarks isolation``: what publishing costs inside the cache process, and what the cache process
executes against LMCache's server, counted instead of timed.

Three servers at once: one whose cache process publishes into its ring (the telemetry process reading it), one whose
cache process publishes nowhere, and LMCache 0.5.6's MP server; both cache processes and LMCache's server run under
valgrind's callgrind (:mod:`benchmarks.callgrind_cache`). LMCache's own adapters (``benchmarks/harness/workload.py``)
send every step to each in turn (``--mirror``): first a warm-up, not instrumented, then an idle window (no requests,
instrumented: what each server's own timers cost per second), then the measured window, instrumented. Per request:
instructions, data reads and writes, simulated first-level and last-level cache misses, and the ring cells each
cache process published (read from its ring's head: whether publishing ran is a count, not a difference of two noisy
totals); publishing on over off (gross counts), and the publishing cache process over LMCache's server net of idle
(callgrind runs tens of times slower than the CPU, so a server's once-a-second work would otherwise weigh tens of
times more per request than it does at full speed). The counts come from the same code and the same requests, so
they move by fractions of a percent between runs where CPU time on a shared VM moves by several percent
(docs/BENCHMARKS.md). Callgrind counts user space only: the kernel's share is the ``lmcache`` benchmark's.

``--policies lru,adaptive`` compares L1 eviction policies instead: one publishing mpcache server per
``--l1-policy``, both under callgrind and mirrored (the same requests to each), no LMCache server; with an L1 small
enough (``--l1-gb``) that the window evicts, what each policy's engine path executes per request, over the
first policy's (each server's evicted chunks in the window, from its ``/metrics``, say whether it evicted), and
the chunks each found and stored per request and its steps that retrieved (a policy that finds more serves more
hits, and a step with a hit makes retrieve calls a step without one does not), and the calls each server
served per request by operation (``mpcache_lmcache_request_seconds``' counts: polls included).
``--workload unique`` makes every prompt new: no policy finds anything and, with a full L1, every stored chunk
evicts one, so the policies' counts differ by their order's work alone (like for like).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from benchmarks import service_times
from benchmarks.lmcache import _run_workload
from benchmarks.lmcache_cpu import TARGET_CACHE_CPU_OVER_LMCACHE  # the lmcache benchmark's CPU target, counted
from benchmarks.lmcache_servers import Server, lmcache_python
from mpcache.shm.ring_reader import read_counters

TPS = (1, 2)
SECONDS = 60.0  # measured, per TP: 100-160 requests at callgrind's pace (LMCache's server paces the steps)
WARMUP_S = 15.0  # not instrumented: L1 fills, the interpreter's caches settle
L1_GB = 4.0
DUMP_TIMEOUT_S = 120.0
IDLE_S = 5.0  # instrumented with no requests, per TP: each server's timers, subtracted from the measured window
TARGET_INSTRUCTIONS_COST = 0.03  # publishing on vs off, instructions per request
KINDS = ("mpcache", "mpcache_off", "lmcache")
COLLECTOR = "gc_collect_main"  # CPython's cyclic collector: what each collection runs
WORKLOADS = {  # --workload: the request mix's options to the workload (benchmarks/harness/workload.py)
    "mixed": (),  # its default: shared system prompts, follow-ups, new prompts
    "unique": ("--shared-fraction", "0", "--followup-fraction", "0"),  # every prompt new: nothing is ever found
}
EVICTED_SERIES = b"lmcache_mp_l1_evicted_chunks_total"
SETTLE_S = 0.5  # /metrics read again after this long until it stops moving (the telemetry process drains)
SETTLE_TIMEOUT_S = 30.0
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


def require_valgrind() -> None:
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise ValgrindMissing(f"{' and '.join(missing)} not found: install valgrind (Debian: apt-get install valgrind)")


def read_summary(path: str) -> dict[str, int]:
    """The event totals of one callgrind dump (its ``events:`` and ``summary:`` lines; callgrind leaves out
    trailing zero counts, so ``summary: 0`` is a window that executed nothing)."""
    names: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("events:"):
                names = line.split()[1:]
            elif line.startswith("summary:"):
                values = [int(value) for value in line.split()[1:]]
                if not names or not values or len(values) > len(names):
                    break
                return dict(zip(names, values + [0] * (len(names) - len(values))))
    raise RuntimeError(f"{path}: not a callgrind dump with an events and a summary line")


def read_collector(path: str) -> tuple[int, int] | None:
    """How often the cyclic collector ran in the callgrind dump ``path`` and the instructions it executed there in
    all (every collection, of any generation, is a call of :data:`COLLECTOR`; a call's record carries what it
    executed inclusively); None where no call of it is recorded (a window without a collection, or an interpreter
    whose collector is inlined or named otherwise: not told apart, so not reported as zero)."""
    names: dict[str, str] = {}
    runs = instructions = 0
    position_fields = 1
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("positions:"):
            position_fields = len(line.split()) - 1
        elif line.startswith(("fn=(", "cfn=(")):
            ident, _, name = line.partition("=")[2].partition(" ")
            if name:
                names[ident] = name
            if (line.startswith("cfn=") and names.get(ident) == COLLECTOR and index + 2 < len(lines)
                    and lines[index + 1].startswith("calls=")):
                runs += int(lines[index + 1].split()[0].removeprefix("calls="))
                instructions += int(lines[index + 2].split()[position_fields])
    return (runs, instructions) if runs else None


def callgrind_control(pid: int, *options: str) -> None:
    done = subprocess.run(["callgrind_control", *options, str(pid)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(options)} {pid} failed: {done.stderr.strip()[-300:]}")


def dump_path(out_dir: str, pid: int, number: int) -> str:
    """Where callgrind writes dump ``number`` of process ``pid``."""
    return os.path.join(out_dir, f"callgrind.{pid}.{number}")


def read_dump(out_dir: str, pid: int, number: int) -> dict[str, int]:
    """The totals of dump ``number`` of process ``pid``, once callgrind has written it."""
    path = dump_path(out_dir, pid, number)
    deadline = time.monotonic() + DUMP_TIMEOUT_S
    while True:
        try:
            return read_summary(path)
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"callgrind did not write {path} within {DUMP_TIMEOUT_S:.0f} s") from None
            time.sleep(0.2)


def evicted_chunks(server: Server) -> int:
    """L1 chunks ``server`` evicted so far, from its ``/metrics`` once two reads ``SETTLE_S`` apart agree."""
    deadline, last = time.monotonic() + SETTLE_TIMEOUT_S, None
    while True:
        url = f"http://127.0.0.1:{server.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            page = response.read()
        now = sum(int(float(line.rsplit(b" ", 1)[1])) for line in page.splitlines()
                  if line.startswith(EVICTED_SERIES))
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(SETTLE_S)


def _cache_pid(server: Server) -> int:
    [pid] = server.cpu_pids()["server"]
    return pid


def _counted(pids: list[int], out_dir: str, dump: int,
             window: Callable[[], Any]) -> tuple[Any, list[float], list[dict[str, int]]]:
    """``window()`` with every pid's costs zeroed before it and dumped (as dump number ``dump``) after it: its
    result, and each pid's counted seconds (from its zero to its dump: each callgrind_control call takes a
    while) and counts."""
    zeroed = []
    for pid in pids:
        callgrind_control(pid, "--zero")
        zeroed.append(time.monotonic())
    try:
        result = window()
    finally:
        elapsed = []
        for pid, start in zip(pids, zeroed):
            elapsed.append(time.monotonic() - start)
            callgrind_control(pid, "--dump")
    return result, elapsed, [read_dump(out_dir, pid, dump) for pid in pids]


def _measure(python: str, servers: list[Server], out_dir: str, tp: int, dump: int, seconds: float, warmup_s: float,
             idle_s: float, log_path: str, options: tuple[str, ...] = ()) -> dict[str, Any]:
    """One TP: the warm-up, then the idle window (dump ``dump``), then the measured one (dump ``dump + 1``); each
    server's counts and counted seconds, its idle counts per second, the requests and the chunks each found and
    stored.  ``options``: the workload's request mix (:data:`WORKLOADS`)."""
    _run_workload(python, servers, tp, warmup_s, 0.0, tp, log_path, options)
    pids = [_cache_pid(server) for server in servers]
    rings = {server.kind: ring for server in servers if (ring := server.ring()) is not None}
    for pid in pids:
        callgrind_control(pid, "--instr=on")  # turning instrumentation back on keeps stale costs: each window zeroes
    publishing = [server for server in servers if server.publishes]
    try:
        _, idle_elapsed, idle = _counted(pids, out_dir, dump, lambda: time.sleep(idle_s))
        heads = {kind: read_counters(ring).head for kind, ring in rings.items()}
        evicted = {server.kind: evicted_chunks(server) for server in publishing}
        calls_before = {server.kind: service_times.settled(server.prometheus_port) for server in publishing}
        result, elapsed, counts = _counted(pids, out_dir, dump + 1, lambda: _run_workload(
            python, servers, tp, seconds, 0.0, 100 + tp, log_path, options))
        published = {kind: read_counters(ring).head - heads[kind] for kind, ring in rings.items()}
        evicted = {server.kind: evicted_chunks(server) - evicted[server.kind] for server in publishing}
        calls = {server.kind: {op: edges[float("inf")] for op, edges in service_times.difference(
            service_times.settled(server.prometheus_port), calls_before[server.kind]).items()} for server in publishing}
    finally:
        for pid in pids:
            callgrind_control(pid, "--instr=off")
        for ring in rings.values():
            ring.close()
    sides = [result, *result["mirrors"]]
    if len({side["requests"] for side in sides}) != 1:
        raise RuntimeError(f"the mirrored servers saw different requests: {[side['requests'] for side in sides]}")
    kinds = [server.kind for server in servers]
    collector = {kind: read_collector(dump_path(out_dir, pid, dump + 1)) for kind, pid in zip(kinds, pids)}
    idle_collector = [read_collector(dump_path(out_dir, pid, dump)) for pid in pids]
    return {"requests": result["requests"], "seconds": dict(zip(kinds, elapsed)), "counts": dict(zip(kinds, counts)),
            "collector": collector,
            "ring_cells": {kind: published.get(kind, 0) for kind in kinds}, "evicted_chunks": evicted,
            "server_calls": calls,
            "hit_chunk_ratio": dict(zip(kinds, (side["hit_chunk_ratio"] for side in sides))),
            "chunks": dict(zip(kinds, ({name: side["counts"][name] for name in ("hit_chunks", "stored_chunks")}
                                       for side in sides))),
            "retrieve_steps": dict(zip(kinds, (side["op_latency_ms"].get("retrieve", {}).get("n", 0)
                                               for side in sides))),
            "idle_per_s": {kind: {event: value / seconds_idle for event, value in one.items()}
                           for kind, one, seconds_idle in zip(kinds, idle, idle_elapsed)},
            "idle_collector_per_s": {kind: (counted[1] if counted else 0) / seconds_idle  # no call: none ran idle
                                     for kind, counted, seconds_idle in zip(kinds, idle_collector, idle_elapsed)}}


def _per_request(measured: dict[str, Any]) -> dict[str, Any]:
    requests = measured["requests"]
    per: dict[str, dict[str, float]] = {}
    net: dict[str, dict[str, float]] = {}
    idle: dict[str, dict[str, float]] = {}
    for kind, counts in measured["counts"].items():
        idle_per_s, seconds = measured["idle_per_s"][kind], measured["seconds"][kind]
        per[kind] = {name: round(sum(counts.get(event, 0) for event in events) / requests, 1)
                     for name, events in COUNTERS.items()}
        idle[kind] = {name: round(sum(idle_per_s.get(event, 0) for event in events), 1)
                      for name, events in COUNTERS.items()}
        net[kind] = {name: round(max(0.0, per[kind][name] - idle[kind][name] * seconds / requests), 1)
                     for name in COUNTERS}
    on, off, lmcache = per["mpcache"], per["mpcache_off"], net["lmcache"]
    if not lmcache["instructions"]:
        raise RuntimeError(f"LMCache's server executed no more instructions over {requests} requests than idle: "
                           "callgrind did not count it")
    return {"requests": requests, "seconds": {kind: round(value, 3) for kind, value in measured["seconds"].items()},
            "ring_cells_per_request": {kind: round(cells / requests, 2)
                                       for kind, cells in measured["ring_cells"].items()},
            "per_request": per, "idle_per_s": idle, "net_per_request": net,
            "on_over_off": {name: round(on[name] / off[name], 4) if off[name] else None for name in COUNTERS},
            "cache_over_lmcache": {name: round(net["mpcache"][name] / lmcache[name], 4) if lmcache[name] else None
                                   for name in COUNTERS}}


def _policies_per_request(measured: dict[str, Any]) -> dict[str, Any]:
    """Each policy's server per request, gross and net of idle, and every server over the first (net), also with
    the cyclic collector's instructions left out of both, in the counted window and in the idle one (a full
    collection falls in a window or not: its cost is real, but whether a 60-second window holds one is chance)."""
    requests = measured["requests"]
    per, net = {}, {}
    for kind, counts in measured["counts"].items():
        idle_per_s, seconds = measured["idle_per_s"][kind], measured["seconds"][kind]
        per[kind] = {name: round(sum(counts.get(event, 0) for event in events) / requests, 1)
                     for name, events in COUNTERS.items()}
        net[kind] = {name: round(max(0.0, per[kind][name] - sum(idle_per_s.get(event, 0) for event in events)
                                     * seconds / requests), 1) for name, events in COUNTERS.items()}
    first = next(iter(net.values()))
    collector = {kind: None if counted is None else {"collections": counted[0],
                                                     "instructions_per_request": round(counted[1] / requests, 1)}
                 for kind, counted in measured["collector"].items()}
    # net of idle already took out the idle window's collections (at its rate): they are put back before the
    # counted window's are taken out, so that none is taken out twice
    outside = {kind: one["instructions"] - (collector[kind] or {}).get("instructions_per_request", 0.0)
               + measured["idle_collector_per_s"][kind] * measured["seconds"][kind] / requests
               for kind, one in net.items()}
    first_outside = next(iter(outside.values()))
    return {"requests": requests, "per_request": per, "net_per_request": net, "collector": collector,
            "instructions_over_first_outside_collector": None if None in collector.values() else {
                kind: round(value / first_outside, 4) for kind, value in outside.items()},
            "evicted_chunks_per_request": {kind: round(count / requests, 2)
                                           for kind, count in measured["evicted_chunks"].items()},
            "hit_chunk_ratio": measured["hit_chunk_ratio"],
            "hit_chunks_per_request": {kind: round(chunks["hit_chunks"] / requests, 2)
                                       for kind, chunks in measured["chunks"].items()},
            "stored_chunks_per_request": {kind: round(chunks["stored_chunks"] / requests, 2)
                                          for kind, chunks in measured["chunks"].items()},
            "retrieve_steps_per_request": {kind: round(steps / requests, 3)  # a step retrieves (one call per
                                           for kind, steps in measured["retrieve_steps"].items()},  # rank) or not
            "server_calls_per_request": {kind: {op: round(count / requests, 3) for op, count in sorted(ops.items())
                                                if count}
                                         for kind, ops in measured["server_calls"].items()},
            "instructions_over_first": {kind: round(one["instructions"] / first["instructions"], 4)
                                        for kind, one in net.items()}}


def run(repetitions: int = 1, progress: Callable[[str], None] = lambda _: None, seconds: float = SECONDS,
        warmup_s: float = WARMUP_S, l1_gb: float = L1_GB, tps: tuple[int, ...] = TPS,
        idle_s: float = IDLE_S, policies: tuple[str, ...] = (), workload: str = "mixed") -> dict[str, Any]:
    """The three servers under callgrind (or one publishing mpcache server per policy of ``policies``), each TP
    measured once per repetition (the counts barely move), under ``workload``'s request mix (:data:`WORKLOADS`)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: expected one of {', '.join(WORKLOADS)}")
    require_valgrind()
    python = lmcache_python()
    per_tp: dict[str, list[dict[str, Any]]] = {f"tp{tp}": [] for tp in tps}
    for repetition in range(repetitions):
        with tempfile.TemporaryDirectory(prefix="mpcache-isolation-") as tmp:
            out_dir = os.path.join(tmp, "callgrind")
            os.mkdir(out_dir, 0o700)
            servers: list[Server] = []
            try:
                for index, (kind, policy) in enumerate(
                        [("mpcache", policy) for policy in policies] or [(kind, None) for kind in KINDS]):
                    servers.append(Server(kind, tmp, python, index, l1_gb, callgrind_dir=out_dir, l1_policy=policy))
                progress(f"isolation: repetition {repetition + 1}/{repetitions}: starting "
                         f"{', '.join(server.kind for server in servers)} under callgrind (a minute or more)")
                for server in servers:
                    server.wait_ready()
                for number, tp in enumerate(tps):
                    progress(f"isolation: repetition {repetition + 1}/{repetitions}, TP={tp}: {warmup_s:.0f} s of "
                             f"warm-up, {idle_s:.0f} s idle, then {seconds:.0f} s counted (all under callgrind)")
                    measured = _measure(python, servers, out_dir, tp, 2 * number + 1, seconds, warmup_s, idle_s,
                                        os.path.join(tmp, "workload.log"), WORKLOADS[workload])
                    unread = [kind for kind, counted in measured["collector"].items() if counted is None]
                    if unread:
                        progress(f"isolation: no call of {COLLECTOR} in the counted window of {', '.join(unread)}: "
                                 "the collector's share is not reported")
                    per_tp[f"tp{tp}"].append((_policies_per_request if policies else _per_request)(measured))
            finally:
                for server in servers:
                    server.stop()  # the dumps go with the temporary directory
    if policies:
        return {"policies": list(policies), "workload": workload, "l1_gb": l1_gb, "repetitions": repetitions,
                "seconds": seconds, "warmup_s": warmup_s, "tp": list(tps), **per_tp}
    return _report(per_tp, repetitions, seconds, warmup_s, idle_s)


def _report(per_tp: dict[str, list[dict[str, Any]]], repetitions: int, seconds: float, warmup_s: float,
            idle_s: float) -> dict[str, Any]:
    """The last repetition's counts per TP, every repetition's ratios, and the verdicts on the worst TP."""
    result: dict[str, Any] = {"repetitions": repetitions, "seconds": seconds, "warmup_s": warmup_s, "idle_s": idle_s,
                              "tp": [int(name[2:]) for name in per_tp]}
    costs, over_lmcache = [], []
    for name, rounds in per_tp.items():
        result[name] = {**rounds[-1],
                        "instructions_on_over_off_by_repetition":
                            [entry["on_over_off"]["instructions"] for entry in rounds],
                        "instructions_over_lmcache_by_repetition":
                            [entry["cache_over_lmcache"]["instructions"] for entry in rounds]}
        costs += [entry["on_over_off"]["instructions"] - 1 for entry in rounds]
        over_lmcache += [entry["cache_over_lmcache"]["instructions"] for entry in rounds]
    result["instructions_cost"] = round(max(costs), 4)
    result["cache_instructions_over_lmcache"] = max(over_lmcache)
    result["targets_met"] = {"instructions_cost": result["instructions_cost"] <= TARGET_INSTRUCTIONS_COST,
                             "cache_instructions_over_lmcache":
                                 result["cache_instructions_over_lmcache"] <= TARGET_CACHE_CPU_OVER_LMCACHE}
    return result
