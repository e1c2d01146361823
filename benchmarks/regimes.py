"""``python -m benchmarks.regimes [--requests N] [--size S] [--policies P ...] [--json] KIND:SEED ...``: workloads
that follow one another on one L1, as a long-lived service sees them, replayed in process.

Each ``KIND:SEED`` is ``--requests`` requests of a ``trace_gen`` kind, its block ids moved apart from every other
segment's (no block is shared across segments), the segments one after another.  L1 is sized on the whole
(``bench trace``'s ``--size``).  Per segment it prints the offline LRU's and ARC's hit ratio over the whole
replay (their state carried from the segments before, as L1's is) beside L1's under each policy, and the
request at which an order with phases (``adaptive``) split into ARC's lists or joined them again: how soon an
order that adapts follows a change of workload, and whether it still changes at all after many.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from benchmarks import trace_gen
from benchmarks.policy_matrix import l1_found
from benchmarks.trace import SHARES
from benchmarks.trace_sim import TraceRequest, arc, lru, lru_capacity_for
from mpcache.cache.l1 import L1Manager
from mpcache.eviction.order import ArcOrder

SEGMENT_SHIFT = 40  # segment i's block ids are moved by (i + 1) << SEGMENT_SHIFT: trace_gen's ids stay below


def segments(specs: list[str], requests: int) -> tuple[list[TraceRequest], list[tuple[str, int, int]]]:
    """The requests of every ``KIND:SEED`` in ``specs`` one after another, and each segment's (spec, first
    request, end)."""
    out: list[TraceRequest] = []
    spans = []
    for index, spec in enumerate(specs):
        kind, _, seed = spec.partition(":")
        if kind not in trace_gen.KINDS or not seed.isdigit():
            raise ValueError(f"{spec!r}: expected KIND:SEED, KIND one of {', '.join(trace_gen.KINDS)}")
        shift = (index + 1) << SEGMENT_SHIFT
        start = len(out)
        out += [TraceRequest([block + shift for block in request.hashes], request.input_tokens)
                for request in trace_gen.KINDS[kind](requests, int(seed))]
        spans.append((spec, start, len(out)))
    return out, spans


def phases(requests: list[TraceRequest], blocks: int, policy: str) -> tuple[list[int], list[tuple[int, str]]]:
    """L1's found prefix per request under ``policy``, and the requests after which its order split or joined."""
    changes: list[tuple[int, str]] = []
    state = [True, 0]  # the order's recency phase and joins after the request before

    def follow(index: int, l1: L1Manager) -> None:
        order = l1.order
        if not isinstance(order, ArcOrder) or not order.prefix_aware:
            return  # ``lru`` and ``arc`` keep one order throughout: ``arc`` is in ARC's lists from the start
        now = [order.recency, order.phases.joins]
        if now != state:
            changes.append((index, "join" if now[0] else "split"))
            state[:] = now

    return l1_found(requests, blocks, policy, after=follow), changes


def run(specs: list[str], requests: int, size: str, policies: list[str]) -> dict[str, Any]:
    trace, spans = segments(specs, requests)
    blocks = lru_capacity_for(trace, SHARES[size], lru(trace, math.inf).hit_ratio)
    found = {"lru": lru(trace, blocks).found, "arc": arc(trace, blocks).found}
    changes = {}
    for policy in policies:
        found[f"l1_{policy}"], changes[policy] = phases(trace, blocks, policy)
    rows = []
    for spec, start, end in [*spans, ("whole", 0, len(trace))]:
        asked = sum(len(request.hashes) for request in trace[start:end])
        row: dict[str, Any] = {"segment": spec, "first": start, "end": end}
        row.update({column: sum(values[start:end]) / asked for column, values in found.items()})
        rows.append(row)
    return {"size": size, "blocks": blocks, "rows": rows, "phase_changes": changes}


def render(result: dict[str, Any]) -> str:
    columns = [column for column in result["rows"][0] if column not in ("segment", "first", "end")]
    lines = [f"{result['size']} L1: {result['blocks']} blocks",
             "| segment | requests | " + " | ".join(columns) + " |", "|" + "---|" * (2 + len(columns))]
    lines += [f"| {row['segment']} | {row['first']}–{row['end']} | " + " | ".join(f"{row[c]:.4f}" for c in columns)
              + " |" for row in result["rows"]]
    changes = result["phase_changes"].get("adaptive")
    if changes is not None:
        lines.append("adaptive: " + (", ".join(f"{what} after request {index}" for index, what in changes)
                                     or "no phase change"))
    return "\n".join(lines)


def command(argv: list[str] | None, prog: str, doc: str, metavar: str, requests: tuple[int, str], size: str,
            run_specs: Callable[[list[str], int, str, list[str]], dict[str, Any]],
            render_result: Callable[[dict[str, Any]], str]) -> int:
    """The command line of an in-process replay of ``trace_gen`` specs (this one's, ``benchmarks.tenants``'): the
    specs, ``--requests`` (default and help: ``requests``), ``--size`` (default ``size``), ``--policies`` and
    ``--json``; a bad argument is one line and exit status 2."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("specs", nargs="+", metavar=metavar)
    parser.add_argument("--requests", type=int, default=requests[0], help=requests[1])
    parser.add_argument("--size", choices=sorted(SHARES), default=size)
    parser.add_argument("--policies", nargs="+", default=["adaptive", "arc", "lru"])
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not a table")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests {args.requests}: expected at least 1")
    try:
        result = run_specs(args.specs, args.requests, args.size, args.policies)
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(result, indent=1) if args.json else render_result(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    return command(argv, "python -m benchmarks.regimes", __doc__, "KIND:SEED", (4000, "requests per segment"),
                   "large", run, render)


if __name__ == "__main__":
    sys.exit(main())
