"""Admission by chance, the ``adaptive`` order's where it pays.  Where most stores are never asked for again and
what does return comes back later than L1 keeps a store it admits, admitting a first-sight store with a chance of
:data:`CHANCE` keeps the stores it does admit for longer (a refused store's keys are remembered, so that its second
sight is admitted: a conversation whose turn was refused is kept from its next turn on).  Whether it pays is tried
on each workload, not assumed: two LRUs of L1's capacity, one that admits so and one that admits every store, run
on a hash-sampled share of the keys asked for (:mod:`~mpcache.eviction.shadow`), and L1 admits as the one it does
not follow does once that one's finds lead both L1's and the other LRU's by :data:`CHANCE_SIGMAS` standard
deviations (leading L1 alone was not enough on one trace: benchmarks/HISTORY.md, *Admission by chance where it
pays*).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from mpcache.eviction.shadow import ShadowLru

CHANCE = 0.25  # the chance that a first-sight store is admitted, once admission by chance pays
CHANCE_SIGMAS = 3.0  # how far an LRU's finds must lead (in standard deviations) for L1 to admit as it does
TRIAL_HALVINGS = 5  # the trial's LRUs see 1 / 2 ** this of the keys at the most (each sampled key costs their work)
TRIAL_MIN_KEYS = 64  # fewer sampled keys than this in an LRU of L1's capacity tell nothing: no trial (L1 too small)


def worth_a_trial(capacity_bytes: float, object_bytes: float) -> bool:
    """Whether an L1 of ``capacity_bytes`` holding objects of ``object_bytes`` is large enough for a trial: its LRUs
    would hold at least :data:`TRIAL_MIN_KEYS` sampled keys (fewer tell nothing, at the cost of their work)."""
    return capacity_bytes >= object_bytes * (TRIAL_MIN_KEYS << TRIAL_HALVINGS)


class ChanceTrial:
    """Whether L1 should admit first-sight stores by chance (``chance``: 1, or :data:`CHANCE`): an LRU of its
    capacity that does (``by_chance``) and one that does not (``lru``), against what L1 finds of the same sampled
    keys: 1 / 2 ** ``halvings`` of them at most (:data:`TRIAL_HALVINGS` at first), those whose mixed code's top
    ``halvings`` bits are 0, which ``sketch`` (the order's frequency sketch, set to sample so) tells as it counts a
    key.  Each access is a step of two sums: the keys that the LRU whose admission L1 does not follow found and L1
    did not, less the other way round; and the keys that ``by_chance`` found and ``lru`` did not, less the other
    way round (each finds a prefix: nothing after its first miss in the access).  Once L1 has missed its capacity's
    worth of bytes, L1 follows that LRU when the first sum and the second (by chance: positive, else negative) are
    each above :data:`CHANCE_SIGMAS` times the root of their steps' squares' sum (a request's chunks are kept or
    lost together, so the access is the unit of evidence), and the sums start over.  The order has none where it
    may not admit by chance (a store L1 refuses would not reach an L2 tier either, or L1 is too small for a trial,
    :func:`worth_a_trial`).  A miniature's (:mod:`~mpcache.telemetry.mrc.mini`) samples
    the keys L1's does, of those it is given."""

    def __init__(self, capacity_bytes: float, code: Callable[[Hashable], int], sketch: Any) -> None:
        self.lru = ShadowLru(capacity_bytes, code)
        self.by_chance = ShadowLru(capacity_bytes, code, admit=CHANCE)
        for shadow in (self.lru, self.by_chance):
            shadow.follow(TRIAL_HALVINGS)
        self._sketch = sketch
        sketch.sample_bits = self.halvings = TRIAL_HALVINGS
        self.chance = 1.0
        self.switches = 0
        self._access = -1
        self._found = [0, 0]  # the current access's prefix found by each LRU
        self._missed = [False, False]  # and whether each has missed one of its keys
        self._l1 = 0  # the current access's keys L1 found
        # what the LRU L1 does not follow found more than L1, and more than the other LRU: each sum since the last
        # switch, its lowest, and its steps' squares since that lowest
        self._sums, self._lows, self._since = [0, 0], [0, 0], [0, 0]
        self._settling = float(capacity_bytes)  # bytes L1 is to miss before the evidence counts: a full L1's worth

    def sees(self, key: Hashable, nbytes: float, access: int, found: bool) -> None:
        """A sampled ``key`` (of ``nbytes``) asked for by ``access``, which L1 ``found``."""
        if access != self._access:
            self._settle()
            self._access = access
        counts, missed = self._found, self._missed
        lru, by_chance = self.lru, self.by_chance
        answers = (lru.sees(key, nbytes, access, True), by_chance.sees(key, nbytes, access, True))
        if lru.halvings != self.halvings or by_chance.halvings != self.halvings:
            self._follow()  # one of them halved as it settled the access before: this key may not be sampled now
            return
        for index, held in enumerate(answers):
            if not held:
                missed[index] = True
            elif not missed[index]:
                counts[index] += 1
        self._l1 += found
        if not found and self._settling > 0:
            self._settling -= nbytes * (1 << self.halvings)  # the bytes the sampled key stands for

    def _settle(self) -> None:
        """The access before is one step of two sums: what the LRU whose admission L1 does not follow found more
        than L1, and more than the other LRU; each is tested from its lowest since the last switch."""
        counts, other = self._found, 0 if self.chance < 1.0 else 1
        lead, gain = counts[other] - self._l1, (counts[1] - counts[0]) * (1 if other else -1)
        if (lead or gain) and self._settling <= 0:  # (a step of 0 changes neither test)
            sums, lows, since = self._sums, self._lows, self._since
            passed = 0
            for index, step in ((0, lead), (1, gain)):
                total = sums[index] = sums[index] + step
                if total <= lows[index]:
                    lows[index], since[index] = total, 0
                else:
                    since[index] += step * step
                    passed += total - lows[index] > CHANCE_SIGMAS * since[index] ** 0.5
            if passed == 2:
                self.chance = CHANCE if other else 1.0
                self.switches += 1
                self._sums, self._lows, self._since = [0, 0], [0, 0], [0, 0]
        counts[0] = counts[1] = self._l1 = 0
        self._missed[0] = self._missed[1] = False

    def _follow(self) -> None:
        """One LRU halved its sampling rate: the other and the sketch follow."""
        halvings = self.halvings = self._sketch.sample_bits = max(self.lru.halvings, self.by_chance.halvings)
        for shadow in (self.lru, self.by_chance):
            shadow.follow(halvings)
