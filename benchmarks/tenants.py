"""``python -m benchmarks.tenants [--requests N] [--size S] [--policies P ...] [--json] KIND:SEED:WEIGHT ...``:
tenants that share one L1, replayed in process: what each one finds under each policy.

Each ``KIND:SEED:WEIGHT`` is a tenant (cache salt ``tenant-<i>``) whose requests are a ``trace_gen`` kind, its block
ids moved apart from every other tenant's; the ``--requests`` requests are drawn from the tenants in proportion to
their weights (a fixed random order, the same in every run).  L1 is sized on the whole (``bench trace``'s
``--size``).  Per tenant it prints the hit ratio of the offline LRU and ARC (one cache for all) and of L1 under
each policy, and, for ``adaptive``, of the same requests sent as one tenant (``l1_adaptive_one_tenant``: the order
with no reserves to keep, since one group has L1 to itself): what the reserves give each tenant and what they cost
the whole.
"""

from __future__ import annotations

import math
import random
import sys
from typing import Any

from benchmarks import trace_gen
from benchmarks.policy_matrix import l1_found
from benchmarks.regimes import SEGMENT_SHIFT, command
from benchmarks.trace import SHARES
from benchmarks.trace_sim import TraceRequest, arc, lru, lru_capacity_for

ORDER_SEED = 0  # the seed of the order the tenants' requests are drawn in


def tenants(specs: list[str], requests: int) -> tuple[list[TraceRequest], list[int]]:
    """The requests of every ``KIND:SEED:WEIGHT`` tenant in ``specs``, interleaved by weight, and each request's
    tenant (its index in ``specs``)."""
    parsed = []
    for spec in specs:
        parts = spec.split(":")
        if (len(parts) != 3 or parts[0] not in trace_gen.KINDS or not all(part.isdecimal() for part in parts[1:])
                or int(parts[2]) < 1):
            raise ValueError(f"{spec!r}: expected KIND:SEED:WEIGHT (WEIGHT at least 1), KIND one of "
                             f"{', '.join(trace_gen.KINDS)}")
        parsed.append((parts[0], int(parts[1]), int(parts[2])))
    if len(parsed) < 2:
        raise ValueError("expected two tenants or more")
    rng = random.Random(ORDER_SEED)
    owners = rng.choices(range(len(parsed)), weights=[weight for _, _, weight in parsed], k=requests)
    streams = []
    for index, (kind, number, _) in enumerate(parsed):
        shift = (index + 1) << SEGMENT_SHIFT
        streams.append(iter([TraceRequest([block + shift for block in request.hashes], request.input_tokens)
                             for request in trace_gen.KINDS[kind](owners.count(index), number)]))
    return [next(streams[owner]) for owner in owners], owners


def run(specs: list[str], requests: int, size: str, policies: list[str]) -> dict[str, Any]:
    trace, owners = tenants(specs, requests)
    blocks = lru_capacity_for(trace, SHARES[size], lru(trace, math.inf).hit_ratio)
    found = {"lru": lru(trace, blocks).found, "arc": arc(trace, blocks).found}
    groups = [("m", f"tenant-{owner}") for owner in owners]
    for policy in policies:
        found[f"l1_{policy}"] = l1_found(trace, blocks, policy, groups=groups)
        if policy == "adaptive":
            found["l1_adaptive_one_tenant"] = l1_found(trace, blocks, policy)
    rows = []
    for name, members in [*((spec, {index}) for index, spec in enumerate(specs)), ("whole", set(range(len(specs))))]:
        chosen = [index for index, owner in enumerate(owners) if owner in members]
        asked = sum(len(trace[index].hashes) for index in chosen)
        row: dict[str, Any] = {"tenant": name, "requests": len(chosen)}
        row.update({column: sum(values[index] for index in chosen) / asked for column, values in found.items()})
        rows.append(row)
    return {"size": size, "blocks": blocks, "rows": rows}


def render(result: dict[str, Any]) -> str:
    columns = [column for column in result["rows"][0] if column not in ("tenant", "requests")]
    lines = [f"{result['size']} L1: {result['blocks']} blocks",
             "| tenant | requests | " + " | ".join(columns) + " |", "|" + "---|" * (2 + len(columns))]
    lines += [f"| {row['tenant']} | {row['requests']} | " + " | ".join(f"{row[c]:.4f}" for c in columns) + " |"
              for row in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return command(argv, "python -m benchmarks.tenants", __doc__, "KIND:SEED:WEIGHT",
                   (6000, "requests of all tenants together"), "small", run, render)


if __name__ == "__main__":
    sys.exit(main())
