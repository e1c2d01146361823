"""``python -m benchmarks.seed_spread [--seeds FIRST LAST] [--kinds KIND ...] [--requests N] [--first N] [--jobs J]
[--json]``: how often issue 39's per-row bar flags the references themselves, seed by seed.

``policy_matrix`` flags a row where ``adaptive`` is more than :data:`~benchmarks.policy_matrix.TOLERANCE` below the
offline LRU or ARC, or below ``lmcache_sim``.  Whether a flag says something about the order or about the draw
depends on how far LRU and ARC move apart from one seed to the next.  This replays each ``trace_gen`` kind at many
seeds, whole and its first ``--first`` requests, at the three sizes of ``bench trace``, and counts per kind, length
and size the seeds where each of ``lru``, ``arc`` and ``adaptive`` is flagged by that same bar (more than the
tolerance below the better of LRU and ARC; below ``lmcache_sim``), beside the mean and standard deviation of ARC's
hit ratio minus LRU's.  ``fixed`` is the fewer of LRU's and ARC's seeds flagged below the better of the two: what
the better of them for that kind, length and size, chosen after the fact (a flag set right for each), is flagged
in.  ``adaptive`` is set by nothing.  ``--json`` also prints each length's totals.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.policy_matrix import TOLERANCE, flags, l1_found
from benchmarks.seed_pool import Job, referenced, seeded_replay
from benchmarks.trace_sim import outcome

REQUESTS, FIRST = 4000, 1500  # the policy matrix's lengths in PERFORMANCE.json's ``policy_matrix_adaptive``
SEEDS = (1, 64)  # the matrix's 16 seeds, the 8 held out after them, and more
POLICIES = ("lru", "arc", "adaptive")  # judged by the bar, in this order


def _rows(job: Job) -> list[dict[str, Any]]:
    """One kind and seed: the references and ``adaptive``'s hit ratio, per length and size."""
    return [{**row, "adaptive": outcome(trace, l1_found(trace, row["blocks"], "adaptive")).hit_ratio}
            for trace, row in referenced(job)]


def cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind, length and size, in the rows' order: its seeds, ARC − LRU's mean and standard deviation over them,
    and per policy of :data:`POLICIES` the seeds where the bar flags it (``below_best``: more than the tolerance
    below the better of LRU and ARC; ``below_sim``: below ``lmcache_sim``) and its mean hit ratio minus the better
    of LRU and ARC; ``fixed``: the fewer of LRU's and ARC's ``below_best``, the better of the two's after the fact."""
    grouped: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["trace"], row["requests"], row["size"]), []).append(row)
    out = []
    for (kind, requests, size), group in grouped.items():
        gaps = [row["arc"] - row["lru"] for row in group]
        cell: dict[str, Any] = {"trace": kind, "requests": requests, "size": size, "seeds": len(group),
                                "arc_minus_lru_mean": statistics.fmean(gaps),
                                "arc_minus_lru_sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0}
        for policy in POLICIES:
            flagged = [flags(row, row[policy]) for row in group]
            cell[f"{policy}_below_best"] = sum(1 for found in flagged if "lru" in found or "arc" in found)
            cell[f"{policy}_below_sim"] = sum(1 for found in flagged if "lmcache_sim" in found)
            cell[f"{policy}_minus_best_mean"] = statistics.fmean(row[policy] - max(row["lru"], row["arc"])
                                                                 for row in group)
        cell["fixed"] = min(cell["lru_below_best"], cell["arc_below_best"])
        out.append(cell)
    return out


def totals(counted: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    """Over the cells of ``requests`` requests: each policy's flagged seeds summed, ``fixed``'s, and the cells
    where ``adaptive`` is flagged below the better of LRU and ARC in more seeds than ``fixed``."""
    at = [cell for cell in counted if cell["requests"] == requests]
    out: dict[str, Any] = {"rows": sum(cell["seeds"] for cell in at)}
    for policy in POLICIES:
        out[f"{policy}_below_best"] = sum(cell[f"{policy}_below_best"] for cell in at)
        out[f"{policy}_below_sim"] = sum(cell[f"{policy}_below_sim"] for cell in at)
    out["fixed"] = sum(cell["fixed"] for cell in at)
    out["adaptive_behind_fixed"] = [f"{cell['trace']} {cell['size']}" for cell in at
                                    if cell["adaptive_below_best"] > cell["fixed"]]
    return out


def render(counted: list[dict[str, Any]], seeds: int) -> str:
    """The cells as a markdown table."""
    lines = [f"| trace | requests | size | ARC − LRU: mean (sd) over {seeds} seeds | seeds flagged below the better "
             f"of LRU and ARC by > {TOLERANCE}: lru / arc / adaptive (fixed) | below `lmcache_sim`: lru / arc / "
             "adaptive | adaptive − the better, mean |", "|---|---|---|---|---|---|---|"]
    for c in counted:
        lines.append(f"| {c['trace']} | {c['requests']} | {c['size']} | {c['arc_minus_lru_mean']:+.4f} "
                     f"({c['arc_minus_lru_sd']:.4f}) | {c['lru_below_best']} / {c['arc_below_best']} / "
                     f"{c['adaptive_below_best']} ({c['fixed']}) | {c['lru_below_sim']} / {c['arc_below_sim']} / "
                     f"{c['adaptive_below_sim']} | {c['adaptive_minus_best_mean']:+.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, progress: Callable[[str], None] | None = None) -> int:
    args, rows = seeded_replay("seed_spread", __doc__, (SEEDS, REQUESTS, FIRST), "the cells, the totals and every row",
                               _rows, argv, progress)
    if rows is None:
        return 130
    counted = cells(rows)
    summed = {str(length): totals(counted, length) for length in (args.requests, args.first)}
    print(json.dumps({"totals": summed, "cells": counted, "rows": rows}, indent=1) if args.json
          else render(counted, args.seeds[1] - args.seeds[0] + 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
