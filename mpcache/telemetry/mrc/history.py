"""One cache process's sampled history (``docs/MRC.md``): its L1 is a cache of its own, so each process's keys
get their own byte-weighted LRU stack (or miniature caches), and a key counts as stored where that process
stored it.

Two strata of keys: a lookup's first chunks, all of them, and every other chunk whose hash passes the sampling
rule.  Each stratum keeps at most half of the history's key budget: past it, its threshold drops to its
largest tracked hash value and the keys at or above it go (SHARDS' fixed-size mode).  An access's reuse
distance is the bytes above it in the stack, each stratum's scaled by 1 / its rate, plus its own.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any

from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.telemetry import statecheck
from mpcache.telemetry.mrc.mini import MiniCache
from mpcache.telemetry.mrc.stack import ReuseStack

FORGOTTEN_PER_KEY = 2  # stored keys pruned for depth remembered: up to 2 × max_keys (at least max_keys)
MAX_KEY_BYTES = 1 << 40  # a key's bytes at most (a corrupt size cannot overflow the stack's int64 sums)
HEAD, SAMPLED = 0, 1  # the strata: a lookup's first chunks, and the hash-sampled rest
L1_HIT, L2_HIT, AFTER_GAP, MISS = "l1", "l2", "after_gap", "miss"  # what a lookup found of one key

Row = tuple[int, str, str]  # (chunk_hash, cache_salt, model_name), as producers ship sampled keys
Access = tuple[Row, int, str, int]  # (key, stratum, what the lookup found, objects it stands for)
# What a lookup's judged key adds to its curves: (weight, what the lookup found, bucket of its distance or
# None, the (edge index, change in hits) a miniature simulation gives, or None)
Judged = tuple[float, str, "int | None", "list[tuple[int, float]] | None"]


def _spread(edges: list[int], mini_edges: list[int]) -> list[list[tuple[int, float]]]:
    """Per miniature, the (edge index, share) its change in hits from the miniature below goes to: a key held
    from miniature i up weighs, at each edge, the sum of the interpolation's weights of miniatures i and above
    (:func:`_interpolation`), and each edge's bucket holds the change from the edge before."""
    nodes = [math.log(capacity + 1) for capacity in mini_edges]
    above = []  # per edge, per miniature: the weights of it and the miniatures above it
    for edge in edges:
        weights, total = _interpolation(math.log(edge + 1), nodes), 0.0
        sums = [0.0] * len(nodes)
        for index in range(len(nodes) - 1, -1, -1):
            total += weights[index]
            sums[index] = total
        above.append(sums)
    out: list[list[tuple[int, float]]] = []
    for index in range(len(nodes)):
        shares, before = [], 0.0
        for edge, sums in enumerate(above):
            if abs(sums[index] - before) > 1e-12:
                shares.append((edge, sums[index] - before))
            before = sums[index]
        out.append(shares)
    return out


def _interpolation(x: float, nodes: list[float]) -> list[float]:
    """The weight of each miniature's hit ratio in the curve at ``x`` (log capacity; ``nodes``: the miniatures'):
    a cubic Hermite spline through their points, each tangent the slope between its neighbours (Catmull-Rom,
    one-sided at the ends), its own hit ratio at a miniature's capacity and the nearest one's past the ends."""
    weights = [0.0] * len(nodes)
    upper = bisect.bisect_left(nodes, x)
    if upper == len(nodes) or nodes[upper] == x or upper == 0:
        weights[min(upper, len(nodes) - 1)] = 1.0
        return weights
    width = nodes[upper] - nodes[upper - 1]
    t = (x - nodes[upper - 1]) / width
    weights[upper - 1] += 2 * t ** 3 - 3 * t ** 2 + 1
    weights[upper] += 3 * t ** 2 - 2 * t ** 3
    for node, factor in ((upper - 1, width * (t ** 3 - 2 * t ** 2 + t)), (upper, width * (t ** 3 - t ** 2))):
        low, high = max(node - 1, 0), min(node + 1, len(nodes) - 1)
        slope = factor / (nodes[high] - nodes[low])
        weights[high] += slope
        weights[low] -= slope
    return weights


class Stratum:
    """One stratum's sampling threshold (in units of ``1/P``) and its tracked keys, largest hash first."""

    def __init__(self, rate: float, budget: int) -> None:
        self.threshold = rate * SAMPLE_MODULUS
        self.budget = budget
        self.heap: list[tuple[int, Row]] = []
        self.keys = 0

    @property
    def rate(self) -> float:
        return self.threshold / SAMPLE_MODULUS

    def admits(self, row: Row) -> bool:
        return row[0] % SAMPLE_MODULUS < self.threshold


class History:
    """The keys one cache process touched: ``edges`` are the capacities (of that process's share of a tier) the
    curves are read at; ``policy`` the order its L1 runs (LRU from the stack, any other by a miniature at each of
    ``mini_edges``, a subset of ``edges``, the others interpolated); ``stored`` the tracked keys known stored
    there (a store named them, or a lookup found them)."""

    def __init__(self, sample_rate: float, max_keys: int, edges: list[int], policy: str,
                 mini_edges: list[int] | None = None) -> None:
        self.max_keys = max_keys
        self.edges = edges
        self.strata = (Stratum(1.0, max_keys // 2), Stratum(sample_rate, max_keys - max_keys // 2))
        self.stack = ReuseStack(max_keys + 2, strata=2)
        self.mini_edges = sorted(set(edges if mini_edges is None else mini_edges))
        self.minis = None if policy == "lru" else [MiniCache(policy, edge) for edge in self.mini_edges]
        self._spread = _spread(edges, self.mini_edges)
        self.stored: set[Row] = set()
        self.forgotten: dict[Row, None] = {}  # the stored keys pruned for depth, oldest first

    def lookup(self, accesses: Sequence[Access], size: int) -> tuple[list[Judged], list[tuple[str, bool, float]]]:
        """One lookup's sampled keys, in order (objects of ``size`` bytes): what each adds to the curves, and
        (found, stored before, weight) of each for the miss reasons.  Every key's distance is taken before any
        is touched (a hit evicts nothing, so within a lookup no key's presence depends on another's); then all
        of them become the most recently used, as the hits are and as the engine's store of the misses makes
        the rest.  Only a store, or a lookup that found it, makes a key stored."""
        stack, edges, forgotten, stored = self.stack, self.edges, self.forgotten, self.stored
        thresholds = [stratum.threshold for stratum in self.strata]
        weights = self.weights()
        judged: list[tuple[Row, int, int, float, str]] = []
        curve: list[Judged] = []
        reasons: list[tuple[str, bool, float]] = []
        for row, stratum, found, objects in accesses:
            entry = stack.get(row)
            if entry is not None:
                stratum = entry[2]
            if not row[0] % SAMPLE_MODULUS < thresholds[stratum]:
                continue
            weight = weights[stratum] * objects
            if self.minis is None:
                bucket = len(edges) if entry is None else bisect.bisect_left(
                    edges, stack.weighted_above(entry[0], weights) + entry[1])
                curve.append((weight, found, bucket, None))
            reasons.append((found, row in stored or (bool(forgotten) and row in forgotten), weight))
            judged.append((row, stratum, objects, weight, found))
        if self.minis is not None:
            curve = self._simulate([(row, min(size * objects, MAX_KEY_BYTES) * weights[stratum], weight, found)
                                    for row, stratum, objects, weight, found in judged])
        for row, stratum, objects, _, found in judged:
            nbytes = min(size * objects, MAX_KEY_BYTES)
            entry = stack.get(row)  # a key an earlier insert of this loop made the stack forget is inserted anew
            if entry is not None:  # a head key's size follows its model's (a sampled key's comes with its stores)
                stack.touch(row, nbytes if entry[2] == HEAD and size else entry[1], entry[2])  # a key keeps its stratum
            elif self.strata[stratum].admits(row):  # an earlier insert may have lowered the threshold past it
                self._insert(row, nbytes, stratum)
            else:
                continue
            if found != MISS:  # found in a tier, or held past the gap: stored here
                stored.add(row)
        return curve, reasons

    def _simulate(self, keys: list[tuple[Row, float, float, str]]) -> list[Judged]:
        """One lookup's tracked keys (key, bytes scaled by 1 / its stratum's rate, weight, found) through every
        miniature: an access hit at the capacities whose miniature held its key (not monotone in the capacity: a
        bucket's count is the change in hits from the edge before, and may be negative), each change spread
        over the edges by the interpolation between the miniatures (:func:`_spread`)."""
        if not keys:
            return []
        minis = self.minis or []
        sized = [(row, nbytes) for row, nbytes, _, _ in keys]
        parents = minis[0].parents(sized) if minis else {}  # the same for every miniature: made once
        hits = [mini.lookup(sized, parents) for mini in minis]
        spread, beyond = self._spread, len(self.edges)
        out: list[Judged] = []
        for index, (_, _, weight, found) in enumerate(keys):
            changes: list[tuple[int, float]] = []
            before = False
            for of_mini, shares in zip(hits, spread):
                if of_mini[index] != before:
                    before = not before
                    change = weight if before else -weight
                    changes += [(edge, change * share) for edge, share in shares]
            if not before:
                changes.append((beyond, weight))
            out.append((weight, found, None, changes))
        return out

    def store(self, object_bytes: int, rows: Iterable[Row]) -> None:
        """A store's sampled keys, each now the most recently used and stored (a head key keeps its size: it
        stands for every rank of its chunk)."""
        rows = list(rows)
        stack = self.stack
        if self.minis is not None:
            weights = self.weights()
            admitted = []
            for row in rows:
                stratum = stack.stratum_of(row) if row in stack else SAMPLED
                if self.strata[stratum].admits(row):
                    admitted.append((row, (stack.bytes_of(row) if stratum == HEAD and row in stack else object_bytes)
                                     * weights[stratum]))
            parents = self.minis[0].parents(admitted) if self.minis else {}
            for mini in self.minis:
                mini.store(admitted, parents)
        for row in rows:
            stratum = stack.stratum_of(row) if row in stack else SAMPLED
            if self.strata[stratum].admits(row):
                if row in stack:
                    keep = stratum == HEAD and stack.bytes_of(row)
                    stack.touch(row, stack.bytes_of(row) if keep else object_bytes, stratum)
                else:
                    self._insert(row, object_bytes, stratum)
                if row in stack:
                    self.stored.add(row)

    def _insert(self, row: Row, nbytes: int, stratum: int) -> None:
        self.stack.touch(row, nbytes, stratum)
        if self.forgotten and row in self.forgotten:  # a stored key pruned for depth comes back still stored
            del self.forgotten[row]
            self.stored.add(row)
        keys = self.strata[stratum]
        heapq.heappush(keys.heap, (-(row[0] % SAMPLE_MODULUS), row))
        keys.keys += 1
        if keys.keys > keys.budget:
            self._prune()
            if keys.keys > keys.budget - keys.budget // 4:
                self._lower(stratum)

    def _prune(self) -> None:
        """Forget the keys deeper than the largest capacity of any curve: every capacity misses them anyway (the
        stored ones are remembered as stored)."""
        for row, stratum in self.stack.prune(self.edges[-1], self.weights()) if self.edges else ():
            self.strata[stratum].keys -= 1
            if row in self.stored:
                self.stored.discard(row)
                self.forgotten[row] = None
        for index in (HEAD, SAMPLED):  # the pruned keys' heap entries are stale now
            self._compact(index)
        if len(self.forgotten) > FORGOTTEN_PER_KEY * self.max_keys:  # keep the newer half (amortised O(1))
            newest = list(self.forgotten)[-(FORGOTTEN_PER_KEY * self.max_keys // 2):]
            self.forgotten = dict.fromkeys(newest)

    def _lower(self, index: int) -> None:
        """SHARDS fixed-size: the stratum's new threshold is its largest tracked hash value; keys at or above
        it go.  Weights recorded at the old rate stay what they were: estimates of the accesses then.  The
        heap also holds entries of keys pruned since (skipped, and dropped once they outnumber the live ones)."""
        keys, stack = self.strata[index], self.stack
        while keys.heap and not self._live(keys.heap[0][1], index):
            heapq.heappop(keys.heap)
        if not keys.heap:  # nothing left to forget (the count cannot outrun the heap, but never trust it)
            keys.keys = 0
            return
        new_threshold = -keys.heap[0][0]
        while keys.heap and -keys.heap[0][0] >= new_threshold:
            row = heapq.heappop(keys.heap)[1]
            if self._live(row, index):
                stack.remove(row)
                self.stored.discard(row)
                keys.keys -= 1
        if self.minis is not None:  # the miniatures forget what the stack forgot, and any untracked key past it
            def admits(row: Row) -> bool:
                return row in stack or row[0] % SAMPLE_MODULUS < new_threshold
            for mini in self.minis:
                mini.keep(admits)
        keys.threshold = new_threshold
        self._compact(index)

    def _compact(self, index: int) -> None:
        """Drop the stratum's stale heap entries (keys pruned or lowered since they were pushed, and repeats)
        once they outnumber the live ones: the heap stays within 2 × the stratum's keys + 16, and each rebuild
        costs the entries pushed since the last (amortised O(1))."""
        keys = self.strata[index]
        if len(keys.heap) > 2 * keys.keys + 16:
            live = dict.fromkeys(row for _, row in keys.heap if self._live(row, index))
            keys.heap = [(-(row[0] % SAMPLE_MODULUS), row) for row in live]
            heapq.heapify(keys.heap)

    def weights(self) -> list[float]:
        """Per stratum, what one tracked byte or access stands for: 1 / its rate (0 for a stratum that admits
        nothing)."""
        return [SAMPLE_MODULUS / stratum.threshold if stratum.threshold else 0.0 for stratum in self.strata]

    def _live(self, row: Row, index: int) -> bool:
        return row in self.stack and self.stack.stratum_of(row) == index

    # -- the telemetry process's checkpoint -------------------------------------------------------------

    def save(self) -> dict[str, Any]:
        """The strata's rates, the tracked keys in stack order (sizes and strata), which of them are stored, and
        the stored keys forgotten for depth (up to 4 × ``max_keys`` rows)."""
        return {"strata": [[stratum.threshold, stratum.keys] for stratum in self.strata],
                "stack": list(self.stack.entries()), "stored": list(self.stored), "forgotten": list(self.forgotten)}

    def check(self, state: object) -> Any:
        """Check a :meth:`save` of a history of this configuration; returns the step adopting it."""
        history = statecheck.fields(state, strata="l", stack="l", stored="l", forgotten="l")
        strata = statecheck.rows(history["strata"], "fi")
        stack = [(key, nbytes, stratum) for key, (_, nbytes, stratum) in
                 statecheck.entries(history["stack"], "iss", "iii")]
        stored = set(statecheck.rows(history["stored"], "iss"))
        forgotten = dict.fromkeys(statecheck.rows(history["forgotten"], "iss"))
        if (len(strata) != len(self.strata) or len(stack) > 2 * self.max_keys + 16 or len(stored) > len(stack)
                or len(forgotten) > (FORGOTTEN_PER_KEY + 1) * self.max_keys
                or any(not 0 <= stratum < len(self.strata) or not 0 <= nbytes <= MAX_KEY_BYTES
                       for _, nbytes, stratum in stack)):
            raise ValueError("not the history of this configuration")

        def adopt() -> None:
            self.stack.load(stack)
            for stratum, (threshold, keys) in zip(self.strata, strata):
                stratum.threshold, stratum.keys = threshold, keys
            for index, stratum in enumerate(self.strata):
                stratum.heap = [(-(key[0] % SAMPLE_MODULUS), key) for key, _, of in stack if of == index]
                heapq.heapify(stratum.heap)
            self.stored = {row for row in stored if row in self.stack}
            self.forgotten = forgotten
        return adopt
