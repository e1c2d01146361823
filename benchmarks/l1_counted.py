"""``python -m benchmarks.l1_counted [--requests N] [--warmup N] [--jobs J] [--policies P,...] [--json]``: what each
L1 eviction order costs a request, counted: the instructions (callgrind's Ir) :class:`~mpcache.cache.l1.L1Manager`
executes over the same requests, one process per policy, L1 size and workload, and each policy's count over
``lru``'s.

:mod:`benchmarks.isolation` counts the whole cache process behind LMCache's own client, where L1 is one part of a
request beside the wire, the front end and the ring, which move the count between runs; this holds them still, so a
change to the order shows here alone, the same in every run to within a few hundred instructions a request
(``PYTHONHASHSEED`` fixed, numpy's BLAS on one thread, nothing timed).  Each request does to L1 what an LMCache
store after a lookup does: look its chunks up (read-locking the prefix L1 holds), reserve the rest (evicting, L1
being full after the warm-up), commit them and release the locks.  Workloads: ``unique``, :data:`NEW_CHUNKS` new
chunks a request (``isolation --workload unique``'s shape); ``shared``, one of :data:`SHARED_PREFIXES` prefixes of
:data:`PREFIX_CHUNKS` chunks in turn, then :data:`NEW_CHUNKS` new ones (lookups find chunks); ``tenants``,
``shared`` with every :data:`TENANT_CYCLE`-th request another tenant's (cache salt), so that ``adaptive``'s fair shares
count and spare (two groups active: :mod:`~mpcache.eviction.fairness`).  Sizes (:data:`L1_OBJECTS`): an L1 of 32
objects, where a store of more than 3 new chunks is large (so ``adaptive`` watches every store for its return from
the first on), and one of 2,048, where none is.  In the larger one no evicted chunk is asked for again in any
workload, so ``adaptive`` is counted in its recency phase (no ghost hit, no split): ARC's phase and the phase tests
are not in the count.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks import counted_side
from benchmarks.isolation import require_valgrind
from mpcache.config.derived import L1_POLICIES

OBJECT_BYTES = 64  # no pool byte is touched: the size only sets how many objects L1 holds
L1_OBJECTS = (32, 2048)
NEW_CHUNKS = 5
SHARED_PREFIXES, PREFIX_CHUNKS = 4, 3
TENANTS, TENANT_CYCLE = ("", "b"), 10  # ``tenants``: the cache salts; every tenth request is the second one's
WORKLOADS = ("unique", "shared", "tenants")
REQUESTS, WARMUP = 4000, 1000
DONE_TIMEOUT_S = 1800.0  # per REQUESTS counted requests, instrumented: ~50 times slower than natively
HASH_SEED = "0"  # the processes' string hashes, hence the dicts' layouts, hence the count: the same every run
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # numpy's idle BLAS threads add to a count


def _request(workload: str, number: int) -> tuple[str, list[int]]:
    """Request ``number``'s cache salt (its tenant) and chunk hashes: new ones from a range no other request uses,
    after a shared prefix."""
    new = list(range((number + 1) << 8, ((number + 1) << 8) + NEW_CHUNKS))
    if workload == "unique":
        return "", new
    prefix = number % SHARED_PREFIXES
    salt = TENANTS[number % TENANT_CYCLE == TENANT_CYCLE - 1] if workload == "tenants" else ""
    return salt, list(range(prefix * PREFIX_CHUNKS + 1, (prefix + 1) * PREFIX_CHUNKS + 1)) + new


def run_requests(l1: Any, workload: str, first: int, count: int) -> int:
    """Requests ``first`` to ``first + count`` through ``l1`` as the LMCache front end drives it; the chunks found."""
    found_chunks = 0
    for number in range(first, first + count):
        salt, hashes = _request(workload, number)
        found = l1.lock_prefix("m", salt, hashes)
        reserved = l1.reserve_write("m", salt, hashes[found:])
        l1.commit_write("m", salt, [hashes[found + position] for position in reserved.positions], OBJECT_BYTES)
        l1.release_read("m", salt, hashes[:found])
        found_chunks += found
    return found_chunks


def child(policy: str, objects: int, workload: str, requests: int, warmup: int) -> int:
    """One counted side: built and warmed up, it says ``ready`` and waits for a line; then it runs the requests,
    says ``done`` and the chunks its lookups found, and waits for a line before it exits."""
    import numpy as np

    from benchmarks.null_cache import NullPublisher
    from mpcache.cache.l1 import L1Manager

    l1 = L1Manager(np.zeros(objects * OBJECT_BYTES, dtype=np.uint8), NullPublisher(), 1.0, OBJECT_BYTES,
                   policy=policy)
    run_requests(l1, workload, 0, warmup)
    if l1.usage < 1.0:  # the count would miss the evictions every request pays once L1 is full
        sys.stderr.write(f"benchmarks.l1_counted: error: {warmup} warm-up requests leave L1 of {objects} objects "
                         f"{l1.usage:.0%} full: give more (--warmup)\n")
        return 2
    print("ready", flush=True)
    sys.stdin.readline()
    found = run_requests(l1, workload, warmup, requests)
    print("done", found, flush=True)
    sys.stdin.readline()
    return 0


def count(policy: str, objects: int, workload: str, requests: int, warmup: int, directory: str) -> dict[str, Any]:
    """``policy``'s instructions a request on ``workload`` in an L1 of ``objects``, and the chunks it found."""
    instructions, done = counted_side.count(
        ["benchmarks.l1_counted", "--child", policy, str(objects), workload, "--requests", str(requests), "--warmup",
         str(warmup)], directory, DONE_TIMEOUT_S * max(1.0, requests / REQUESTS),
        {"PYTHONHASHSEED": HASH_SEED, **ONE_THREAD})
    found = int(done[1])
    return {"policy": policy, "objects": objects, "workload": workload,
            "instructions_per_request": round(instructions / requests), "found_per_request": found / requests}


def run(requests: int = REQUESTS, warmup: int = WARMUP, jobs: int = 2, policies: tuple[str, ...] = L1_POLICIES,
        progress: Any = None) -> dict[str, Any]:
    """Every policy's count on every workload and L1 size (``jobs`` counted at once: the counts do not depend on
    it), and each over ``lru``'s on the same (``policies`` include it)."""
    require_valgrind()
    if problem := warmup_problem(warmup):
        raise RuntimeError(problem)
    sides = [(policy, objects, workload) for workload in WORKLOADS for objects in L1_OBJECTS for policy in policies]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpcache-l1-counted-") as directory, ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(count, *side, requests, warmup, directory) for side in sides]
        try:
            for future in futures:
                rows.append(future.result())
                if progress is not None:
                    row = rows[-1]
                    progress(f"{row['workload']}, {row['objects']} objects, {row['policy']}: "
                             f"{row['instructions_per_request']:,} instructions a request ({len(rows)}/{len(sides)})")
        except BaseException:  # a side failed, or an interrupt: count no side not yet started, end those running
            pool.shutdown(wait=False, cancel_futures=True)
            counted_side.end_running()
            pool.shutdown(wait=True)
            raise
    over_lru = {}
    for workload in WORKLOADS:
        for objects in L1_OBJECTS:
            same = {row["policy"]: row["instructions_per_request"] for row in rows
                    if (row["workload"], row["objects"]) == (workload, objects)}
            over_lru[f"{workload}_{objects}_objects"] = {policy: round(n / same["lru"], 4)
                                                         for policy, n in same.items() if policy != "lru"}
    return {"requests": requests, "warmup": warmup, "new_chunks": NEW_CHUNKS, "rows": rows, "over_lru": over_lru}


def warmup_problem(warmup: int) -> str | None:
    """Why ``warmup`` requests cannot fill the largest L1 counted, or None."""
    if warmup * NEW_CHUNKS < max(L1_OBJECTS):
        return (f"{warmup} warm-up requests store at most {warmup * NEW_CHUNKS:,} new chunks, too few to fill an L1 "
                f"of {max(L1_OBJECTS):,} objects: give more (--warmup)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.l1_counted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests counted (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="requests before them (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="sides counted at once (default %(default)s)")
    parser.add_argument("--policies", default=",".join(L1_POLICIES), help="comma-separated (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", nargs=3, metavar=("POLICY", "OBJECTS", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    policies = tuple(args.policies.split(","))
    if args.requests < 1 or args.warmup < 0 or args.jobs < 1:
        parser.error("--requests and --jobs must be at least 1, --warmup at least 0")
    if not args.child and (problem := warmup_problem(args.warmup)):
        parser.error(problem)
    if unknown := [p for p in policies if p not in L1_POLICIES]:
        parser.error(f"unknown policy {', '.join(unknown)}: expected some of {', '.join(L1_POLICIES)}")
    if "lru" not in policies or len(set(policies)) < len(policies):
        parser.error(f"--policies {args.policies}: each order once, lru among them (the ratios' baseline)")
    if args.child:
        policy, objects, workload = args.child
        return child(policy, int(objects), workload, args.requests, args.warmup)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the counted sides go too
    try:
        result = run(args.requests, args.warmup, args.jobs, policies,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (RuntimeError, subprocess.TimeoutExpired) as error:  # valgrind missing, or a side failed (it said why)
        print(f"benchmarks.l1_counted: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.l1_counted: interrupted: its counted sides and their dumps are gone", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, ratios in result["over_lru"].items():
            print(f"{name}: " + ", ".join(f"{policy} {ratio}× lru" for policy, ratio in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
