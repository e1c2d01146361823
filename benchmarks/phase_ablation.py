"""``python -m benchmarks.phase_ablation [--seeds FIRST LAST] [--kinds KIND ...] [--requests N] [--first N]
[--jobs J] [--json]``: where ``adaptive``'s flagged policy-matrix rows come from.

The order is replayed in process as ``policy_matrix`` replays it (``trace_gen``'s kinds, whole and their first
``--first`` requests, the three sizes of ``bench trace``), as shipped and with one of its rules switched off or one
of its phases held from the start (:data:`VARIANTS`), and each variant is counted as ``policy_matrix`` flags a row:
more than :data:`~benchmarks.policy_matrix.TOLERANCE` below the offline LRU or ARC, or below ``lmcache_sim``.
``oracle`` is, per row, the better of the two held phases, chosen after the fact: a reference for what choosing the
phase online (when to split ARC's lists, when to join them) costs, not an order that could run.  The duels
(:data:`DUELS`) choose it online from two held phases' own finds, request by request (the recency phase's, and
ARC's from the first request on, as a duel's split starts it; ``arc_from_first``): what miniature simulations of
the two would tell, without their sampling error, a reference for any phase test built on such miniatures.  A rule
whose removal changes no flag is not what flags a row.  The variants patch the order's modules inside the worker
that replays them, and put them back after.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import mpcache.cache.l1 as l1_module
from benchmarks.policy_matrix import TOLERANCE, l1_found
from benchmarks.policy_matrix import flags as matrix_flags
from benchmarks.seed_pool import Job, referenced, seeded_replay
from benchmarks.trace_sim import TraceRequest, outcome
from mpcache.eviction import admission, order, phases
from mpcache.eviction.gate import FrequencyGate

REQUESTS, FIRST = 4000, 1500  # the policy matrix's lengths in PERFORMANCE.json's ``policy_matrix_adaptive``
SEEDS = (1, 16)  # its seeds, first and last
ORACLE = ("never_split", "split_at_once")  # the two phases held from the start: the oracle takes the better per row
# name → (what it is, whether it starts in ARC's phase: else in the recency phase, as the order does)
DUELS = {"duel_from_recency": ("the phase chosen online by a duel of the two held phases, from the recency phase",
                               False),
         "duel_from_arc": ("the phase chosen online by a duel of the two held phases, from ARC's phase", True)}
DUEL_SIGMAS = 3.0  # how far the other phase's lead must grow (in standard deviations) for a duel to change phase
# the phase as the replay leaves it: the order's own tests never split or join (a duel does)
HELD = [(phases, "SPLIT_SIGMAS", math.inf), (phases, "JOIN_SIGMAS", math.inf), (phases, "JOIN_FALL_SIGMAS", math.inf)]


def _never_refuses(self: FrequencyGate, fresh: Any, victims: Any) -> bool:
    return False


def _admits_always(self: order.ArcOrder) -> bool:
    return True


_BUILD = order.build  # the order's own, which the patch below wraps


def _build_without_first_sight(*args: Any, **kwargs: Any) -> Any:
    return _BUILD(*args, **{**kwargs, "first_sight": False})


# name → (what it switches off or holds, the (object, attribute, value) patches that do it)
VARIANTS: dict[str, tuple[str, list[tuple[Any, str, Any]]]] = {
    "shipped": ("the order as shipped", []),
    "gate_never_refuses": ("the frequency gate refuses nothing", [(FrequencyGate, "decide", _never_refuses)]),
    "no_chance_trial": ("no admission by chance", [(admission, "CHANCE", 1.0)]),
    "no_first_sight": ("no first-sight store refused (as with an L2 tier)",
                       [(order, "build", _build_without_first_sight)]),
    "no_second_sight_admission": ("every store may evict from T2 (no admission on second sight, no gate on T2, no "
                                  "later part of a refused store refused)",
                                  [(order.ArcOrder, "_admits", _admits_always)]),
    "never_split": ("the recency phase held (one LRU list throughout)", [(phases, "SPLIT_SIGMAS", math.inf)]),
    "split_at_once": ("ARC's phase from the first ghost hit on, never undone",
                      [(phases, "SPLIT_SIGMAS", -math.inf), (phases, "JOIN_SIGMAS", math.inf),
                       (phases, "JOIN_FALL_SIGMAS", math.inf)]),
    "never_join": ("ARC's phase never undone", [(phases, "JOIN_SIGMAS", math.inf),
                                                 (phases, "JOIN_FALL_SIGMAS", math.inf)]),
}


@contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """``patches`` applied, and put back however the block ends."""
    saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
    try:
        for target, name, value in patches:
            setattr(target, name, value)
        yield
    finally:
        for target, name, value in reversed(saved):
            setattr(target, name, value)


def duel_switches(recency_found: list[int], arc_found: list[int], arc_first: bool,
                  sigmas: float = DUEL_SIGMAS) -> list[int]:
    """The requests after which a duel of the two held phases changes L1's phase (the first: from the recency
    phase, which L1 starts in; ``arc_first``: a split after the first request), given each request's blocks found
    with the recency phase held and with ARC's phase held from the first request.  The phase not in use gains
    what it found beyond the one in use, request by request; the duel changes phase once that gain has grown from
    its lowest since the last change by more than ``sigmas`` (at least 1: one request alone never changes it)
    times the root of the squares' sum of the requests' gains since that lowest."""
    if sigmas < 1:
        raise ValueError(f"sigmas {sigmas}: expected at least 1")
    switches = [0] if arc_first else []
    in_arc = arc_first
    other_lead = squares = low = low_squares = 0.0
    for index, (by_recency, by_arc) in enumerate(zip(recency_found, arc_found)):
        gain = by_recency - by_arc if in_arc else by_arc - by_recency
        other_lead += gain
        squares += gain * gain
        if other_lead <= low:
            low, low_squares = other_lead, squares
        if other_lead - low > sigmas * (squares - low_squares) ** 0.5:
            switches.append(index)
            in_arc = not in_arc
            other_lead = squares = low = low_squares = 0.0
    return switches


def duel_found(requests: list[TraceRequest], blocks: int, switches: list[int]) -> list[int]:
    """``requests`` through an L1 of ``blocks`` under ``adaptive``, its phase changed after each request of
    ``switches`` and by nothing else: the prefix found per request."""
    at = set(switches)

    def after(index: int, l1: l1_module.L1Manager) -> None:
        if index in at:
            adaptive = cast(order.ArcOrder, l1.order)
            if adaptive.recency:
                adaptive.split()
            else:
                adaptive.join()

    with patched(HELD):
        return l1_found(requests, blocks, "adaptive", after=after)


def _rows(job: Job) -> list[dict[str, Any]]:
    """One kind and seed: its references and every variant's hit ratio, per length and size."""
    rows = []
    for trace, row in referenced(job):
        blocks = row["blocks"]
        for name, (_, patches) in VARIANTS.items():
            with patched(patches):
                found = l1_found(trace, blocks, "adaptive")
            row[name] = outcome(trace, found).hit_ratio
            if name == "never_split":
                recency_found = found  # the duels' recency phase
        row["oracle"] = max(row[name] for name in ORACLE)
        # the duels' ARC phase is the one a split gives them: from the first request, not the first ghost hit
        arc_from_first = duel_found(trace, blocks, [0])
        row["arc_from_first"] = outcome(trace, arc_from_first).hit_ratio
        for name, (_, arc_first) in DUELS.items():
            switches = duel_switches(recency_found, arc_from_first, arc_first)
            row[name] = outcome(trace, duel_found(trace, blocks, switches)).hit_ratio
            row[f"{name}_switches"] = switches
        rows.append(row)
    return rows


def flags(row: dict[str, Any], name: str) -> tuple[bool, bool]:
    """Whether ``name``'s hit ratio in ``row`` is flagged: against the offline LRU or ARC; against ``lmcache_sim``."""
    flagged = matrix_flags(row, row[name])
    return "lru" in flagged or "arc" in flagged, "lmcache_sim" in flagged


def summary(rows: list[dict[str, Any]], requests: int, first: int) -> dict[str, dict[str, Any]]:
    """Per variant (and ``oracle``, the duels): the sum of its hit ratios over ``rows`` and its flagged rows at each
    length."""
    out = {}
    for name in (*VARIANTS, "oracle", *DUELS):
        counted = {"hit_ratio_sum": round(sum(row[name] for row in rows), 3)}
        for length in (requests, first):
            at = [flags(row, name) for row in rows if row["requests"] == length]
            counted[f"below_lru_or_arc_{length}"] = sum(1 for below, _ in at if below)
            counted[f"below_lmcache_sim_{length}"] = sum(1 for _, below in at if below)
        out[name] = counted
    return out


def render(counted: dict[str, dict[str, Any]], requests: int, first: int) -> str:
    """The summary as a markdown table."""
    lines = [f"| variant | what | sum of hit ratios | below LRU or ARC by > {TOLERANCE} ({requests:,} / {first:,} "
             f"requests) | below `lmcache_sim` ({requests:,} / {first:,}) |", "|---|---|---|---|---|"]
    described = {**{name: what for name, (what, _) in VARIANTS.items()},
                 "oracle": "per row, the better of " + " and ".join(ORACLE),
                 **{name: what for name, (what, _) in DUELS.items()}}
    for name, c in counted.items():
        what = described[name]
        lines.append(f"| `{name}` | {what} | {c['hit_ratio_sum']:.3f} | {c[f'below_lru_or_arc_{requests}']} / "
                     f"{c[f'below_lru_or_arc_{first}']} | {c[f'below_lmcache_sim_{requests}']} / "
                     f"{c[f'below_lmcache_sim_{first}']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, progress: Callable[[str], None] | None = None) -> int:
    args, rows = seeded_replay("phase_ablation", __doc__, (SEEDS, REQUESTS, FIRST), "the summary and every row", _rows,
                               argv, progress)
    if rows is None:
        return 130
    counted = summary(rows, args.requests, args.first)
    print(json.dumps({"summary": counted, "rows": rows}, indent=1) if args.json
          else render(counted, args.requests, args.first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
