"""Admission, the ``adaptive`` order's where it pays: every store (as LRU admits), by chance, or under an age floor.

* By chance: where most stores are never asked for again and what does return comes back later than L1 keeps a store
  it admits, admitting a first-sight store with a chance of :data:`CHANCE` keeps the stores it does admit for longer
  (a refused store's keys are remembered, so that its second sight is admitted: a conversation whose turn was refused
  is kept from its next turn on).
* Under an age floor: where more sessions are active at once than L1 holds, each returning just after an LRU of L1's
  capacity has evicted it (coding agents' long contexts), every store evicts what is about to be asked for again and
  nothing stays long enough to be found.  A store is refused where the room it needs would evict an object used within
  the floor, :data:`FLOOR_AGES` times the age at which an LRU of L1's capacity evicts (refused again at its second
  sight: the floor is about what it would evict), so that the sessions L1 holds stay until they go quiet.

Which pays is tried on each workload, not assumed: three LRUs of L1's capacity, one per rule, run on a hash-sampled
share of the keys asked for (:mod:`~mpcache.eviction.shadow`), and L1 admits by a rule once that rule's LRU finds more
than L1, than the LRU of the rule L1 follows and than the LRU of each rule that refuses less, by
:data:`CHANCE_SIGMAS` standard deviations each (leading L1 alone was not enough on one trace: benchmarks/HISTORY.md,
*Admission by chance where it pays*; a rule that refuses more is taken only where it finds more than one that refuses
less: benchmarks/HISTORY.md, *An age floor for coding-agent sessions*).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from mpcache.eviction.shadow import ShadowLru

CHANCE = 0.25  # the chance that a first-sight store is admitted, once admission by chance pays
CHANCE_SIGMAS = 3.0  # how far a rule's LRU's finds must lead (in standard deviations) for L1 to admit by that rule
FLOOR_AGES = 2.0  # the age floor, in eviction ages of an LRU of L1's capacity
TRIAL_HALVINGS = 5  # the trial's LRUs see 1 / 2 ** this of the keys at the most (each sampled key costs their work)
TRIAL_MIN_HALVINGS = 3  # and at least this often (each halving fewer doubles the sampled keys' work): else no trial
TRIAL_MIN_KEYS = 64  # fewer sampled keys than this in an LRU of L1's capacity tell nothing: no trial (L1 too small)
RULES = ("every", "by_chance", "floored")  # the admission rules, in the order of how much they refuse


def trial_halvings(capacity_bytes: float, object_bytes: float) -> int | None:
    """How often the trial of an L1 of ``capacity_bytes`` holding objects of ``object_bytes`` halves its sampling
    rate: as often as leaves its LRUs at least :data:`TRIAL_MIN_KEYS` sampled keys, at most :data:`TRIAL_HALVINGS`
    times; None where that is fewer than :data:`TRIAL_MIN_HALVINGS` (fewer keys tell nothing, more cost their work)."""
    if object_bytes <= 0:
        return None
    halvings = min(TRIAL_HALVINGS, (int(capacity_bytes // object_bytes) // TRIAL_MIN_KEYS).bit_length() - 1)
    return halvings if halvings >= TRIAL_MIN_HALVINGS else None


class AdmissionTrial:
    """Which admission rule of :data:`RULES` L1 follows (``followed``, an index; ``chance``: 1, or :data:`CHANCE` by
    chance; ``floor``: the age floor in accesses while L1 follows it, else 0): an LRU of L1's capacity per rule
    (``shadows``: ``every`` admits every store, ``by_chance`` a first-sight one by chance, ``floored`` refuses one
    whose room would evict a key used within :data:`FLOOR_AGES` times ``every``'s eviction age), against what L1
    finds of the same sampled keys: 1 / 2 ** ``halvings`` of them at most (:func:`trial_halvings` at first), those
    whose mixed code's top ``halvings`` bits are 0, which ``sketch`` (the order's frequency sketch, set to sample so)
    tells as it counts a key.  Each access is a step of sums, one per rule L1 does not follow and per rival: the keys
    that the rule's LRU found and the rival did not, less the other way round, where the rivals are L1, the followed
    rule's LRU and the LRU of each rule that refuses less (each LRU finds a prefix: nothing after its first miss in
    the access).  Once L1 has missed its capacity's worth of bytes, L1 follows a rule when each of its sums is above
    :data:`CHANCE_SIGMAS` times the root of its steps' squares' sum since its lowest (a request's chunks are kept or
    lost together, so the access is the unit of evidence), and the sums start over.  The order has none where it may
    not refuse a first-sight store (a store L1 refuses would not reach an L2 tier either), or L1 is too small for a
    trial (:func:`trial_halvings`).  A miniature's (:mod:`~mpcache.telemetry.mrc.mini`) samples the keys L1's does, of
    those it is given."""

    def __init__(self, capacity_bytes: float, code: Callable[[Hashable], int], sketch: Any, halvings: int) -> None:
        self.every = ShadowLru(capacity_bytes, code, aged=True)
        self.by_chance = ShadowLru(capacity_bytes, code, admit=CHANCE)
        self.floored = ShadowLru(capacity_bytes, code, aged=True)
        self.shadows = (self.every, self.by_chance, self.floored)
        for shadow in self.shadows:
            shadow.follow(halvings)
        self._sketch = sketch
        sketch.sample_bits = self.halvings = halvings
        self.followed = 0
        self.switches = 0
        self._access = -1
        self._found = [0] * len(RULES)  # the current access's prefix found by each rule's LRU
        self._missed = [False] * len(RULES)  # and whether each has missed one of its keys
        self._l1 = 0  # the current access's keys L1 found
        self.take(0)
        self._settling = float(capacity_bytes)  # bytes L1 is to miss before the evidence counts: a full L1's worth

    @property
    def chance(self) -> float:
        """The chance a first-sight store is admitted: :data:`CHANCE` while L1 follows ``by_chance``, else 1."""
        return CHANCE if self.followed == 1 else 1.0

    @property
    def floor(self) -> float:
        """The age floor in accesses while L1 follows ``floored``, else 0."""
        return self.floored.floor if self.followed == 2 else 0.0

    def sees(self, key: Hashable, nbytes: float, access: int, found: bool) -> None:
        """A sampled ``key`` (of ``nbytes``) asked for by ``access``, which L1 ``found``."""
        if access != self._access:
            self._settle()
            self._access = access
            self.floored.floor = FLOOR_AGES * self.every.age
        counts, missed = self._found, self._missed
        every, by_chance, floored = self.shadows
        answers = (every.sees(key, nbytes, access, True), by_chance.sees(key, nbytes, access, True),
                   floored.sees(key, nbytes, access, True))
        halvings = self.halvings
        if every.halvings != halvings or by_chance.halvings != halvings or floored.halvings != halvings:
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

    def take(self, rule: int) -> None:
        """L1 admits by ``rule`` (an index of :data:`RULES`) from now on: each rule it does not follow is tested
        afresh against its rivals, L1 (-1), the followed rule and each rule that refuses less."""
        self.followed = followed = rule
        self._rivals = [[-1, *sorted({followed, *range(rule)} - {rule})] if rule != followed else []
                        for rule in range(len(RULES))]
        self._sums = [[0] * len(rivals) for rivals in self._rivals]  # each sum since the last switch,
        self._lows = [[0] * len(rivals) for rivals in self._rivals]  # its lowest,
        self._since = [[0] * len(rivals) for rivals in self._rivals]  # and its steps' squares since that lowest

    def _settle(self) -> None:
        """The access before is one step of each sum: what each rule's LRU found more than each of its rivals; each
        is tested from its lowest since the last switch."""
        counts, l1 = self._found, self._l1
        if self._settling <= 0 and not counts[0] == counts[1] == counts[2] == l1:  # (else every step is 0)
            for rule, rivals in enumerate(self._rivals):
                steps = [counts[rule] - (l1 if rival < 0 else counts[rival]) for rival in rivals]
                if not any(steps):  # (a step of 0 changes no test)
                    continue
                sums, lows, since = self._sums[rule], self._lows[rule], self._since[rule]
                passed = 0
                for index, step in enumerate(steps):
                    total = sums[index] = sums[index] + step
                    if total <= lows[index]:
                        lows[index], since[index] = total, 0
                    else:
                        since[index] += step * step
                        passed += total - lows[index] > CHANCE_SIGMAS * since[index] ** 0.5
                if passed == len(steps):
                    self.take(rule)
                    self.switches += 1
                    break
        for index in range(len(counts)):
            counts[index] = 0
            self._missed[index] = False
        self._l1 = 0

    def _follow(self) -> None:
        """One LRU halved its sampling rate: the others and the sketch follow."""
        halvings = self.halvings = self._sketch.sample_bits = max(shadow.halvings for shadow in self.shadows)
        for shadow in self.shadows:
            shadow.follow(halvings)
