"""Miss-ratio curves over the sampled chunk accesses — SHARDS (Waldspurger et al., FAST 2015) with the
hottest keys tracked exactly (Carra et al., ATC 2020) — and the miss reasons decided from the same history.

Each cache process's L1 is a cache of its own (``--l1-size``), so each has its own history
(:mod:`~mpcache.telemetry.mrc.history`: its tracked keys, their reuse distances or miniature caches, the keys
it stored), read at that process's share of each tier.  The curves add every process's accesses up: a point's
hit ratio is the hits of every process at its share of that capacity over the accesses of all of them, the
processes' predictions weighted by their accesses.  An access counts 1 / its stratum's rate in the curve over
everything (``"*"``), in its (model_name, cache_salt)'s, and in the marginal curves of its model across
tenants (``(model_name, "*")``) and of its cache_salt across models (``("*", cache_salt)``).  Beside the
prediction each curve keeps what the lookups measured of the same accesses: the share found in L1, and in L1
or L2.  Thread-safe through ``lock``: the pump feeds it, the HTTP and metric threads read it.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mpcache.eviction.admission import TRIAL_HALVINGS
from mpcache.telemetry import statecheck
from mpcache.telemetry.mrc.history import (
    AFTER_GAP,
    HEAD,
    L1_HIT,
    L2_HIT,
    MAX_KEY_BYTES,
    MISS,
    SAMPLED,
    Access,
    History,
    Judged,
    Row,
)

__all__ = ["AFTER_GAP", "ALL", "HEAD", "L1_HIT", "L2_HIT", "MISS", "OVERFLOW", "SAMPLED", "Access", "CurveSet", "Row"]

ALL = "*"
OVERFLOW = "__overflow__"
MAX_TENANT_CURVES = 50  # own curves at most, per kind (pairs, models, cache_salts); later ones share OVERFLOW
MIN_KEYS_PER_PROCESS = 16  # each cache process's history tracks max_keys / processes keys, at least this many
GAUGE_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # capacity ratios exported as mpcache_mrc_hit_ratio
POINT_RATIOS = tuple(2.0 ** (k / 4) for k in range(-12, 17))  # /mrc points: 0.125× … 16×, quarter octaves
MINI_RATIOS = POINT_RATIOS[::4]  # where a policy other than LRU runs a miniature: the octaves (the rest interpolated)
PAIR, BY_MODEL, BY_SALT = 0, 1, 2  # a curve's kind: one (model, salt), one model across salts, one salt across models
_OVERFLOW_KEYS = ((OVERFLOW, OVERFLOW), (OVERFLOW, ALL), (ALL, OVERFLOW))

Tenant = tuple[str, str]  # (model_name, cache_salt)


class Histogram:
    """Weighted lookup accesses per capacity edge (``counts[i]``: distance in (edges[i-1], edges[i]];
    the last bucket: beyond every edge, or a key not seen before), and of them those the lookups found in L1
    (``l1_hits``) and in L2 (``l2_hits``): the measured hit ratio over the same accesses and window."""

    __slots__ = ("counts", "total", "sampled_accesses", "l1_hits", "l2_hits")

    def __init__(self, buckets: int) -> None:
        self.counts = [0.0] * buckets
        self.total = 0.0  # the accesses these stand for
        self.sampled_accesses = 0  # the sampled accesses, never decayed: the sample size behind the curve
        self.l1_hits = 0.0
        self.l2_hits = 0.0

    def add(self, curve: Sequence[Judged], total: float, l1_hits: float, l2_hits: float, sampled: int) -> None:
        """One lookup's judged accesses (their weights sum to ``total``, of which the lookup found ``l1_hits``
        in L1 and ``l2_hits`` in L2; ``sampled`` of them keys, the others its tail judged from its head): each
        its distance's bucket, or a miniature simulation's changes in hits per edge."""
        counts = self.counts
        for weight, _, bucket, changes in curve:
            if bucket is not None:
                counts[bucket] += weight
            else:
                for index, change in changes or ():
                    counts[index] += change
        self.total += total
        self.sampled_accesses += sampled
        self.l1_hits += l1_hits
        self.l2_hits += l2_hits

    def scale(self, factor: float) -> None:
        self.counts = [count * factor for count in self.counts]
        self.total *= factor
        self.l1_hits *= factor
        self.l2_hits *= factor

    def hit_ratios(self) -> list[float] | None:
        """The hit ratio at each edge (None before any access)."""
        if self.total <= 0:
            return None
        cumulative, out = 0.0, []
        for count in self.counts[:-1]:
            cumulative += count
            out.append(max(0.0, min(1.0, cumulative / self.total)))  # an interpolated point may overshoot
        return out

    def measured(self, tier: str) -> float | None:
        """The share of the accesses the lookups found in L1 (tier ``l1``) or in L1 or L2 (None before any)."""
        if self.total <= 0:
            return None
        return min(1.0, (self.l1_hits + (0.0 if tier == "l1" else self.l2_hits)) / self.total)


def curve_kind(key: Tenant) -> int:
    """PAIR, BY_MODEL or BY_SALT for a curve's (model_name, cache_salt) other than (ALL, ALL)."""
    return BY_MODEL if key[1] == ALL else BY_SALT if key[0] == ALL else PAIR


class CurveSet:
    """The curves of one service of ``processes`` cache processes: ``capacities`` maps a tier name to its bytes
    over every process (each process's share: capacity / processes); ``policy`` is the eviction order they model
    (``--l1-policy``): LRU from the reuse distances, any other by a miniature simulation per capacity
    (:mod:`~mpcache.telemetry.mrc.mini`) over the hash-sampled keys."""

    def __init__(self, sample_rate: float, max_keys: int, capacities: dict[str, int],
                 max_tenants: int = MAX_TENANT_CURVES, policy: str = "lru", processes: int = 1,
                 trial: int | None = TRIAL_HALVINGS, first_sight: bool = True) -> None:
        self.lock = threading.Lock()
        self.policy = policy
        self.max_tenants = max_tenants
        self.configured_rate = sample_rate
        self.max_keys = max_keys
        self.processes = processes
        self.capacities = dict(capacities)
        self._edges = sorted({round(capacity / processes * ratio) for capacity in capacities.values()
                              for ratio in POINT_RATIOS})
        mini_edges = sorted({round(capacity / processes * ratio) for capacity in capacities.values()
                             for ratio in MINI_RATIOS})
        per_process = max(min(max_keys, MIN_KEYS_PER_PROCESS), max_keys // processes)
        self._histories = [History(sample_rate, per_process, self._edges, policy, mini_edges, trial, first_sight)
                           for _ in range(processes)]
        self._curves: dict[Tenant, Histogram] = {(ALL, ALL): Histogram(len(self._edges) + 1)}
        self._owned = [0, 0, 0]  # curves of their own, per kind
        self._object_bytes: dict[str, int] = {}  # per model, the size its last store said
        # estimates not yet taken by the counters: (reason, model_name, cache_salt) → chunks, and per tenant the
        # chunks asked for again after L1 evicted them
        self.misses: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        self.regret: defaultdict[Tenant, float] = defaultdict(float)

    @property
    def rate(self) -> float:
        """The sampling rate of the chunks past a lookup's first ones (the lowest of any process's)."""
        return min(history.strata[SAMPLED].rate for history in self._histories)

    @property
    def head_rate(self) -> float:
        return min(history.strata[HEAD].rate for history in self._histories)

    @property
    def tracked_keys(self) -> int:
        return sum(len(history.stack) for history in self._histories)

    def tenant(self, model: str, salt: str) -> Tenant:
        """The pair a lookup's miss counts and pair curve go under: its own while at most ``max_tenants`` pairs
        have one, and never one naming ``"*"`` (it would be a marginal curve, or the curve over everything)."""
        pair = (model, salt)
        return pair if ALL not in pair and self._own(pair, PAIR) else _OVERFLOW_KEYS[PAIR]

    def _own(self, key: Tenant, kind: int) -> bool:
        """Whether ``key`` has, or now gets, a curve of its own (at most ``max_tenants`` of each kind)."""
        if key in self._curves:
            return True
        if self._owned[kind] >= self.max_tenants:
            return False
        self._owned[kind] += 1
        self._curves[key] = Histogram(len(self._edges) + 1)
        return True

    def _histograms(self, model: str, salt: str, tenant: Tenant) -> list[Histogram]:
        """The curves an access of (``model``, ``salt``) counts in: everything, its pair's (``tenant``), its
        model's across salts and its salt's across models (a name ``"*"`` counts in the overflow curves)."""
        named = ALL not in (model, salt)
        by_model = (model, ALL) if named and self._own((model, ALL), BY_MODEL) else _OVERFLOW_KEYS[BY_MODEL]
        by_salt = (ALL, salt) if named and self._own((ALL, salt), BY_SALT) else _OVERFLOW_KEYS[BY_SALT]
        return [self._curve(key) for key in ((ALL, ALL), tenant, by_model, by_salt)]

    # -- the sampled stream (pump thread) ---------------------------------------------------------------

    def lookup(self, model: str, salt: str, ranks: int, accesses: Sequence[Access], process: int = 0,
               tail: int = 0, tail_found: tuple[int, int] = (0, 0), marks: Sequence[int] = ()) -> None:
        """One lookup's sampled keys, in order, by cache process ``process``, and how many objects lay past its
        head chunks (``tail``; ``tail_found``: of them found in L1, in L2; ``marks``: the tail's marks): judged
        against that process's history (:meth:`History.lookup <mpcache.telemetry.mrc.history.History.lookup>`).
        A miss of a key that process stored before is ``evicted``, of one it never stored ``cold``."""
        tenant = self.tenant(model, salt)
        histograms = self._histograms(model, salt, tenant)
        curve, reasons = self._histories[process].lookup(accesses, self._object_bytes.get(model, 0), tail,
                                                         tail_found, marks, ranks)
        self._add(histograms, curve, len(reasons))
        for found, stored, weight in reasons:
            if found != L1_HIT:
                self._count(tenant, found, stored, weight / ranks)

    @staticmethod
    def _add(histograms: list[Histogram], curve: list[Judged], sampled: int) -> None:
        if not curve:
            return
        total = l1_hits = l2_hits = 0.0
        for weight, found, _, _ in curve:
            total += weight
            if found == L1_HIT:
                l1_hits += weight
            elif found == L2_HIT:
                l2_hits += weight
        for histogram in histograms:
            histogram.add(curve, total, l1_hits, l2_hits, sampled)

    def _count(self, tenant: Tenant, found: str, stored: bool, chunks: float) -> None:
        """Miss reasons and eviction regret of one sampled access that L1 did not serve (``chunks``: what it
        stands for; ``stored``: whether that process stored the key before)."""
        if found == L2_HIT:
            if stored:
                self.regret[tenant] += chunks
            return
        reason = "after_gap" if found == AFTER_GAP else "evicted" if stored else "cold"
        self.misses[(reason, tenant[0], tenant[1])] += chunks
        if reason == "evicted":
            self.regret[tenant] += chunks

    def store(self, model: str, object_bytes: int, rows: Iterable[Row], process: int = 0) -> None:
        """A store's sampled keys by cache process ``process``: each now its most recently used, and stored."""
        object_bytes = min(object_bytes, MAX_KEY_BYTES)
        self._object_bytes[model] = object_bytes
        self._histories[process].store(object_bytes, rows)

    def take_counts(self) -> tuple[dict[tuple[str, str, str], float], dict[Tenant, float]]:
        """The miss and regret estimates added since the last call (the counters' increments)."""
        misses, regret = self.misses, self.regret
        self.misses, self.regret = defaultdict(float), defaultdict(float)
        return misses, regret

    def decay(self, factor: float) -> None:
        """Multiply every access weight by ``factor`` (the half-life window)."""
        for histogram in self._curves.values():
            histogram.scale(factor)

    def _curve(self, key: Tenant) -> Histogram:
        histogram = self._curves.get(key)
        if histogram is None:
            histogram = self._curves[key] = Histogram(len(self._edges) + 1)
        return histogram

    def _edge(self, capacity: int, ratio: float) -> int:
        """The index of the edge of each process's share of ``ratio`` × ``capacity``."""
        return bisect.bisect_left(self._edges, round(capacity / self.processes * ratio))

    # -- the telemetry process's checkpoint (under ``lock``) ------------------------------------------------

    def save_curves(self) -> dict[str, Any]:
        """What the exported numbers are made of: every curve's counts and measured hits, the estimates not yet
        taken by the counters, the models' object sizes (small: saved at every checkpoint)."""
        return {"curves": [[model, salt, h.counts, h.total, h.sampled_accesses, h.l1_hits, h.l2_hits]
                           for (model, salt), h in self._curves.items()],
                "object_bytes": list(self._object_bytes.items()),
                "misses": list(self.misses.items()), "regret": list(self.regret.items())}

    def save_history(self) -> dict[str, Any]:
        """What the next accesses are judged against: each process's history (saved less often)."""
        return {"processes": [history.save() for history in self._histories]}

    def load_state(self, curves_state: object, history_state: object) -> Callable[[], None]:
        """Check a :meth:`save_curves` and a :meth:`save_history` of a curve set of this configuration; returns
        the step adopting them."""
        saved = statecheck.fields(curves_state, curves="l", object_bytes="l", misses="l", regret="l")
        histories = statecheck.items(statecheck.fields(history_state, processes="l")["processes"], "d")
        if len(histories) != self.processes:
            raise ValueError(f"the history of {len(histories)} cache processes, not {self.processes}")
        adopt_histories = [history.check(state) for history, state in zip(self._histories, histories)]
        curves = {(model, salt): row for model, salt, *row in statecheck.rows(saved["curves"], "sslfiff")}
        buckets = len(self._edges) + 1
        if ((ALL, ALL) not in curves or len(curves) > 3 * (self.max_tenants + 1) + 1
                or any(len(c) != buckets or not all(statecheck.fits(x, "f") for x in c) for c, *_ in curves.values())):
            raise ValueError("not the curves of this configuration")
        object_bytes = dict(statecheck.rows(saved["object_bytes"], "si"))
        misses = statecheck.entries(saved["misses"], "sss", "f")
        regret = statecheck.entries(saved["regret"], "ss", "f")

        def adopt() -> None:
            for step in adopt_histories:
                step()
            self._curves, self._owned = {}, [0, 0, 0]
            for key, (counts, total, sampled, l1_hits, l2_hits) in curves.items():
                histogram = self._curves[key] = Histogram(buckets)
                histogram.counts, histogram.total, histogram.sampled_accesses = counts, total, sampled
                histogram.l1_hits, histogram.l2_hits = l1_hits, l2_hits
                if key != (ALL, ALL) and key not in _OVERFLOW_KEYS:
                    self._owned[curve_kind(key)] += 1
            self._object_bytes = object_bytes
            self.misses = defaultdict(float, misses)
            self.regret = defaultdict(float, regret)
        return adopt

    # -- readers (any thread, under ``lock``) --------------------------------------------------------------

    def curves(self) -> list[dict[str, Any]]:
        """Every curve of every tier, as ``GET /mrc`` lists them: the whole, each pair, each model across salts,
        each salt across models.  Capacities are a tier's over every process."""
        out = []
        for (model, salt), histogram in self._curves.items():
            ratios = histogram.hit_ratios()
            for tier, capacity in self.capacities.items():
                points = [] if ratios is None else [
                    {"capacity_bytes": round(capacity * ratio),
                     "hit_ratio": round(ratios[self._edge(capacity, ratio)], 6)} for ratio in POINT_RATIOS]
                measured = histogram.measured(tier)
                out.append({"tier": tier, "model_name": model, "cache_salt": salt, "capacity_bytes": capacity,
                            "sampled_accesses": histogram.sampled_accesses,
                            "measured_hit_ratio": None if measured is None else round(measured, 6), "points": points})
        return out

    def gauge_points(self) -> list[tuple[float, dict[str, str]]]:
        """(hit ratio, attributes) at each of ``GAUGE_RATIOS`` of each tier, for the curve over everything and
        every pair's with data (the marginal curves are in ``/mrc`` only: no new series)."""
        out = []
        for (model, salt), histogram in self._curves.items():
            ratios = histogram.hit_ratios()
            if ratios is None or (model == ALL) != (salt == ALL):
                continue
            for tier, capacity in self.capacities.items():
                for ratio in GAUGE_RATIOS:
                    out.append((ratios[self._edge(capacity, ratio)], {
                        "tier": tier, "model_name": model, "cache_salt": salt, "capacity_ratio": f"{ratio:g}"}))
        return out
