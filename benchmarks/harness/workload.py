#!/usr/bin/env python3
"""A timed serving workload through LMCache 0.5.6's own vLLM adapters, for benchmarks.

Run with the interpreter of the venv that ``.ci/lmcache-env`` builds, against any
LMCache-0.5.6-compatible MP server (mpcache with ``--lmcache-port``, or LMCache's own)::

    "$(.ci/lmcache-env | tail -n1)/bin/python" benchmarks/harness/workload.py \
        --url tcp://127.0.0.1:5555 --tp 1 --seconds 10 --warmup 3

The engine (one ``LMCacheMPSchedulerAdapter``, one ``LMCacheMPWorkerAdapter`` per TP rank,
paged CPU KV tensors, engine-driven shared-memory transfer) is ``driver.py``'s ``Engine``.
Each step takes ``--batch`` new requests, as one vLLM scheduler step would, and runs:
lookup (+ prefetch-status polling) for all → retrieve the hit prefixes (one batched call
per rank) → store the missed chunks (one batched call per rank) → end_session.

Requests: ``--shared-fraction`` of them start with one of ``--system-prompts`` system
prompts of ``--system-chunks`` chunks followed by a new user turn; ``--followup-fraction``
continue a recent conversation (its whole earlier prompt, then a new turn); the rest are
new, unrelated prompts. Every prompt ends in a partial chunk, which is never stored.

Geometry: ``--layers`` × ``--kv-heads`` (split over TP) × ``--head-size``, float16; the
default (8 layers, 2 KV heads per rank, head size 128) makes every rank's chunk object
2 × 8 × 256 × 256 × 2 bytes = 2 MiB, at TP=1 and at TP=2 (a model with twice the KV heads).

Verification is a cheap sample: storing writes a stamp derived from the chunk's prefix
identity, the rank, the layer and the K/V plane into the first and the last token of every
chunk in the first and the last layer; before a retrieve those positions are zeroed, after
it they must hold the stamps again. The rest of each block keeps whatever bytes it had.

After ``--warmup`` seconds (which also fill the server's L1) it counts for ``--seconds``
and prints ONE JSON line on stdout: requests/s, stored and retrieved GB/s (10^9 bytes of
chunk objects the server reserved / handed out, all ranks), p50/p99 latency of a request
(lookup submit → end_session) and of each step operation, hit ratio and error counts, and the
CPU share (cores) over the window of this process ("client") and of every ``--cpu-pid`` group
(schedstat's nanoseconds; clock ticks for a process whose threads changed during the window).

``--mirror URL`` (repeatable) drives more servers side by side: each gets its own adapters and
KV caches and the same requests (the same seed), every step goes to each server in turn (the
first one rotating), and each server's numbers are reported under ``mirrors`` (the first
``--url``'s at the top level). Their CPU is then measured over the same seconds, under the
same background load, which comparing servers run one after the other cannot give.
Exit status: 0 ok, 1 errors during the run (see ``reason``), 2 setup failed, 3 overran.
"""

from __future__ import annotations

import os

# Before anything imports lmcache: no usage reports leave this machine.
os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import argparse
import collections
import json
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import driver
import numpy as np
import torch
from driver import (
    DTYPES,
    Counters,
    Deadline,
    Engine,
    Request,
    ScenarioFailure,
    prefix_hashes,
)

GB = 1e9
OPS = ("lookup", "retrieve", "store", "end_session")


def process_cpu(pid: int) -> tuple[float, frozenset[str], int] | None:
    """(user + system CPU seconds of every thread, live or exited, in clock ticks; the live thread ids;
    their summed on-CPU nanoseconds from schedstat) of a process (Linux /proc); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        tids = frozenset(os.listdir(f"/proc/{pid}/task"))
        ns = 0
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as handle:
                ns += int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), tids, ns


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, list[Any] | None]:
    # this process: its own clock, in nanoseconds, read as one unchanging thread set
    out: dict[str, list[Any] | None] = {"client": [(time.process_time(), frozenset(["self"]),
                                                    time.process_time_ns())]}
    for name, group in pids.items():
        values = [process_cpu(pid) for pid in group]
        out[name] = None if any(v is None for v in values) else values
    return out


def cpu_seconds(before: list[Any] | None, after: list[Any] | None) -> float | None:
    """CPU seconds a group spent between two snapshots: nanoseconds from schedstat where every process kept
    the same threads, its clock ticks (10 ms steps, exited threads included) where threads came or went."""
    if before is None or after is None:
        return None
    total = 0.0
    for (ticks0, tids0, ns0), (ticks1, tids1, ns1) in zip(before, after):
        total += (ns1 - ns0) / 1e9 if tids0 == tids1 else ticks1 - ticks0
    return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Workload:
    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.e = engine
        self.args = args
        self.geo = engine.geo
        self.chunk = engine.chunk
        self.bpc = engine.blocks_per_chunk
        self.rng = random.Random(args.seed)
        self.np_rng = np.random.default_rng(args.seed)
        self.system_prompts = [self.tokens(args.system_chunks * self.chunk)
                               for _ in range(args.system_prompts)]
        self.recent: collections.deque[list[int]] = collections.deque(maxlen=args.recent)
        self.sample_layers = sorted({0, self.geo.layers - 1})
        self.int_dtype = DTYPES[self.geo.dtype][1]
        self.width = self.geo.heads_per_rank * self.geo.head_size
        self.verify_failures = 0
        self.verified_chunks = 0  # retrieved chunks whose sampled cells (every rank) matched
        self.first_verify_failure = ""
        self.retrieve_failures = 0
        self.store_failures = 0

    # -- prompts --

    def tokens(self, n: int) -> list[int]:
        return self.np_rng.integers(1, 150_000, n).tolist()

    def turn(self) -> list[int]:
        lo, hi = self.args.turn_chunks
        return self.tokens(self.rng.randint(lo, hi) * self.chunk + self.rng.randrange(1, self.chunk))

    def next_prompt(self) -> list[int]:
        a = self.args
        r = self.rng.random()
        if r < a.followup_fraction and self.recent:
            earlier = self.rng.choice(self.recent)
            tokens = earlier + self.turn()
            if len(tokens) // self.chunk <= a.max_chunks:
                self.recent.append(tokens)
                return tokens
            r = a.followup_fraction  # too long: start a conversation instead
        if r < a.followup_fraction + a.shared_fraction:
            tokens = self.rng.choice(self.system_prompts) + self.turn()
        else:
            tokens = self.turn() + self.turn()
        self.recent.append(tokens)
        return tokens

    # -- sampled content --

    def _samples(self, req: Request, first: int, last: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Where chunks [first, last) are sampled, and what a rank-0, layer-0 stamp holds there.

        Index: (plane, block, token) for the first token of each chunk's first block and the
        last token of its last block, K plane then V plane. Values: [cells, width] integers
        from the chunk's prefix identity, V plane offset from K.
        """
        ids = prefix_hashes(req.tokens[: last * self.chunk], self.chunk)[first:last]
        blocks, toks = [], []
        for c in range(first, last):
            blocks += [req.blocks[c * self.bpc], req.blocks[(c + 1) * self.bpc - 1]]
            toks += [0, self.geo.block_size - 1]
        n = len(blocks)
        index = (torch.tensor([0] * n + [1] * n), torch.tensor(blocks * 2), torch.tensor(toks * 2))
        base = np.frombuffer(b"".join(ids), dtype=np.int16).reshape(len(ids), -1).repeat(2, axis=0)  # [n, 8]
        reps = -(-self.width // base.shape[1])
        values = np.tile(np.concatenate([base, base + 3]), (1, reps))[:, : self.width]
        return index, torch.from_numpy(values).to(self.int_dtype)

    def _view(self, rank: int, layer: int) -> torch.Tensor:
        return self.e._layer_view(rank, layer)  # [2, blocks, block_size, heads, head], integer view

    def _each(self, req: Request, first: int, last: int):
        index, values = self._samples(req, first, last)
        for rank in range(self.geo.tp):
            for layer in self.sample_layers:
                yield self._view(rank, layer), index, values + (rank * 31 + layer * 7 + 1), rank, layer

    def write_stamps(self, req: Request, first: int, last: int) -> None:
        for view, index, values, _, _ in self._each(req, first, last):
            view[index] = values.view(-1, self.geo.heads_per_rank, self.geo.head_size)

    def clear_stamps(self, req: Request, first: int, last: int) -> None:
        for view, index, _, _, _ in self._each(req, first, last):
            view[index] = 0

    def check_stamps(self, req: Request, first: int, last: int) -> None:
        for view, index, values, rank, layer in self._each(req, first, last):
            got = view[index].reshape(values.shape)
            if not torch.equal(got, values):
                self.verify_failures += 1
                if not self.first_verify_failure:
                    bad = int((got != values).any(dim=1).nonzero()[0])
                    chunk = first + (bad % (2 * (last - first))) // 2
                    plane = "KV"[bad // (2 * (last - first))]
                    self.first_verify_failure = (f"{req.rid}: chunk {chunk} rank {rank} layer {layer} "
                                                 f"plane {plane} differs from what was stored")
                return
        self.verified_chunks += last - first

    # -- one step --

    def step(self, dl: Deadline, times: dict[str, list[float]], latencies: list[float]) -> int:
        e = self.e
        reqs = []
        for _ in range(self.args.batch):
            r = Request(rid=e.new_rid("wl"), tokens=self.next_prompt())
            e.alloc(r)
            reqs.append(r)
        t0 = time.perf_counter()
        e.lookup_many(reqs, dl)
        t1 = time.perf_counter()
        hits = [r.lmcache_hit_tokens // self.chunk for r in reqs]
        retrieving = []
        for r, h in zip(reqs, hits):
            if e.after_alloc(r):
                self.clear_stamps(r, 0, h)
                retrieving.append(r)
        t2 = time.perf_counter()
        if retrieving:
            try:
                e.retrieve_many(retrieving, dl)
            except ScenarioFailure:
                self.retrieve_failures += 1
        t3 = time.perf_counter()
        for r, h in zip(reqs, hits):
            if h and r in retrieving:
                self.check_stamps(r, 0, h)
            full = len(r.tokens) // self.chunk
            if full > h:
                self.write_stamps(r, h, full)  # "compute" the missed chunks
        t4 = time.perf_counter()
        try:
            e.store_many(reqs, dl)
        except ScenarioFailure:
            self.store_failures += 1
        t5 = time.perf_counter()
        for r in reqs:
            e.end_session(r)
        t6 = time.perf_counter()
        for r in reqs:
            e.release(r)
        times["lookup"].append(t1 - t0)
        if retrieving:
            times["retrieve"].append(t3 - t2)
        times["store"].append(t5 - t4)
        times["end_session"].append(t6 - t5)
        latencies.extend([t6 - t0] * len(reqs))
        return len(reqs)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", nargs="+", required=True, action="extend", help="server URL(s)")
    ap.add_argument("--mirror", action="append", default=[], metavar="URL",
                    help="also drive this server with the same requests, each step against every server in "
                    "turn, so that all are measured over the same seconds (repeatable; reported under 'mirrors')")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--seconds", type=float, default=10.0, help="measured wall time")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds run before measuring")
    ap.add_argument("--batch", type=int, default=4, help="new requests per step")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads in total (default 2 x --tp)")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-chunks", type=int, default=2)
    ap.add_argument("--shared-fraction", type=float, default=0.5,
                    help="new conversations that start with a shared system prompt")
    ap.add_argument("--followup-fraction", type=float, default=0.25,
                    help="requests that continue a recent conversation")
    ap.add_argument("--turn-chunks", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"),
                    help="full chunks of a new turn (plus a partial one)")
    ap.add_argument("--max-chunks", type=int, default=10, help="longest prompt, in chunks")
    ap.add_argument("--recent", type=int, default=32, help="conversations a follow-up picks from")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="paged blocks per rank (default: enough for one step)")
    ap.add_argument("--poll-ms", type=float, default=0.5, help="sleep between lookup-result polls")
    ap.add_argument("--model-name", default="")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--mq-timeout", type=float, default=20.0)
    ap.add_argument("--heartbeat-interval", type=float, default=10.0)
    ap.add_argument("--op-timeout", type=float, default=30.0, help="deadline of one step")
    ap.add_argument("--timeout", type=float, default=None, help="whole run (default warmup+seconds+120)")
    ap.add_argument("--cpu-pid", action="append", default=[], metavar="NAME=PID",
                    help="also report this process's CPU time over the measured window, summed per NAME "
                    "(repeatable); this process's own is reported as 'client'")
    args = ap.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = 2 * args.tp
    if args.kv_heads % args.tp:
        ap.error("--kv-heads must be divisible by --tp")
    if args.tp % len(args.url):
        ap.error("--tp must be a multiple of the number of --url servers")
    if args.seed is None:
        args.seed = (time.time_ns() ^ (os.getpid() << 20)) % 1_000_000_007
    if args.timeout is None:
        args.timeout = args.warmup + args.seconds + 120.0
    args.cpu_pids = {}
    for item in args.cpu_pid:
        name, _, pid = item.partition("=")
        if not name or not pid.isdigit():
            ap.error(f"--cpu-pid wants NAME=PID, got {item!r}")
        args.cpu_pids.setdefault(name, []).append(int(pid))
    blocks_per_chunk = 256 // args.block_size
    if args.num_blocks is None:
        args.num_blocks = args.batch * (args.max_chunks + args.turn_chunks[1] + 2) * blocks_per_chunk
    # what driver.Engine reads (the chunk alignment only with LMCache 0.5.7: the block size, as vLLM's connector)
    args.mla = False
    args.chunk_alignment = args.block_size
    return args


def emit(result: dict[str, Any]) -> None:
    sys.stderr.flush()
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


class Run:
    """One server's side of the run: its engine, its requests (the same as every other side's), its tallies."""

    def __init__(self, args: argparse.Namespace, urls: list[str]) -> None:
        self.urls = urls
        self.counters = Counters()
        self.engine = Engine(argparse.Namespace(**{**vars(args), "url": urls}), self.counters)
        self.workload = Workload(self.engine, args)
        self.times: dict[str, list[float]] = {op: [] for op in OPS}
        self.latencies: list[float] = []
        self.requests = 0

    def start_window(self) -> None:
        self.before = self.counters.snapshot()
        wl = self.workload
        self.failures_before = (wl.retrieve_failures, wl.store_failures, wl.verify_failures)
        self.verified_before = wl.verified_chunks

    def step(self, deadline: Deadline, measured: bool) -> None:
        if measured:
            self.requests += self.workload.step(deadline, self.times, self.latencies)
        else:
            self.workload.step(deadline, {op: [] for op in OPS}, [])

    def report(self, elapsed: float) -> dict[str, Any]:
        """This side's numbers over the measured window (``ok`` false, with a ``reason``, on any error)."""
        wl, times, latencies = self.workload, self.times, self.latencies
        counts = driver.diff(self.counters.snapshot(), self.before)
        obj_bytes = self.engine.geo.object_bytes(self.engine.chunk)
        errors = {
            "retrieve_failed_steps": wl.retrieve_failures - self.failures_before[0],
            "store_failed_steps": wl.store_failures - self.failures_before[1],
            "verify_failures": wl.verify_failures - self.failures_before[2],
            "prepare_retrieve_misses": counts["retrieve_failures"],
            "store_commit_failures": counts["store_commit_failures"],
        }
        looked_up_chunks = counts["hit_chunks"] + counts["stored_chunks"]
        result: dict[str, Any] = dict(
            urls=self.urls,
            model_name=self.engine.model_name,
            object_bytes=obj_bytes,
            requests=self.requests,
            requests_per_s=round(self.requests / elapsed, 2),
            store_gb_per_s=round(counts["stored_objects"] * obj_bytes / elapsed / GB, 4),
            retrieve_gb_per_s=round(counts["retrieved_objects"] * obj_bytes / elapsed / GB, 4),
            latency_p50_ms=round(percentile(latencies, 0.50) * 1000, 3),
            latency_p99_ms=round(percentile(latencies, 0.99) * 1000, 3),
            op_latency_ms={op: {"p50": round(percentile(v, 0.50) * 1000, 3),
                                "p99": round(percentile(v, 0.99) * 1000, 3), "n": len(v)}
                           for op, v in times.items()},
            hit_chunk_ratio=round(counts["hit_chunks"] / looked_up_chunks, 4) if looked_up_chunks else 0.0,
            counts={k: counts[k] for k in ("lookups", "hit_chunks", "stored_chunks", "stored_objects",
                                           "store_skipped_objects", "retrieved_chunks", "retrieved_objects")},
            verified_chunks=wl.verified_chunks - self.verified_before,
            errors=errors,
        )
        result["ok"] = not any(errors.values())
        if not result["ok"]:
            result["reason"] = wl.first_verify_failure or "errors during the run: " + ", ".join(
                f"{k}={v}" for k, v in errors.items() if v)
        return result


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    driver.POLL_S = args.poll_ms / 1000.0  # the driver's lookup/finish polling interval
    result: dict[str, Any] = {"ok": False, "urls": args.url, "tp": args.tp, "batch": args.batch,
                              "seed": args.seed}
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(args.timeout):
            result["reason"] = f"workload overran --timeout {args.timeout}s"
            emit(result)
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    runs: list[Run] = []
    try:
        for urls in [args.url] + [[url] for url in args.mirror]:
            runs.append(Run(args, urls))
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        traceback.print_exc(file=sys.stderr)
        result["reason"] = f"setup failed: {type(exc).__name__}: {exc}"
        done.set()
        emit(result)
        for run in runs:
            run.engine.shutdown()
        return 2
    result["geometry"] = {"layers": args.layers, "kv_heads": args.kv_heads, "head_size": args.head_size,
                          "block_size": args.block_size, "dtype": args.dtype, "num_blocks": args.num_blocks}

    def steps(measured: bool, until: Callable[[], bool], what: str) -> None:
        n = 0
        while not until():  # each step's first side rotates, so that none always goes first
            for run in runs[n % len(runs):] + runs[: n % len(runs)]:
                run.step(Deadline(args.op_timeout, what), measured)
            n += 1

    try:
        warm_end = time.monotonic() + args.warmup
        steps(False, lambda: time.monotonic() >= warm_end, "warm-up step")
        for run in runs:
            run.start_window()
        cpu_before = cpu_snapshot(args.cpu_pids)
        t0 = time.monotonic()
        steps(True, lambda: time.monotonic() - t0 >= args.seconds, "step")
        elapsed = time.monotonic() - t0
        cpu_after = cpu_snapshot(args.cpu_pids)
        for run in runs:
            run.engine.check_health()
    except ScenarioFailure as exc:
        result["reason"] = str(exc)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        result["reason"] = f"{type(exc).__name__}: {exc}"
    else:
        reports = [run.report(elapsed) for run in runs]
        result.update(reports[0], seconds=round(elapsed, 3), warmup_s=args.warmup, mirrors=reports[1:])
        result["cpu_share"] = {name: (None if (seconds := cpu_seconds(cpu_before[name], cpu_after[name])) is None
                                      else round(seconds / elapsed, 4)) for name in cpu_before}
        result["ok"] = all(report["ok"] for report in reports)
        if not result["ok"]:
            result["reason"] = "; ".join(f"{report['urls'][0]}: {report['reason']}"
                                         for report in reports if not report["ok"])
    finally:
        for run in runs:
            run.engine.shutdown()
    done.set()
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
