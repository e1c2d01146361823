"""``python -m benchmarks.chance_trial [TRACE ...] [--kinds [KIND ...]] [--seeds FIRST LAST] [--requests N]
[--json]``: what ``adaptive``'s admission trial (:mod:`mpcache.eviction.admission`) saw, and what admitting by
chance from the start would have found.

Each Mooncake-format trace file, and each ``trace_gen`` kind at each seed, is replayed in process as
``policy_matrix`` replays it, at the three sizes of ``bench trace``; where L1 is large enough for a trial
(:func:`~mpcache.eviction.admission.trial_halvings`), three times: as shipped; with the trial sampling every key (a
reference for what any sampled trial could see: it halves its rate only past
:data:`~mpcache.eviction.shadow.SHADOW_KEYS` keys); and admitting by chance from the first request on, the trial free
to switch back.  For the first two it gives the requests after which the trial switched, the request by which its
evidence began to count (L1 had missed its capacity's worth of bytes), and how far each of its two sums stood at the
end above its lowest, in standard deviations of its steps since (L1 switches once both pass
:data:`~mpcache.eviction.admission.CHANCE_SIGMAS`).  Where admitting by chance from the start finds more and the
trial never switched, its evidence was too thin to act on; where it finds less, or is flagged as ``policy_matrix``
flags a row, switching without that evidence would have cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

from benchmarks import trace_gen
from benchmarks.phase_ablation import patched
from benchmarks.policy_matrix import OBJECT_BYTES, TOLERANCE, flags, lmcache_best, sizes
from benchmarks.policy_matrix import l1_found as replay
from benchmarks.trace_sim import TraceRequest, TraceUnreadable, arc, load, lru, outcome, trace_name
from mpcache.cache.l1 import L1Manager
from mpcache.eviction import admission
from mpcache.eviction.order import ArcOrder

REQUESTS = 4000  # each generated trace's requests, and a trace file's read at the most
SEEDS = (1, 2)
SAMPLINGS = {"shipped": [],  # name → the patches that make it
             "every_key": [(admission, "TRIAL_HALVINGS", 0), (admission, "TRIAL_MIN_HALVINGS", 0)]}


def watched(requests: list[TraceRequest], blocks: int, patches: list[tuple[Any, str, Any]]) -> dict[str, Any]:
    """``requests`` through an L1 of ``blocks`` under ``adaptive`` with ``patches``: its hit ratio, and its trial's
    switches, the request by which its evidence counted, its chance at the end and each sum's standing then."""
    switches: list[int] = []
    evidence_from: list[int] = []
    trials: list[admission.AdmissionTrial] = []

    def after(index: int, l1: L1Manager) -> None:
        trial = cast(ArcOrder, l1.order)._trial
        if trial is None:
            return
        if not trials:
            trials.append(trial)
        if trial.switches > len(switches):
            switches.append(index)
        if not evidence_from and trial._settling <= 0:
            evidence_from.append(index)

    with patched(patches):
        hit_ratio = outcome(requests, replay(requests, blocks, "adaptive", after=after)).hit_ratio
    if not trials:
        raise RuntimeError(f"an L1 of {blocks} objects ran no admission trial, though trial_halvings said it would")
    trial = trials[0]
    rule = 0 if trial.followed == 1 else 1  # of admitting every store and by chance, the one L1 does not follow
    standing = [{"above_lowest": total - low, "sigmas": round((total - low) / squares ** 0.5, 2) if squares else 0.0}
                for total, low, squares in zip(trial._sums[rule], trial._lows[rule], trial._since[rule])]
    return {"hit_ratio": hit_ratio, "switches": switches, "evidence_from": evidence_from[0] if evidence_from else None,
            "chance": trial.chance, "lead": standing[0], "gain": standing[1]}


def by_chance_from_first(requests: list[TraceRequest], blocks: int) -> float:
    """The hit ratio of ``adaptive`` admitting by chance from the first request on (its trial free to switch back)."""

    def after(index: int, l1: L1Manager) -> None:
        if index == 0:
            order = cast(ArcOrder, l1.order)
            if order._trial is None:
                raise RuntimeError("no admission trial to start admitting by chance")
            order._trial.take(1)
            order.chance = admission.CHANCE

    return outcome(requests, replay(requests, blocks, "adaptive", after=after)).hit_ratio


def rows_of(name: str, requests: list[TraceRequest], seed: int | None = None) -> list[dict[str, Any]]:
    """One trace's rows, a size each (``seed``: a generated trace's)."""
    rows = []
    for size, blocks in sizes(requests):
        row: dict[str, Any] = {"trace": name, "seed": seed, "requests": len(requests), "size": size, "blocks": blocks,
                               "lru": lru(requests, blocks).hit_ratio, "arc": arc(requests, blocks).hit_ratio,
                               "lmcache_sim": lmcache_best(requests, blocks),
                               "runs_a_trial": admission.trial_halvings(blocks * OBJECT_BYTES,
                                                                        OBJECT_BYTES) is not None}
        if row["runs_a_trial"]:
            for sampling, patches in SAMPLINGS.items():
                row[sampling] = watched(requests, blocks, patches)
            found = row["by_chance_from_first"] = by_chance_from_first(requests, blocks)
            row["flags_by_chance_from_first"] = flags(row, found)
            row["flags_shipped"] = flags(row, row["shipped"]["hit_ratio"])
        rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Over the rows with a trial: where admitting by chance from the first request finds more or less than the order
    as shipped by over :data:`~benchmarks.policy_matrix.TOLERANCE`, and where each is flagged."""
    tried = [row for row in rows if row["runs_a_trial"]]
    return {"rows_with_a_trial": len(tried),
            "trial_switched": sum(1 for row in tried if row["shipped"]["switches"]),
            "from_first_above_shipped": sum(1 for row in tried
                                            if row["by_chance_from_first"] > row["shipped"]["hit_ratio"] + TOLERANCE),
            "from_first_below_shipped": sum(1 for row in tried
                                            if row["by_chance_from_first"] < row["shipped"]["hit_ratio"] - TOLERANCE),
            "shipped_flagged": sum(1 for row in tried if row["flags_shipped"]),
            "from_first_flagged": sum(1 for row in tried if row["flags_by_chance_from_first"])}


def render(rows: list[dict[str, Any]], counted: dict[str, int]) -> str:
    """The rows as a markdown table, and the summary under it."""
    lines = ["| trace | seed | size | blocks | lru | arc | lmcache_sim | shipped | switches | evidence from | "
             "lead / gain (σ) | every key: switches | lead / gain (σ) | by chance from the first |", "|---" * 14 + "|"]
    for row in rows:
        cells = [row["trace"], "–" if row["seed"] is None else str(row["seed"]), row["size"], f"{row['blocks']:,}",
                 *(f"{row[ref]:.4f}" for ref in ("lru", "arc", "lmcache_sim"))]
        if not row["runs_a_trial"]:
            lines.append("| " + " | ".join([*cells, "(no trial: L1 too small)", *[""] * 6]) + " |")
            continue
        shipped, every = row["shipped"], row["every_key"]
        cells += [f"{shipped['hit_ratio']:.4f}" + (f" ({', '.join(row['flags_shipped'])})"
                                                   if row["flags_shipped"] else ""),
                  ", ".join(map(str, shipped["switches"])) or "none", str(shipped["evidence_from"]),
                  f"{shipped['lead']['sigmas']} / {shipped['gain']['sigmas']}",
                  ", ".join(map(str, every["switches"])) or "none", f"{every['lead']['sigmas']} / "
                  f"{every['gain']['sigmas']}", f"{row['by_chance_from_first']:.4f}"
                  + (f" ({', '.join(row['flags_by_chance_from_first'])})" if row["flags_by_chance_from_first"] else "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(", ".join(f"{name.replace('_', ' ')}: {value}" for name, value in counted.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chance_trial", description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="*", help="a Mooncake-format trace file")
    parser.add_argument("--kinds", nargs="*", choices=sorted(trace_gen.KINDS), default=[],
                        help="trace_gen kinds replayed at each seed (none by default)")
    parser.add_argument("--seeds", nargs=2, type=trace_gen.seed_argument, default=list(SEEDS),
                        metavar=("FIRST", "LAST"), help=f"the generated traces' seeds (default {SEEDS[0]} {SEEDS[1]})")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="each generated trace's requests, and a "
                        f"file's read at the most (default {REQUESTS:,})")
    parser.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= trace_gen.MAX_COUNT:
        parser.error(f"--requests {args.requests}: expected 1 to {trace_gen.MAX_COUNT:,}")
    if args.seeds[1] < args.seeds[0]:
        parser.error(f"--seeds {args.seeds[0]} {args.seeds[1]}: the last seed is below the first")
    if not args.trace and not args.kinds:
        parser.error("nothing to replay: no trace file and no --kinds")
    files = {}
    for path in args.trace:
        try:
            files[trace_name(path)] = load(path, args.requests)
        except TraceUnreadable as exc:
            parser.error(f"{path}: not a readable Mooncake-format trace: {exc}")
    rows: list[dict[str, Any]] = []
    try:
        for name, requests in files.items():
            print(f"[chance_trial] {name} ({len(requests):,} requests)", file=sys.stderr, flush=True)
            rows += rows_of(name, requests)
        for kind in args.kinds:
            for seed in range(args.seeds[0], args.seeds[1] + 1):
                print(f"[chance_trial] {kind} seed {seed} ({args.requests:,} requests)", file=sys.stderr, flush=True)
                rows += rows_of(kind, trace_gen.KINDS[kind](args.requests, seed), seed)
    except KeyboardInterrupt:
        print("[chance_trial] interrupted", file=sys.stderr)
        return 130
    counted = summary(rows)
    print(json.dumps({"summary": counted, "rows": rows}, indent=1) if args.json else render(rows, counted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
