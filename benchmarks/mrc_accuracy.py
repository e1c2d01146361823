"""``python -m benchmarks.mrc_accuracy [--trace PATH] [--max-keys N ...] [--rates R ...] [--seeds S ...] [--at
trace-sizes]``: the online curves' error against an exact simulation of the order they model, on both kinds of
trace: the KV-shaped and long-prompt workloads of ``mrc_traces`` and production-like traces (Mooncake-format files
given by ``--trace PATH``, and ``trace_gen``'s kinds, drawn at each of ``--seeds``: 1 by default).

Each trace is fed straight to a :class:`~mpcache.telemetry.mrc.curves.CurveSet` as the cache process would sample it
(a lookup's first ``--mrc-exact-chunks`` keys, the hash-sampled rest, the store's hash-sampled keys), at one
process's L1 of the median finite reuse distance, or, ``--at trace-sizes``, at each of ``bench trace``'s three sizes
(where an offline LRU reaches ⅓, ⅔ and 90 % of the infinite cache's hit ratio; named TRACE/SIZE).  The truth: for
``lru`` an exact stack-distance computation (``mrc_traces.exact_curve``), for ``adaptive`` the same order run by a
full-size cache over every key at each capacity.  Reported per trace, policy and key budget: mean and largest
absolute error over the capacities ½×, 1×, 2× (and ¼×, 4×), the rates the history ended at, and the curve set's
bytes.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from benchmarks import trace_gen, trace_sim
from benchmarks.mrc_traces import CHUNK_BYTES, Request, exact_curve, exact_distances, kv_requests, long_requests
from benchmarks.policy_matrix import sizes as trace_sizes
from mpcache.config import Config
from mpcache.config.derived import L1_POLICIES
from mpcache.config.model import SETTINGS
from mpcache.contract import tail_marks
from mpcache.contract.keys import SAMPLE_MODULUS

RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
GENERATED = ("conversations", "multitenant", "rag", "agentic")
AT = ("reuse", "trace-sizes")  # --at: the L1 a trace is measured at
MAX_KEYS_KIND = next(item.kind for item in SETTINGS if item.name == "mrc-max-keys")  # the budgets it may take


def _mix(block: int) -> int:
    """A trace's block id as a chunk hash (splitmix64, 63 bits): the ids are consecutive integers, which the
    hash-sampling rule would otherwise take a contiguous slice of."""
    z = (block + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _as_requests(trace: list[trace_sim.TraceRequest]) -> list[Request]:
    return [("trace-model", "", [_mix(h) for h in request.hashes]) for request in trace]


def _file_requests(path: str, count: int) -> list[Request]:
    return _as_requests(trace_sim.load(path, count))


def _generated_requests(kind: str, count: int, seed: int) -> list[Request]:
    return _as_requests(trace_gen.KINDS[kind](count, seed))


def generated_name(kind: str, seed: int) -> str:
    """A ``trace_gen`` kind's name here: the kind at seed 1, with its seed at any other."""
    return kind if seed == 1 else f"{kind}@{seed}"


def traces(count: int, paths: tuple[str, ...] = (), seeds: tuple[int, ...] = (1,),
           only: tuple[str, ...] = ()) -> dict[str, list[Request]]:
    """The traces measured (those named in ``only``, if any): KV-shaped and long prompts (chunks of 16 tokens),
    each trace file of ``paths`` (its first ``count`` requests) and ``trace_gen``'s kinds (``count`` requests each,
    at each of ``seeds``)."""
    makers: dict[str, Callable[[], list[Request]]] = {"kv": partial(kv_requests, count),
                                                      "long": partial(long_requests, count // 2)}
    for path in paths:
        makers[trace_sim.trace_name(path)] = partial(_file_requests, path, count)
    for kind in GENERATED:
        for seed in seeds:
            makers[generated_name(kind, seed)] = partial(_generated_requests, kind, count, seed)
    return {name: make() for name, make in makers.items() if not only or name in only}


def exact_policy_curve(requests: list[Request], policy: str, capacities: list[int]) -> list[float]:
    """The share of lookup accesses a cache of each capacity running ``policy`` holds, every key simulated:
    for LRU the stack distances, otherwise the order run at full size (what a miniature at rate 1 is)."""
    if policy == "lru":
        return exact_curve(exact_distances(requests), capacities)
    from mpcache.telemetry.mrc.mini import MiniCache

    out = []
    for capacity in capacities:
        cache, hits, total = MiniCache(policy, capacity), 0, 0
        for model, salt, hashes in requests:
            found = cache.lookup([((h, salt, model), CHUNK_BYTES) for h in hashes])
            hits, total = hits + sum(found), total + len(found)
        out.append(hits / total)
    return out


def feed(curves: Any, requests: list[Request], rate: float, exact_chunks: int) -> None:
    """Each request's lookup and store events as the cache process ships them, into ``curves`` (a
    :class:`~mpcache.telemetry.mrc.curves.CurveSet`): the first ``exact_chunks`` keys, the hash-sampled rest and
    the tail's marks."""
    from mpcache.telemetry.mrc.curves import HEAD, MISS, SAMPLED

    threshold = rate * SAMPLE_MODULUS
    for model, salt, hashes in requests:
        rows = [(h, salt, model) for h in hashes]
        sampled = [row for row in rows[exact_chunks:] if row[0] % SAMPLE_MODULUS < threshold]
        curves.lookup(model, salt, 1, [(row, HEAD, MISS, 1) for row in rows[:exact_chunks]]
                      + [(row, SAMPLED, MISS, 1) for row in sampled], tail=max(0, len(rows) - exact_chunks),
                      marks=tail_marks.pack(hashes, exact_chunks, 1))
        curves.store(model, CHUNK_BYTES, [row for row in rows if row[0] % SAMPLE_MODULUS < threshold])


def online_curve(requests: list[Request], policy: str, rate: float, max_keys: int, exact_chunks: int,
                 capacity: int, measure_memory: bool = False) -> dict[str, Any]:
    """The curve a telemetry process builds from ``requests`` as the cache process samples them."""
    from mpcache.telemetry.mrc.curves import POINT_RATIOS, CurveSet

    if measure_memory:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if measure_memory else 0
    curves = CurveSet(rate, max_keys, {"l1": capacity}, policy=policy)
    feed(curves, requests, rate, exact_chunks)
    held = tracemalloc.get_traced_memory()[0] - before if measure_memory else None
    if measure_memory:
        tracemalloc.stop()
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == ("*", "*")]
    points = {round(ratio, 6): point["hit_ratio"] for ratio, point in zip(POINT_RATIOS, curve["points"])}
    return {"points": [points[ratio] for ratio in RATIOS], "rate": curves.rate, "head_rate": curves.head_rate,
            "bytes": held}


def measure(requests: list[Request], policy: str, rate: float, max_keys: int, exact_chunks: int,
            truth: list[float], capacity: int, measure_memory: bool = False) -> dict[str, Any]:
    online = online_curve(requests, policy, rate, max_keys, exact_chunks, capacity, measure_memory)
    errors = np.abs(np.subtract(online["points"], truth))
    middle = errors[[RATIOS.index(r) for r in (0.5, 1.0, 2.0)]]
    out = {"mae": round(float(np.mean(errors)), 4), "max": round(float(np.max(errors)), 4),
           "max_half_to_double": round(float(np.max(middle)), 4),
           "rate_end": round(online["rate"], 5), "head_rate_end": round(online["head_rate"], 4)}
    if online["bytes"] is not None:
        out["curve_set_bytes"] = online["bytes"]
    return out


def run(repetitions: int = 1, progress: Callable[[str], None] = lambda _: None, requests: int = 6000,
        max_keys: tuple[int, ...] = (), rates: tuple[float, ...] = (),
        policies: tuple[str, ...] = ("lru", "adaptive"), only: tuple[str, ...] = (),
        paths: tuple[str, ...] = (), seeds: tuple[int, ...] = (1,), at: str = "reuse") -> dict[str, Any]:
    """Per trace and policy: the truth at ¼×…4× and the online curve's error at each (key budget, rate); the
    defaults unless told."""
    del repetitions  # deterministic: one pass
    defaults = Config(instance_id="bench", supervisor_pid=0, runtime_dir="/nonexistent")
    budgets = max_keys or (defaults.mrc_max_keys,)
    sample_rates = rates or (defaults.mrc_sample_rate,)
    result: dict[str, Any] = {"benchmark": "mrc_accuracy", "requests": requests, "ratios": list(RATIOS),
                              "default_max_keys": defaults.mrc_max_keys,
                              "default_sample_rate": defaults.mrc_sample_rate, "seeds": list(seeds), "traces": {}}
    result["at"] = at
    for name, trace in traces(requests, paths, seeds, only).items():
        for label, capacity in l1_sizes(trace, name, at):
            capacities = [round(capacity * ratio) for ratio in RATIOS]
            entry: dict[str, Any] = {"requests": len(trace), "accesses": sum(len(h) for _, _, h in trace),
                                     "distinct_keys": len({h for _, _, hashes in trace for h in hashes}),
                                     "l1_chunks": capacity // CHUNK_BYTES}
            for policy in policies:
                truth = exact_policy_curve(trace, policy, capacities)
                entry[policy] = {"truth": [round(v, 4) for v in truth]}
                for budget in budgets:
                    for rate in sample_rates:
                        entry[policy][f"{budget} keys, rate {rate:g}"] = measured = measure(
                            trace, policy, rate, budget, defaults.mrc_exact_chunks, truth, capacity,
                            measure_memory=budget == budgets[-1] and rate == sample_rates[-1])
                        progress(f"mrc_accuracy: {label} {policy} {budget} keys rate {rate:g}: {measured}")
            result["traces"][label] = entry
    return result


def l1_sizes(trace: list[Request], name: str, at: str) -> list[tuple[str, int]]:
    """The L1 capacities ``trace`` is measured at, in bytes, and the name each result goes by: ``reuse``, one at
    the median finite reuse distance (named ``name``); ``trace-sizes``, ``bench trace``'s three (``name/SIZE``)."""
    if at == "trace-sizes":
        requests = [trace_sim.TraceRequest(list(hashes), len(hashes) * trace_sim.BLOCK_TOKENS)
                    for _, _, hashes in trace]
        return [(f"{name}/{size}", blocks * CHUNK_BYTES) for size, blocks in trace_sizes(requests)]
    finite = sorted(d for d in exact_distances(trace) if d != float("inf"))
    return [(name, int(finite[len(finite) // 2]) // CHUNK_BYTES * CHUNK_BYTES)]


def main() -> None:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000, help=f"at most {trace_gen.MAX_COUNT:,}")
    parser.add_argument("--max-keys", type=int, nargs="*", default=[], help="key budgets, as --mrc-max-keys takes")
    parser.add_argument("--rates", type=float, nargs="*", default=[], help="sample rates in (0, 1]")
    parser.add_argument("--policies", nargs="*", choices=L1_POLICIES, default=["lru", "adaptive"])
    parser.add_argument("--only", nargs="*", default=[], help="the traces measured, by name (default: every one)")
    parser.add_argument("--trace", action="append", default=[], help="a Mooncake-format trace file (repeatable)")
    parser.add_argument("--seeds", type=trace_gen.seed_argument, nargs="+", default=[1],
                        help="the seeds trace_gen's kinds are drawn at (default 1; another is named KIND@SEED)")
    parser.add_argument("--at", choices=AT, default=AT[0],
                        help="the L1 measured at: the median finite reuse distance (default), or bench trace's three "
                             "sizes")
    args = parser.parse_args()
    if not 1 <= args.requests <= trace_gen.MAX_COUNT:
        parser.error(f"--requests {args.requests}: expected 1 to {trace_gen.MAX_COUNT:,}")
    if bad := [keys for keys in args.max_keys if MAX_KEYS_KIND.problem(keys)]:
        parser.error(f"--max-keys {bad[0]}: {MAX_KEYS_KIND.problem(bad[0])}, as --mrc-max-keys takes")
    if bad := [rate for rate in args.rates if not 0 < rate <= 1]:  # NaN too
        parser.error(f"--rates {bad[0]}: expected a rate in (0, 1]")
    if len(set(args.seeds)) < len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: a seed given twice")
    names = ["kv", "long", *(trace_sim.trace_name(path) for path in args.trace),
             *(generated_name(kind, seed) for kind in GENERATED for seed in args.seeds)]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        parser.error(f"two traces named {', '.join(twice)}: rename the --trace file")
    if unknown := [name for name in args.only if name not in names]:
        parser.error(f"--only {unknown[0]}: no such trace; expected some of {', '.join(names)}")
    for path in args.trace:
        try:
            trace_sim.load(path, args.requests)
        except trace_sim.TraceUnreadable as exc:
            parser.error(f"--trace: not a readable Mooncake-format trace: {exc}")
    out = run(progress=lambda line: print(line, file=sys.stderr, flush=True), requests=args.requests,
              max_keys=tuple(args.max_keys), rates=tuple(args.rates), policies=tuple(args.policies),
              only=tuple(args.only), paths=tuple(args.trace), seeds=tuple(args.seeds), at=args.at)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
