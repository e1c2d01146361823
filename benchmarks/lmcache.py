"""Requests per second through LMCache's own vLLM adapters: mpcache against LMCache 0.5.6's MP server.

Four servers, each started fresh for every round and driven in turn. The two mpcache modes
always run back to back, and so do the two LMCache modes (each on/off pair shares the same
moment of a shared machine's background load); over every 4 rounds each server runs once in
each position (``ROUND_ORDERS``):

* ``mpcache``: ``python -m benchmarks.service ring --workers 1 --lmcache-port P`` — the
  product, with its telemetry process draining the rings and exporting every metric;
* ``mpcache_off``: the same with ``none`` (nothing published, no telemetry
  process);
* ``lmcache``: ``python -m lmcache.v1.multiprocess.server`` (engine-driven transfer, CPU,
  LRU, ``--max-workers 2`` request threads), observability on (its default);
* ``lmcache_off``: the same with ``--disable-observability``.

Every server gets the same L1 (``l1_gb``, ``--l1-gb``; default 0.25 GiB: mpcache's ``--l1-size``,
LMCache's ``--l1-size-gb``, which counts GiB); mpcache's slots are one rank's chunk object
(``--chunk-bytes 2MiB``). At 0.25 GiB LMCache refuses most stores (a full L1 between its
once-a-second eviction passes), which spares its clients the copies: the result says when the
servers' work differed (``comparable_work``, ``note``); ``--l1-gb 4`` makes it comparable. The load is
``benchmarks/harness/workload.py`` run with the LMCache venv's python (``.ci/lmcache-env``): LMCache's
scheduler and worker adapters with paged CPU KV caches, 4 new requests per step (half of them open
with one of 4 shared 2-chunk system prompts, a quarter continue a recent conversation, a quarter
are unrelated), each one lookup → prefetch status → retrieve the hits → store the misses →
end_session, with a sample of every retrieved chunk's bytes checked. It runs at TP=1 (8
layers, 2 KV heads of 128) and TP=2 (a model with 4 KV heads, 2 per rank), so every rank's
chunk object is 2 MiB, for ``WARMUP_S`` and then ``seconds`` measured, against each server.

Each round then runs the two mpcache modes side by side (``SIDE_BY_SIDE``): both serve at once and the
workload sends every step to each in turn (its ``--mirror``), so their cache processes' CPU is measured
over the same seconds; publishing's cost (``publish_cpu_cost``, on / off − 1) comes from these runs,
which a shared machine's drifting load tilts less (benchmarks/HISTORY.md has how much).

A round's value for a server is the mean of its TP=1 and TP=2 runs; the headline numbers are
medians over rounds. ``ratio_vs_lmcache`` = ``mpcache_rps / lmcache_rps`` and
``telemetry_on_over_off`` = ``mpcache_rps / mpcache_off_rps``, from the reported values; the
``paired`` section has the median of the same ratios taken within each round, which a machine
whose background load drifts disturbs less.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks import service_times
from benchmarks.children import kill_running
from benchmarks.lmcache_cpu import TIMED_OPS, cpu_report, median
from benchmarks.lmcache_servers import (
    LMCACHE_ENV,
    LMCACHE_MAX_WORKERS,
    OBJECT_BYTES,
    LagSampler,
    Server,
    lmcache_python,
)
from mpcache.shm.segment import Segment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = os.path.join(REPO, "benchmarks", "harness", "workload.py")
SERVERS = ("mpcache", "mpcache_off", "lmcache", "lmcache_off")
SIDE_BY_SIDE = ("mpcache", "mpcache_off")  # publishing's cost: both at once, the same steps to each in turn
# A B C D / D C B A / B A D C / C D A B: on/off pairs adjacent, every server once in every position.
ROUND_ORDERS = ((0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 3, 2), (2, 3, 0, 1))
TPS = (1, 2)
SECONDS = 10.0
WARMUP_S = 3.0
BATCH = 4
L1_GB = 0.25  # GiB: LMCache's --l1-size-gb counts 2**30 bytes
TARGET_RATIO_VS_LMCACHE = 1.0
TARGET_TELEMETRY_ON_OVER_OFF = 0.97


def _cpu_group(server: Server, first: Server, name: str) -> str:
    """The workload's name for one of ``server``'s CPU groups (``server``, ``telemetry``): as is for the
    first server, prefixed with its kind for a mirror."""
    return name if server is first else f"{server.kind}.{name}"


def _run_workload(python: str, servers: list[Server], tp: int, seconds: float, warmup_s: float, seed: int,
                  log_path: str, options: tuple[str, ...] = ()) -> dict[str, Any]:
    """The workload against ``servers[0]``, and side by side against the others (``--mirror``): the CPU of the
    first one's processes is reported as ``server``/``telemetry``, a mirror's as ``<kind>.server``.  ``options``:
    more of the workload's own options (its request mix)."""
    first = servers[0]
    argv = [python, WORKLOAD, "--url", f"tcp://127.0.0.1:{first.port}", "--tp", str(tp),
            "--seconds", str(seconds), "--warmup", str(warmup_s), "--batch", str(BATCH), "--seed", str(seed), *options]
    for server in servers[1:]:
        argv += ["--mirror", f"tcp://127.0.0.1:{server.port}"]
    for server in servers:
        for name, pids in server.cpu_pids().items():
            argv += [arg for pid in pids for arg in ("--cpu-pid", f"{_cpu_group(server, first, name)}={pid}")]
    what = " and ".join(server.kind for server in servers)
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
        raise RuntimeError(f"the workload against {what} (TP={tp}) exited {client.returncode} "
                           f"without a result; see {log_path}") from None
    if not result.get("ok"):
        raise RuntimeError(f"the workload against {what} (TP={tp}) failed: {result.get('reason')}")
    return result


def _cpu_ms_per_request(run: dict[str, Any], name: str) -> float:
    share = run.get("cpu_share", {}).get(name) or 0.0
    return round(share * 1000 / run["requests_per_s"], 3) if run["requests_per_s"] else 0.0


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
        **{f"{name}_cpu_ms_per_request": _cpu_ms_per_request(run, name) for name in ("client", "server", "telemetry")},
        "requests": run["requests"],
        "cpu_share": run.get("cpu_share", {}),
    }


def _accepted(counts: dict[str, int]) -> float:
    """Of the chunk objects the workload asked to store, the fraction the server reserved (the rest it refused)."""
    asked = counts["stored_objects"] + counts["store_skipped_objects"]
    return round(counts["stored_objects"] / asked, 4) if asked else 1.0


METRICS = ("rps", "store_gb_per_s", "retrieve_gb_per_s", "latency_p50_ms", "latency_p99_ms", "hit_chunk_ratio",
           "store_accepted_ratio", "client_cpu_ms_per_request", "server_cpu_ms_per_request",
           "telemetry_cpu_ms_per_request")
LAG_METRICS = ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "records_lost")


def _one_server(kind: str, tmp: str, python: str, index: int, l1_gb: float, tps: tuple[int, ...], seconds: float,
                warmup_s: float, seed: int, progress: Callable[[str], None], telemetry_nice: int = 0) -> dict[str, Any]:
    """Start one server, run the workload at every TP against it, stop it; the round's values for it."""
    runs: dict[str, Any] = {}
    server = Server(kind, tmp, python, index, l1_gb, telemetry_nice)
    ring: Segment | None = None
    sampler: LagSampler | None = None
    try:
        server.wait_ready()
        ring = server.ring()
        for tp in tps:
            sampler = LagSampler(ring) if ring is not None else None
            times_before = service_times.settled(server.prometheus_port) if ring is not None else None
            result = _run_workload(python, [server], tp, seconds, warmup_s, seed,
                                   os.path.join(tmp, f"workload-{kind}-{index}.log"))
            runs[f"tp{tp}"] = summary = _summary(result)
            if times_before is not None:  # over warm-up and measured window: the histogram's own numbers
                summary["server_times"] = times = service_times.summary(
                    service_times.difference(service_times.settled(server.prometheus_port), times_before))
                progress(f"{kind:11s} TP={tp} server-side p99 " + ", ".join(
                    f"{op} {v['p99_ms']:.3f} ms" for op, v in times.items() if op in TIMED_OPS))
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in result.get("cpu_share", {}).items() if v is not None)
            progress(f"{kind:11s} TP={tp} {result['requests_per_s']:7.1f} req/s, store {result['store_gb_per_s']:.2f} "
                     f"GB/s, retrieve {result['retrieve_gb_per_s']:.2f} GB/s, p50 {result['latency_p50_ms']:.1f} ms, "
                     f"p99 {result['latency_p99_ms']:.1f} ms; hits {result['hit_chunk_ratio']:.0%} of chunks, "
                     f"stores accepted {summary['store_accepted_ratio']:.0%}; CPU (cores) {cpu}")
            if sampler is not None:
                summary["drain"] = drain = sampler.finish()
                sampler = None
                progress(f"{kind:11s} TP={tp} telemetry drain lag p50 {drain['lag_p50_ms']:.1f} ms, p99 "
                         f"{drain['lag_p99_ms']:.1f} ms, max {drain['lag_max_ms']:.1f} ms, records lost "
                         f"{drain['records_lost']}")
    finally:
        if sampler is not None:
            sampler.finish()
        sampler = None
        if ring is not None:
            try:
                ring.close()
            except (BufferError, ValueError):
                pass  # a reader's view still pins the mapping; it goes with the process
        server.stop()
    runs.update({m: round(statistics.fmean(runs[f"tp{tp}"][m] for tp in tps), 4) for m in METRICS})
    return runs


def _side_by_side(tmp: str, python: str, index: int, l1_gb: float, tps: tuple[int, ...], seconds: float,
                  warmup_s: float, seed: int, progress: Callable[[str], None], telemetry_nice: int) -> dict[str, Any]:
    """Publishing's cost, measured with both mpcache modes serving at once: the workload sends every step to
    each in turn (``--mirror``), so their cache processes' CPU per request is taken over the same seconds,
    under the same background load. Per TP: each one's cache CPU ms per request and on / off − 1."""
    servers = [Server(kind, tmp, python, index + i, l1_gb, telemetry_nice) for i, kind in enumerate(SIDE_BY_SIDE)]
    runs: dict[str, Any] = {}
    try:
        for server in servers:
            server.wait_ready()
        for tp in tps:
            result = _run_workload(python, servers, tp, seconds, warmup_s, seed,
                                   os.path.join(tmp, f"workload-side-by-side-{index}.log"))
            rps = result["requests_per_s"]
            share = result["cpu_share"]
            groups = {server.kind: _cpu_group(server, servers[0], "server") for server in servers}
            cache = {kind: round(share[group] * 1000 / rps, 4) if rps and share.get(group) else 0.0
                     for kind, group in groups.items()}
            on, off = (cache[kind] for kind in SIDE_BY_SIDE)
            runs[f"tp{tp}"] = {"rps": rps, "cache_cpu_ms_per_request": cache,
                               "publish_cpu_cost": round(on / off - 1, 4) if off else 0.0}
            progress(f"side by side TP={tp} {rps:7.1f} req/s each; cache CPU per request {on:.3f} ms with "
                     f"telemetry, {off:.3f} ms without: publishing {runs[f'tp{tp}']['publish_cpu_cost']:+.1%}")
    finally:
        for server in servers:
            server.stop()
    runs["publish_cpu_cost"] = round(statistics.fmean(runs[f"tp{tp}"]["publish_cpu_cost"] for tp in tps), 4)
    return runs


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None, seconds: float = SECONDS,
        warmup_s: float = WARMUP_S, tps: tuple[int, ...] = TPS, l1_gb: float = L1_GB,
        telemetry_nice: int = 0) -> dict[str, Any]:
    python = lmcache_python()
    rounds = max(1, repetitions)
    orders = "/".join("".join("ABCD"[i] for i in ROUND_ORDERS[r % len(ROUND_ORDERS)]) for r in range(rounds))
    progress(f"lmcache: servers A {SERVERS[0]}, B {SERVERS[1]}, C {SERVERS[2]}, D {SERVERS[3]} "
             f"(L1 {l1_gb:g} GiB each), TP {tps}, telemetry nice {telemetry_nice}, {warmup_s:g} s warm-up + "
             f"{seconds:g} s per server and TP, {rounds} rounds ({orders})")
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mpcache-lmbench-") as tmp:
        index = 0
        for r in range(rounds):
            order = [SERVERS[i] for i in ROUND_ORDERS[r % len(ROUND_ORDERS)]]
            this_round: dict[str, Any] = {"order": order}
            seed = 1000 + r  # every server sees the same request sequence in a round

            def tell(line: str, r: int = r) -> None:
                progress(f"  round {r + 1}: {line}")

            for kind in order:
                index += 1
                this_round[kind] = _one_server(kind, tmp, python, index, l1_gb, tps, seconds, warmup_s, seed, tell,
                                               telemetry_nice)
            this_round["side_by_side"] = _side_by_side(tmp, python, index + 1, l1_gb, tps, seconds, warmup_s, seed,
                                                       tell, telemetry_nice)
            index += len(SIDE_BY_SIDE)
            per_round.append(this_round)
    result = _report(per_round, rounds, seconds, warmup_s, tps, l1_gb)
    result["telemetry_nice"] = telemetry_nice
    return result


def _report(per_round: list[dict[str, Any]], rounds: int, seconds: float, warmup_s: float,
            tps: tuple[int, ...], l1_gb: float = L1_GB) -> dict[str, Any]:
    servers: dict[str, Any] = {}
    for kind in SERVERS:
        entry: dict[str, Any] = {m: round(median([rd[kind][m] for rd in per_round]), 4) for m in METRICS}
        for tp in tps:
            key = f"tp{tp}"
            entry[key] = {m: round(median([rd[kind][key][m] for rd in per_round]), 4) for m in METRICS}
            entry[key]["op_p50_ms"] = {op: round(median([rd[kind][key]["op_p50_ms"][op] for rd in per_round]), 3)
                                       for op in per_round[0][kind][key]["op_p50_ms"]}
            shares = {name for rd in per_round for name in rd[kind][key]["cpu_share"]}
            entry[key]["cpu_share"] = {
                name: round(median([v for rd in per_round
                                     if (v := rd[kind][key]["cpu_share"].get(name)) is not None]), 3)
                for name in sorted(shares)}
            times = [rd[kind][key]["server_times"] for rd in per_round if "server_times" in rd[kind][key]]
            if times:
                entry[key]["server_op_p99_ms"] = {
                    op: round(median([t[op]["p99_ms"] for t in times if op in t]), 3)
                    for op in sorted({op for t in times for op in t})}
            drains = [rd[kind][key]["drain"] for rd in per_round if "drain" in rd[kind][key]]
            if drains:
                entry[key]["drain"] = {m: round(median([d[m] for d in drains]), 1) for m in LAG_METRICS}
                entry[key]["drain"]["records_lost"] = sum(d["records_lost"] for d in drains)
        servers[kind] = entry
    rps = {kind: round(servers[kind]["rps"], 2) for kind in SERVERS}
    ratio = round(rps["mpcache"] / rps["lmcache"], 4) if rps["lmcache"] else 0.0
    on_off = round(rps["mpcache"] / rps["mpcache_off"], 4) if rps["mpcache_off"] else 0.0
    accepted = {kind: servers[kind]["store_accepted_ratio"] for kind in SERVERS}
    comparable = abs(accepted["mpcache"] - accepted["lmcache"]) <= 0.05
    cpu = cpu_report(servers, per_round, tps)
    result = {
        "benchmark": "lmcache",
        "rounds": rounds,
        "seconds_per_run": seconds,
        "warmup_s": warmup_s,
        "tp": list(tps),
        "batch": BATCH,
        "object_bytes_per_rank": OBJECT_BYTES,
        "l1_bytes": int(l1_gb * 2**30),
        "lmcache_max_workers": LMCACHE_MAX_WORKERS,
        "mpcache_rps": rps["mpcache"],
        "mpcache_off_rps": rps["mpcache_off"],
        "lmcache_rps": rps["lmcache"],
        "lmcache_off_rps": rps["lmcache_off"],
        "ratio_vs_lmcache": ratio,
        "telemetry_on_over_off": on_off,
        "lmcache_server_cpu_per_request_over_mpcache": (
            round(servers["lmcache"]["server_cpu_ms_per_request"] / servers["mpcache"]["server_cpu_ms_per_request"], 3)
            if servers["mpcache"]["server_cpu_ms_per_request"] else 0.0),
        "lmcache_observability_on_over_off": (round(rps["lmcache"] / rps["lmcache_off"], 4)
                                              if rps["lmcache_off"] else 0.0),
        "paired": {
            name: {"median": round(median(values), 4), "per_round": [round(v, 4) for v in values]}
            for name, values in (
                ("ratio_vs_lmcache", [rd["mpcache"]["rps"] / rd["lmcache"]["rps"] for rd in per_round]),
                ("telemetry_on_over_off", [rd["mpcache"]["rps"] / rd["mpcache_off"]["rps"] for rd in per_round]),
                ("lmcache_observability_on_over_off",
                 [rd["lmcache"]["rps"] / rd["lmcache_off"]["rps"] for rd in per_round]),
            )
        },
        "servers": servers,
        "target_ratio_vs_lmcache": TARGET_RATIO_VS_LMCACHE,
        "target_telemetry_on_over_off": TARGET_TELEMETRY_ON_OVER_OFF,
        "cpu": cpu,
        "targets_met": {"ratio_vs_lmcache": ratio >= TARGET_RATIO_VS_LMCACHE,
                        "telemetry_on_over_off": on_off >= TARGET_TELEMETRY_ON_OVER_OFF,
                        **cpu["targets_met"]},
        "store_accepted_ratio": accepted,
        "comparable_work": comparable,
        "per_round": per_round,
    }
    if not comparable:
        result["note"] = (
            f"the servers did not do the same work: mpcache reserved {accepted['mpcache']:.0%} of the chunk objects "
            f"asked to be stored, LMCache {accepted['lmcache']:.0%} (LMCache refuses a whole store while its L1 is "
            "full between once-a-second eviction passes); a refused store skips the client's copy, so requests/s "
            "are not like for like: compare hit_chunk_ratio and store GB/s too, or rerun with a larger --l1-gb")
    return result


def for_report(result: dict[str, Any]) -> dict[str, Any]:
    """What docs/PERFORMANCE.md keeps: the headline, the paired ratios and each server's medians (no per-round
    detail)."""
    slim = {key: value for key, value in result.items() if key not in ("per_round", "servers", "paired")}
    slim["paired"] = {name: entry["median"] for name, entry in result["paired"].items()}
    slim["servers"] = {
        kind: {**{m: entry[m] for m in METRICS},
               **{f"tp{tp}_rps": entry[f"tp{tp}"]["rps"] for tp in result["tp"]},
               **{f"tp{tp}_drain": entry[f"tp{tp}"]["drain"] for tp in result["tp"] if "drain" in entry[f"tp{tp}"]}}
        for kind, entry in result["servers"].items()
    }
    return slim
