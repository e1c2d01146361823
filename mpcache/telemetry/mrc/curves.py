"""Miss-ratio curves over the sampled chunk accesses — SHARDS (Waldspurger et al., FAST 2015) with the
hottest keys tracked exactly (Carra et al., ATC 2020) — and the miss reasons decided from the same history.

Two strata of keys: the first ``exact_chunks`` chunks of every lookup (system prompts and popular
documents: a prefix cache's hot keys), all of them, and every other chunk whose hash passes the sampling
rule.  Each stratum keeps at most half of ``max_keys``: past it, its threshold drops to its largest tracked
hash value and the keys at or above it go (SHARDS' fixed-size mode), so a stratum samples at
``threshold / P``.  One byte-weighted LRU stack holds the tracked keys of the whole service; an access's
reuse distance is the bytes above it, each stratum's scaled by 1 / its rate, and it counts 1 / its stratum's
rate in the histogram of the curve over everything (``"*"``) and of its (model_name, cache_salt).  A curve's
hit ratio at a capacity is the weighted share of lookup accesses whose distance fits.  Thread-safe through
``lock``: the pump feeds it, the HTTP and metric threads read it.
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.telemetry import statecheck
from mpcache.telemetry.mrc.mini import MiniCache
from mpcache.telemetry.mrc.stack import ReuseStack

ALL = "*"
OVERFLOW = "__overflow__"
FORGOTTEN_PER_KEY = 2  # keys pruned for depth remembered as seen: up to 2 × max_keys (at least max_keys)
MAX_KEY_BYTES = 1 << 40  # a key's bytes at most (a corrupt size cannot overflow the stack's int64 sums)
MAX_TENANT_CURVES = 50  # (model_name, cache_salt) pairs with their own curve at most; later ones share OVERFLOW's
GAUGE_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # capacity ratios exported as mpcache_mrc_hit_ratio
POINT_RATIOS = tuple(2.0 ** (k / 4) for k in range(-12, 17))  # /mrc points: 0.125× … 16×, quarter octaves
HEAD, SAMPLED = 0, 1  # the strata: a lookup's first chunks, and the hash-sampled rest
L1_HIT, L2_HIT, AFTER_GAP, MISS = "l1", "l2", "after_gap", "miss"  # what a lookup found of one key

Row = tuple[int, str, str]  # (chunk_hash, cache_salt, model_name), as producers ship sampled keys
Access = tuple[Row, int, str, int]  # (key, stratum, what the lookup found, objects it stands for)
Tenant = tuple[str, str]  # (model_name, cache_salt)


class Histogram:
    """Weighted lookup accesses per capacity edge (``counts[i]``: distance in (edges[i-1], edges[i]];
    the last bucket: beyond every edge, or a key not seen before)."""

    __slots__ = ("counts", "total", "sampled_accesses")

    def __init__(self, buckets: int) -> None:
        self.counts = [0.0] * buckets
        self.total = 0.0  # the accesses these stand for
        self.sampled_accesses = 0  # the sampled accesses, never decayed: the sample size behind the curve

    def scale(self, factor: float) -> None:
        self.counts = [count * factor for count in self.counts]
        self.total *= factor

    def hit_ratios(self) -> list[float] | None:
        """The hit ratio at each edge (None before any access)."""
        if self.total <= 0:
            return None
        cumulative, out = 0.0, []
        for count in self.counts[:-1]:
            cumulative += count
            out.append(min(1.0, cumulative / self.total))
        return out


class _Stratum:
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


class CurveSet:
    """The curves of one service: ``capacities`` maps a tier name to its configured bytes; ``policy`` is the
    eviction order they model (``--l1-policy``): LRU from the reuse distances, any other by a miniature
    simulation per capacity (:mod:`~mpcache.telemetry.mrc.mini`) over the hash-sampled keys."""

    def __init__(self, sample_rate: float, max_keys: int, capacities: dict[str, int],
                 max_tenants: int = MAX_TENANT_CURVES, policy: str = "lru") -> None:
        self.lock = threading.Lock()
        self.policy = policy
        self.max_tenants = max_tenants
        self.configured_rate = sample_rate
        self.max_keys = max_keys
        self.capacities = dict(capacities)
        self._strata = (_Stratum(1.0, max_keys // 2), _Stratum(sample_rate, max_keys - max_keys // 2))
        self._edges = sorted({round(capacity * ratio) for capacity in capacities.values() for ratio in POINT_RATIOS})
        self._stack = ReuseStack(max_keys + 2, strata=2)
        self._minis = None if policy == "lru" else [MiniCache(policy, edge * sample_rate) for edge in self._edges]
        self._curves: dict[Tenant, Histogram] = {(ALL, ALL): Histogram(len(self._edges) + 1)}
        self._forgotten: dict[Row, None] = {}  # the keys pruned for depth, oldest first
        self._object_bytes: dict[str, int] = {}  # per model, the size its last store said
        # estimates not yet taken by the counters: (reason, model_name, cache_salt) → chunks, and per tenant the
        # chunks asked for again after L1 evicted them
        self.misses: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        self.regret: defaultdict[Tenant, float] = defaultdict(float)

    @property
    def rate(self) -> float:
        """The sampling rate of the chunks past a lookup's first ones."""
        return self._strata[SAMPLED].rate

    @property
    def head_rate(self) -> float:
        return self._strata[HEAD].rate

    @property
    def tracked_keys(self) -> int:
        return len(self._stack)

    def tenant(self, model: str, salt: str) -> Tenant:
        pair = (model, salt)
        if pair == (ALL, ALL) or (pair not in self._curves and len(self._curves) > self.max_tenants):
            return (OVERFLOW, OVERFLOW)  # a client's "*" / "*" would be the curve over everything twice over
        return pair

    # -- the sampled stream (pump thread) ---------------------------------------------------------------

    def lookup(self, model: str, salt: str, ranks: int, accesses: Sequence[Access]) -> None:
        """One lookup's sampled keys, in order.  Every key's distance is taken before any is touched (a hit
        evicts nothing, so within a lookup no key's presence depends on another's); then all of them become
        the most recently used, as the hits are and as the engine's store of the misses makes the rest (a key
        seen before, asked for or stored, is held; missing now, it was evicted)."""
        stack, edges, forgotten = self._stack, self._edges, self._forgotten
        thresholds = [stratum.threshold for stratum in self._strata]
        weights = self._weights()
        tenant = self.tenant(model, salt)
        histograms = (self._curve(ALL, ALL), self._curve(*tenant))
        judged: list[tuple[Row, int, int]] = []
        for row, stratum, found, objects in accesses:
            entry = stack.get(row)
            if entry is not None:
                stratum = entry[2]
            if not row[0] % SAMPLE_MODULUS < thresholds[stratum]:
                continue
            weight = weights[stratum] * objects
            held = entry is not None or (bool(forgotten) and row in forgotten)  # a miss now is an eviction
            if self._minis is None:
                bucket = len(edges) if entry is None else bisect.bisect_left(
                    edges, stack.weighted_above(entry[0], weights) + entry[1])
                for histogram in histograms:
                    histogram.counts[bucket] += weight
                    histogram.total += weight
                    histogram.sampled_accesses += 1
            if found != L1_HIT:
                self._count(tenant, found, held, weight / ranks)
            judged.append((row, stratum, objects))
        size = self._object_bytes.get(model, 0)
        if self._minis is not None:
            self._simulate(histograms, [(row, min(size * objects, MAX_KEY_BYTES), weights[SAMPLED] * objects)
                                        for row, _, objects in judged if self._strata[SAMPLED].admits(row)])
        for row, stratum, objects in judged:
            nbytes = min(size * objects, MAX_KEY_BYTES)
            entry = stack.get(row)  # a key an earlier insert of this loop made the stack forget is inserted anew
            if entry is not None:  # a head key's size follows its model's (a sampled key's comes with its stores)
                stack.touch(row, nbytes if entry[2] == HEAD and size else entry[1], entry[2])  # a key keeps its stratum
            elif self._strata[stratum].admits(row):  # an earlier insert may have lowered the threshold past it
                self._insert(row, nbytes, stratum)

    def _simulate(self, histograms: Sequence[Histogram], keys: list[tuple[Row, int, float]]) -> None:
        """One lookup's hash-sampled keys (key, bytes, weight) through every miniature: an access hit at the
        capacities whose miniature held its key (not monotone in the capacity: a bucket's count is the change
        in hits from the edge before, and may be negative)."""
        if not keys:
            return
        sized = [(row, nbytes) for row, nbytes, _ in keys]
        hits = [mini.lookup(sized) for mini in self._minis or ()]
        for index, (_, _, weight) in enumerate(keys):
            changes, before = [], False
            for of_mini in hits:
                hit = of_mini[index]
                changes.append(weight * (hit - before))
                before = hit
            changes.append(weight * (1 - before))
            for histogram in histograms:
                counts = histogram.counts
                for bucket, change in enumerate(changes):
                    if change:
                        counts[bucket] += change
                histogram.total += weight
                histogram.sampled_accesses += 1

    def _count(self, tenant: Tenant, found: str, held: bool, chunks: float) -> None:
        """Miss reasons and eviction regret of one sampled access that L1 did not serve (``chunks``: what it
        stands for)."""
        if found == L2_HIT:
            if held:
                self.regret[tenant] += chunks
            return
        reason = "after_gap" if found == AFTER_GAP else "evicted" if held else "cold"
        self.misses[(reason, tenant[0], tenant[1])] += chunks
        if reason == "evicted":
            self.regret[tenant] += chunks

    def store(self, model: str, object_bytes: int, rows: Iterable[Row]) -> None:
        """A store's sampled keys (hash-sampled), each now the most recently used (a head key keeps its size:
        it stands for every rank of its chunk)."""
        object_bytes = min(object_bytes, MAX_KEY_BYTES)
        self._object_bytes[model] = object_bytes
        stack = self._stack
        if self._minis is not None:
            sampled = self._strata[SAMPLED]
            admitted = [(row, object_bytes) for row in rows if sampled.admits(row)]
            for mini in self._minis:
                mini.store(admitted)
        for row in rows:
            stratum = stack.stratum_of(row) if row in stack else SAMPLED
            if self._strata[stratum].admits(row):
                if row in stack:
                    keep = stratum == HEAD and stack.bytes_of(row)
                    stack.touch(row, stack.bytes_of(row) if keep else object_bytes, stratum)
                else:
                    self._insert(row, object_bytes, stratum)

    def take_counts(self) -> tuple[dict[tuple[str, str, str], float], dict[Tenant, float]]:
        """The miss and regret estimates added since the last call (the counters' increments)."""
        misses, regret = self.misses, self.regret
        self.misses, self.regret = defaultdict(float), defaultdict(float)
        return misses, regret

    def decay(self, factor: float) -> None:
        """Multiply every access weight by ``factor`` (the half-life window)."""
        for histogram in self._curves.values():
            histogram.scale(factor)

    def _insert(self, row: Row, nbytes: int, stratum: int) -> None:
        self._stack.touch(row, nbytes, stratum)
        if self._forgotten:
            self._forgotten.pop(row, None)
        keys = self._strata[stratum]
        heapq.heappush(keys.heap, (-(row[0] % SAMPLE_MODULUS), row))
        keys.keys += 1
        if keys.keys > keys.budget:
            self._prune()
            if keys.keys > keys.budget - keys.budget // 4:
                self._lower(stratum)

    def _prune(self) -> None:
        """Forget the keys deeper than the largest capacity of any curve: every capacity misses them anyway."""
        for row, stratum in self._stack.prune(self._edges[-1], self._weights()) if self._edges else ():
            self._strata[stratum].keys -= 1
            self._forgotten[row] = None  # type: ignore[index]
        for index in (HEAD, SAMPLED):  # the pruned keys' heap entries are stale now
            self._compact(index)
        if len(self._forgotten) > FORGOTTEN_PER_KEY * self.max_keys:  # keep the newer half (amortised O(1))
            newest = list(self._forgotten)[-(FORGOTTEN_PER_KEY * self.max_keys // 2):]
            self._forgotten = dict.fromkeys(newest)

    def _lower(self, index: int) -> None:
        """SHARDS fixed-size: the stratum's new threshold is its largest tracked hash value; keys at or above
        it go.  Weights recorded at the old rate stay what they were: estimates of the accesses then.  The
        heap also holds entries of keys pruned since (skipped, and dropped once they outnumber the live ones)."""
        keys, stack = self._strata[index], self._stack
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
                keys.keys -= 1
        if index == SAMPLED and self._minis is not None and keys.threshold:
            for mini in self._minis:
                mini.keep(lambda key: key[0] % SAMPLE_MODULUS < new_threshold, new_threshold / keys.threshold)
        keys.threshold = new_threshold
        self._compact(index)

    def _compact(self, index: int) -> None:
        """Drop the stratum's stale heap entries (keys pruned or lowered since they were pushed, and repeats)
        once they outnumber the live ones: the heap stays within 2 × the stratum's keys + 16, and each rebuild
        costs the entries pushed since the last (amortised O(1))."""
        keys = self._strata[index]
        if len(keys.heap) > 2 * keys.keys + 16:
            live = dict.fromkeys(row for _, row in keys.heap if self._live(row, index))
            keys.heap = [(-(row[0] % SAMPLE_MODULUS), row) for row in live]
            heapq.heapify(keys.heap)

    def _weights(self) -> list[float]:
        """Per stratum, what one tracked byte or access stands for: 1 / its rate (0 for a stratum that admits
        nothing)."""
        return [SAMPLE_MODULUS / stratum.threshold if stratum.threshold else 0.0 for stratum in self._strata]

    def _live(self, row: Row, index: int) -> bool:
        return row in self._stack and self._stack.stratum_of(row) == index

    def _curve(self, model: str, salt: str) -> Histogram:
        histogram = self._curves.get((model, salt))
        if histogram is None:
            histogram = self._curves[(model, salt)] = Histogram(len(self._edges) + 1)
        return histogram

    # -- the telemetry process's checkpoint (under ``lock``) ------------------------------------------------

    def save_curves(self) -> dict[str, Any]:
        """What the exported numbers are made of: every curve's counts, the estimates not yet taken by the
        counters, the models' object sizes (small: saved at every checkpoint)."""
        return {"curves": [[model, salt, h.counts, h.total, h.sampled_accesses]
                           for (model, salt), h in self._curves.items()],
                "object_bytes": list(self._object_bytes.items()),
                "misses": list(self.misses.items()), "regret": list(self.regret.items())}

    def save_history(self) -> dict[str, Any]:
        """What the next accesses are judged against: the strata's rates, the tracked keys in stack order (their
        sizes and strata) and the forgotten keys (up to 3 × ``max_keys`` rows: saved less often)."""
        return {"strata": [[stratum.threshold, stratum.keys] for stratum in self._strata],
                "stack": list(self._stack.entries()), "forgotten": list(self._forgotten)}

    def load_state(self, curves_state: object, history_state: object) -> Callable[[], None]:
        """Check a :meth:`save_curves` and a :meth:`save_history` of a curve set of this configuration; returns
        the step adopting them."""
        saved = statecheck.fields(curves_state, curves="l", object_bytes="l", misses="l", regret="l")
        history = statecheck.fields(history_state, strata="l", stack="l", forgotten="l")
        strata = statecheck.rows(history["strata"], "fi")
        stack = [(key, nbytes, stratum) for key, (_, nbytes, stratum) in
                 statecheck.entries(history["stack"], "iss", "iii")]
        forgotten = dict.fromkeys(statecheck.rows(history["forgotten"], "iss"))
        curves = {(model, salt): (counts, total, sampled)
                  for model, salt, counts, total, sampled in statecheck.rows(saved["curves"], "sslfi")}
        buckets = len(self._edges) + 1
        if (len(strata) != len(self._strata) or len(stack) > 2 * self.max_keys + 16 or (ALL, ALL) not in curves
                or len(curves) > self.max_tenants + 2
                or any(len(c) != buckets or not all(statecheck.fits(x, "f") for x in c) for c, _, _ in curves.values())
                or any(not 0 <= stratum < len(self._strata) or not 0 <= nbytes <= MAX_KEY_BYTES
                       for _, nbytes, stratum in stack)):
            raise ValueError("not the curves of this configuration")
        object_bytes = dict(statecheck.rows(saved["object_bytes"], "si"))
        misses = statecheck.entries(saved["misses"], "sss", "f")
        regret = statecheck.entries(saved["regret"], "ss", "f")

        def adopt() -> None:
            self._stack.load(stack)
            for stratum, (threshold, keys) in zip(self._strata, strata):
                stratum.threshold, stratum.keys = threshold, keys
            for index, stratum in enumerate(self._strata):
                stratum.heap = [(-(key[0] % SAMPLE_MODULUS), key) for key, _, of in stack if of == index]
                heapq.heapify(stratum.heap)
            self._forgotten = forgotten
            self._curves = {}
            for tenant, (counts, total, sampled) in curves.items():
                histogram = self._curves[tenant] = Histogram(buckets)
                histogram.counts, histogram.total, histogram.sampled_accesses = counts, total, sampled
            self._object_bytes = object_bytes
            self.misses = defaultdict(float, misses)
            self.regret = defaultdict(float, regret)
        return adopt

    # -- readers (any thread, under ``lock``) --------------------------------------------------------------

    def curves(self) -> list[dict[str, Any]]:
        """Every curve of every tier, as ``GET /mrc`` lists them."""
        out = []
        for (model, salt), histogram in self._curves.items():
            ratios = histogram.hit_ratios()
            for tier, capacity in self.capacities.items():
                points = []
                if ratios is not None:
                    for ratio in POINT_RATIOS:
                        size = round(capacity * ratio)
                        points.append({"capacity_bytes": size,
                                       "hit_ratio": round(ratios[bisect.bisect_left(self._edges, size)], 6)})
                out.append({"tier": tier, "model_name": model, "cache_salt": salt, "capacity_bytes": capacity,
                            "sampled_accesses": histogram.sampled_accesses, "points": points})
        return out

    def gauge_points(self) -> list[tuple[float, dict[str, str]]]:
        """(hit ratio, attributes) at each of ``GAUGE_RATIOS`` of each tier, for every curve with data."""
        out = []
        for (model, salt), histogram in self._curves.items():
            ratios = histogram.hit_ratios()
            if ratios is None:
                continue
            for tier, capacity in self.capacities.items():
                for ratio in GAUGE_RATIOS:
                    value = ratios[bisect.bisect_left(self._edges, round(capacity * ratio))]
                    out.append((value, {"tier": tier, "model_name": model, "cache_salt": salt,
                                        "capacity_ratio": f"{ratio:g}"}))
        return out
