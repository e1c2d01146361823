"""``python -m benchmarks.policy_matrix [--trace PATH ...] [--kinds [KIND ...]] [--requests N] [--first N] [--seed S]
[--policies P ...] [--jobs J]``:
L1's eviction orders replayed in process on every ``trace_gen`` kind (or those ``--kinds`` names; none: only the
``--trace`` files) and any Mooncake-format ``--trace``, at the three sizes of ``bench trace``, against the offline
LRU, ARC and a simulation of LMCache's server.

The service's ``bench trace`` takes minutes per trace and size; this takes seconds, so a policy change can be
judged on 8 traces × 3 sizes × (whole, first ``--first`` requests) before it goes near the service; ``--seed``
draws other traces of the same kinds, held out from whatever a change was tuned on.  Each
request is fed to a real :class:`~mpcache.cache.l1.L1Manager` (64-byte objects) as the LMCache front end drives
it: lookup (read-lock the found prefix), store the rest, release.  The references, from the same requests:
``lru`` and ``arc`` (``trace_sim``, exact, offline), ``wtinylfu`` (``trace_sim``: W-TinyLFU, Caffeine's policy, the
frequency-based state of the art; shown, not a bar) and ``lmcache_sim``: LMCache's server modelled as an LRU that
refuses a store it has no room for and, every k-th request, trims to 80 % of its capacity once above it (its
1 Hz eviction loop), the best over k in :data:`LMCACHE_PERIODS` (the real server's result swings with its
timing: ``bench trace`` runs it).  Flagged per row: a policy more than 0.005 below ``lru`` or ``arc``, or below
``lmcache_sim``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import Pool
from typing import Any

import numpy as np

from benchmarks import trace_gen
from benchmarks.null_cache import NullPublisher
from benchmarks.trace import SHARES
from benchmarks.trace_sim import (
    Outcome,
    TraceRequest,
    TraceUnreadable,
    arc,
    load,
    lru,
    lru_capacity_for,
    outcome,
    trace_name,
    wtinylfu,
)
from mpcache.cache.l1 import L1Manager
from mpcache.config.derived import L1_POLICIES

LMCACHE_PERIODS = (1, 5, 10, 20, 50, 100, 200)  # requests between two of the simulated server's trims
OBJECT_BYTES = 64
TOLERANCE = 0.005  # below the offline LRU or ARC by more than this is flagged (issue 39's bar)
REQUESTS, FIRST, SEED = 6000, 1500, 1  # each generated trace's length and seed; its first requests also replayed


def lmcache_sim(requests: list[TraceRequest], blocks: int, period: int) -> Outcome:
    """LMCache's server as an LRU of ``blocks`` that trims to 80 % every ``period`` requests once above it and
    drops a store it has no room for."""
    order: OrderedDict[int, None] = OrderedDict()
    found_per: list[int] = []
    for index, request in enumerate(requests):
        if index % period == 0 and len(order) >= 0.8 * blocks:
            for _ in range(max(1, int(0.2 * blocks))):
                if order:
                    order.popitem(last=False)
        found = 0
        for chunk in request.hashes:
            if chunk not in order:
                break
            found += 1
        for chunk in reversed(request.hashes[:found]):
            order.move_to_end(chunk)
        new = [chunk for chunk in request.hashes[found:] if chunk not in order]
        for chunk in request.hashes[found:]:
            if chunk in order:
                order.move_to_end(chunk)
        if len(order) + len(new) <= blocks:
            for chunk in reversed(new):
                order[chunk] = None
        found_per.append(found)
    return outcome(requests, found_per)


def l1_found(requests: list[TraceRequest], blocks: int, policy: str,
             after: Callable[[int, L1Manager], None] | None = None,
             groups: Sequence[tuple[str, str]] | None = None) -> list[int]:
    """``requests`` through an L1 of ``blocks`` objects under ``policy``: the prefix found per request.  ``after``:
    called with each request's index and the L1 once the request is done (a benchmark following the order);
    ``groups``: each request's model and tenant (None: one model, one tenant)."""
    l1 = L1Manager(np.zeros(blocks * OBJECT_BYTES, dtype=np.uint8), NullPublisher(), 1.0, OBJECT_BYTES,
                   policy=policy)
    found_per: list[int] = []
    for index, request in enumerate(requests):
        hashes = request.hashes
        model, salt = ("m", "") if groups is None else groups[index]
        found = l1.lock_prefix(model, salt, hashes, publish=False)
        reservation = l1.reserve_write(model, salt, hashes[found:])
        l1.commit_write(model, salt, [hashes[found + position] for position in reservation.positions], OBJECT_BYTES)
        l1.release_read(model, salt, hashes[:found])
        found_per.append(found)
        if after is not None:
            after(index, l1)
    return found_per


def sizes(requests: list[TraceRequest]) -> list[tuple[str, int]]:
    """``bench trace``'s three sizes for ``requests``, in blocks: where the offline LRU reaches each share of the
    infinite cache's hit ratio."""
    infinite = lru(requests, math.inf).hit_ratio
    return [(size, lru_capacity_for(requests, share, infinite)) for size, share in SHARES.items()]


def lmcache_best(requests: list[TraceRequest], blocks: int) -> float:
    """The simulated LMCache server's hit ratio at ``blocks``: the best over its trim periods."""
    return max(lmcache_sim(requests, blocks, k).hit_ratio for k in LMCACHE_PERIODS)


def flags(row: dict[str, Any], value: float) -> list[str]:
    """The references in ``row`` that the hit ratio ``value`` is flagged against: more than :data:`TOLERANCE` below
    ``lru`` or ``arc``, or below ``lmcache_sim``."""
    flagged = [ref for ref in ("lru", "arc") if value < row[ref] - TOLERANCE]
    return flagged + (["lmcache_sim"] if value < row["lmcache_sim"] else [])


def _rows(job: tuple[str, str, int | None, tuple[str, ...]]) -> list[dict[str, Any]]:
    name, path, limit, policies = job
    requests = load(path, limit)
    rows = []
    for size, blocks in sizes(requests):
        row: dict[str, Any] = {"trace": name, "requests": len(requests), "size": size, "blocks": blocks,
                               "lru": lru(requests, blocks).hit_ratio, "arc": arc(requests, blocks).hit_ratio,
                               "wtinylfu": wtinylfu(requests, blocks).hit_ratio,
                               "lmcache_sim": lmcache_best(requests, blocks)}
        for policy in policies:
            value = row[f"l1_{policy}"] = outcome(requests, l1_found(requests, blocks, policy)).hit_ratio
            row[f"flags_{policy}"] = flags(row, value)
        rows.append(row)
    return rows


_STOPS = {signal.SIGINT, signal.SIGTERM}
_FORK = multiprocessing.get_context("fork")  # the replays' workers are forked (:func:`worker_pool`)


def worker_signals() -> None:
    """A worker leaves Ctrl-C to its parent, whose leaving the pool terminates it, and ends on that SIGTERM
    without a word (it inherits the parent's SIGTERM handler, which would make a traceback of it); it takes both
    again, which :func:`worker_pool` held back while it forked it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)


@contextmanager
def worker_pool(processes: int) -> Iterator[Pool]:
    """A pool of ``processes`` forked workers (:func:`worker_signals`), terminated as the block ends.  Ctrl-C and
    SIGTERM (as Ctrl-C: the callers' handler) are held back while it starts, so one that comes then ends the block
    once the pool is whole, and while it is terminated, so a second one does not stop that half way: a pool left half
    built or half terminated leaves workers running, each waiting forever on a queue whose writing end it holds too.
    Forked, as another start method's resource tracker takes both signals back while the pool starts."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        pool = _FORK.Pool(processes, initializer=worker_signals)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        yield pool
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            pool.terminate()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def run(paths: dict[str, str], requests: int, first: int, policies: tuple[str, ...], jobs: int) -> list[dict[str, Any]]:
    """Every trace in ``paths`` (name → file), whole (up to ``requests``) and its first ``first`` requests."""
    work = [(name, path, limit, policies) for name, path in paths.items() for limit in (requests, first)]
    with worker_pool(min(jobs, len(work))) as pool:
        out = []
        for rows in pool.imap(_rows, work):
            out.extend(rows)
            print(f"[policy_matrix] {rows[0]['trace']} ({rows[0]['requests']} requests) done", file=sys.stderr,
                  flush=True)
    return out


def render(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> str:
    """The rows as a markdown table (``wtinylfu`` where the rows have it: rows kept from before it do not)."""
    columns = ["lru", "arc", *(["wtinylfu"] if "wtinylfu" in rows[0] else []), "lmcache_sim",
               *(f"l1_{policy}" for policy in policies)]
    lines = ["| trace | requests | size | blocks | " + " | ".join(columns) + " | "
             + " | ".join(f"{policy}: below" for policy in policies) + " |",
             "|" + "---|" * (4 + len(columns) + len(policies))]
    for row in rows:
        lines.append(f"| {row['trace']} | {row['requests']} | {row['size']} | {row['blocks']} | "
                     + " | ".join(f"{row[column]:.4f}" for column in columns) + " | "
                     + " | ".join(", ".join(row[f"flags_{policy}"]) or "–" for policy in policies) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.policy_matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", default=[], help="a Mooncake-format trace file (repeatable)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests of each generated trace (and the "
                        f"most read of a --trace file), at most {trace_gen.MAX_COUNT:,}")
    parser.add_argument("--first", type=int, default=FIRST, help="also replay each trace's first N requests")
    parser.add_argument("--seed", type=trace_gen.seed_argument, default=SEED,
                        help="the generated traces' seed, 0 or more (another: held-out traces)")
    parser.add_argument("--kinds", nargs="*", choices=sorted(trace_gen.KINDS), default=list(trace_gen.KINDS),
                        help="the trace_gen kinds replayed (all by default; none: only the --trace files)")
    parser.add_argument("--policies", nargs="+", choices=L1_POLICIES, default=["adaptive", "arc", "lru"])
    parser.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
    args = parser.parse_args(argv)
    for flag in ("requests", "first", "jobs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: expected at least 1")
    if args.requests > trace_gen.MAX_COUNT:
        parser.error(f"--requests {args.requests}: expected at most {trace_gen.MAX_COUNT:,} (built in memory)")
    if not args.kinds and not args.trace:
        parser.error("nothing to replay: no --trace file and no --kinds")
    names = [trace_name(path) for path in args.trace] + list(args.kinds)
    if twice := sorted({name for name in names if names.count(name) > 1}):
        parser.error(f"two traces named {', '.join(twice)} (a --trace file's name without .jsonl, or a --kinds "
                     "kind): name each once")
    for path in args.trace:
        try:
            load(path, args.requests)  # every request the replay will read, read once here
        except TraceUnreadable as exc:
            parser.error(f"--trace: not a readable Mooncake-format trace: {exc}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: workers and scratch go too
    try:
        with tempfile.TemporaryDirectory(prefix="mpcache-policy-matrix-") as scratch:  # 0700
            paths = {trace_name(path): path for path in args.trace}
            for kind in args.kinds:
                paths[kind] = os.path.join(scratch, f"{kind}.jsonl")
                trace_gen.write(trace_gen.KINDS[kind](args.requests, args.seed), paths[kind], args.seed)
            rows = run(paths, args.requests, args.first, tuple(args.policies), args.jobs)
    except KeyboardInterrupt:
        print("[policy_matrix] interrupted: its workers and scratch files are gone", file=sys.stderr)
        return 130
    print(json.dumps(rows, indent=1) if args.json else render(rows, tuple(args.policies)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
