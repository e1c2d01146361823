"""Miss-ratio curves by SHARDS (Waldspurger et al., FAST 2015) over the sampled chunk accesses, and the
miss reasons decided from the same sampled history.

One byte-weighted LRU stack holds every tracked key (the service's whole key space, every process
together); each access's reuse distance is scaled by ``1/R`` and recorded in the histogram of the
curve over everything (``"*"``) and of the access's (model_name, cache_salt).  A curve's hit ratio at a
capacity is the share of lookup accesses whose distance fits, with SHARDS' correction term.  Fixed-size
mode: past ``max_keys`` tracked keys, the rate drops to the largest tracked hash value and the keys at
or above it go.  Thread-safe: the pump feeds it, the HTTP and metric threads read it.
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.telemetry.mrc.stack import ReuseStack

ALL = "*"
OVERFLOW = "__overflow__"
MAX_TENANT_CURVES = 50  # (model_name, cache_salt) pairs with their own curve; later ones share OVERFLOW's
GAUGE_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # capacity ratios exported as mpcache_mrc_hit_ratio
POINT_RATIOS = tuple(2.0 ** (k / 4) for k in range(-12, 17))  # /mrc points: 0.125× … 16×, quarter octaves
REASONS = ("cold", "evicted", "after_gap")
# SHARDS_adj's correction term raised the error on the KV-shaped workloads of ``python -m mpcache.bench mrc``
# (docs/MRC.md has the numbers), so the exported curves are the plain sampled ones.
CORRECTED = False

Row = tuple[int, str, str]  # (chunk_hash, cache_salt, model_name), as producers ship sampled keys
Tenant = tuple[str, str]  # (model_name, cache_salt)


class Histogram:
    """Weighted lookup accesses per capacity edge (``counts[i]``: distance in (edges[i-1], edges[i]];
    the last bucket: beyond every edge, or no previous access)."""

    __slots__ = ("counts", "expected", "observed", "sampled_accesses")

    def __init__(self, buckets: int) -> None:
        self.counts = [0.0] * buckets
        self.expected = 0.0  # Σ accesses × R: the sampled accesses to expect
        self.observed = 0.0  # the sampled accesses recorded
        self.sampled_accesses = 0  # the same, never decayed or rescaled: the sample size behind the curve

    def scale(self, factor: float) -> None:
        self.counts = [count * factor for count in self.counts]
        self.expected *= factor
        self.observed *= factor

    def hit_ratios(self, corrected: bool = CORRECTED) -> list[float] | None:
        """Hit ratio at each edge: of the sampled accesses, or with SHARDS' correction (the accesses expected
        at the rate minus those sampled, counted at distance 0, over those expected)."""
        total = self.expected if corrected else self.observed
        if total <= 0 or self.observed <= 0:
            return None
        cumulative = self.expected - self.observed if corrected else 0.0
        out = []
        for count in self.counts[:-1]:
            cumulative += count
            out.append(min(1.0, max(0.0, cumulative / total)))
        return out


class CurveSet:
    """The curves of one service: ``capacities`` maps a tier name to its configured bytes."""

    def __init__(self, sample_rate: float, max_keys: int, capacities: dict[str, int]) -> None:
        self.lock = threading.Lock()
        self.configured_rate = sample_rate
        self.max_keys = max_keys
        self.capacities = dict(capacities)
        self._threshold = sample_rate * SAMPLE_MODULUS
        self._edges = sorted({round(capacity * ratio) for capacity in capacities.values() for ratio in POINT_RATIOS})
        self._stack = ReuseStack(max_keys)
        self._heap: list[tuple[int, Row]] = []  # (-(hash mod P), key) of every tracked key: the largest first
        self._curves: dict[Tenant, Histogram] = {(ALL, ALL): Histogram(len(self._edges) + 1)}
        self._object_bytes: dict[str, int] = {}  # per model, the size its last store said
        # estimates not yet taken by the counters: (reason, model_name, cache_salt) → chunks, and per tenant the
        # chunks asked for again after L1 evicted them
        self.misses: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        self.regret: defaultdict[Tenant, float] = defaultdict(float)

    @property
    def rate(self) -> float:
        return self._threshold / SAMPLE_MODULUS

    @property
    def tracked_keys(self) -> int:
        return len(self._stack)

    def tenant(self, model: str, salt: str) -> Tenant:
        pair = (model, salt)
        if pair not in self._curves and len(self._curves) > MAX_TENANT_CURVES:
            return (OVERFLOW, OVERFLOW)
        return pair

    # -- the sampled stream (pump thread) ---------------------------------------------------------------

    def expect(self, model: str, salt: str, accesses: int) -> None:
        """``accesses`` lookup accesses happened (sampled or not), at the current rate."""
        weight = accesses * self.rate
        for histogram in (self._curve(ALL, ALL), self._curve(*self.tenant(model, salt))):
            histogram.expected += weight

    def lookup(self, model: str, salt: str, ranks: int, rows: Sequence[Row], l1_hits: int, l2_hits: int,
               after_gap: int) -> None:
        """A lookup's sampled keys, ordered: L1 hits, L2 hits, after-gap misses, other misses.  Every key's
        distance is taken before any of them is touched (a hit evicts nothing, so within one lookup no key's
        presence depends on another's), then the hits become the most recently used."""
        threshold, stack, edges = self._threshold, self._stack, self._edges
        scale = 1.0 / self.rate
        per_chunk = scale / ranks
        tenant = self.tenant(model, salt)
        histograms = (self._curve(ALL, ALL), self._curve(*tenant))
        hits = l1_hits + l2_hits
        touched: list[tuple[Row, bool]] = []
        for index, row in enumerate(rows):
            if row[0] % SAMPLE_MODULUS >= threshold:
                continue
            tracked = row in stack
            bucket = (bisect.bisect_left(edges, stack.bytes_above(row) * scale + stack.bytes_of(row)) if tracked
                      else len(edges))
            for histogram in histograms:
                histogram.counts[bucket] += 1.0
                histogram.observed += 1.0
                histogram.sampled_accesses += 1
            if index < hits:
                touched.append((row, tracked))
                if index >= l1_hits and tracked:
                    self.regret[tenant] += per_chunk
            elif index < hits + after_gap:
                self.misses[("after_gap", tenant[0], tenant[1])] += per_chunk
            elif tracked:
                self.misses[("evicted", tenant[0], tenant[1])] += per_chunk
                self.regret[tenant] += per_chunk
            else:
                self.misses[("cold", tenant[0], tenant[1])] += per_chunk
        for row, tracked in touched:
            if tracked:
                stack.touch(row, stack.bytes_of(row))
            elif model in self._object_bytes and row not in stack:  # held before our history began
                self._insert(row, self._object_bytes[model])

    def store(self, model: str, object_bytes: int, rows: Iterable[Row]) -> None:
        """A store's sampled keys, each now the most recently used."""
        self._object_bytes[model] = object_bytes
        threshold = self._threshold
        for row in rows:
            if row[0] % SAMPLE_MODULUS < threshold:
                if row in self._stack:
                    self._stack.touch(row, object_bytes)
                else:
                    self._insert(row, object_bytes)

    def take_counts(self) -> tuple[dict[tuple[str, str, str], float], dict[Tenant, float]]:
        """The miss and regret estimates added since the last call (the counters' increments)."""
        misses, regret = self.misses, self.regret
        self.misses, self.regret = defaultdict(float), defaultdict(float)
        return misses, regret

    def decay(self, factor: float) -> None:
        """Multiply every access weight by ``factor`` (the half-life window)."""
        for histogram in self._curves.values():
            histogram.scale(factor)

    def _insert(self, row: Row, nbytes: int) -> None:
        self._stack.touch(row, nbytes)
        heapq.heappush(self._heap, (-(row[0] % SAMPLE_MODULUS), row))
        if len(self._stack) > self.max_keys:
            self._lower_rate()

    def _lower_rate(self) -> None:
        """SHARDS fixed-size: the new threshold is the largest tracked hash value; keys at or above it go,
        and the weights recorded at the old rate are rescaled to the new one."""
        heap, stack = self._heap, self._stack
        new_threshold = -heap[0][0]
        while heap and -heap[0][0] >= new_threshold:
            stack.remove(heapq.heappop(heap)[1])
        factor = new_threshold / self._threshold
        self._threshold = new_threshold
        for histogram in self._curves.values():
            histogram.scale(factor)

    def _curve(self, model: str, salt: str) -> Histogram:
        histogram = self._curves.get((model, salt))
        if histogram is None:
            histogram = self._curves[(model, salt)] = Histogram(len(self._edges) + 1)
        return histogram

    # -- readers (any thread, under ``lock``) --------------------------------------------------------------

    def curves(self) -> list[dict[str, object]]:
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
