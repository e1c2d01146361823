"""When the ``adaptive`` order (:mod:`~mpcache.eviction.order`) splits its one list into ARC's two, and when it joins
them again: the evidence of the two tests that decide, apart from the lists they move.

The order starts in a recency phase: T1 and T2 are one list, least recently used first, and every store is admitted
as under LRU, while the ghosts (kept by tier) measure whether an object seen again returns more often than one seen
once evicted at the same age.  Once B2's ghost hits exceed what B2's share of the ghosts at each hit would give by
:data:`SPLIT_SIGMAS` standard deviations it splits into ARC's lists, with the target ARC's ghost hits moved
meanwhile (ARC's target starts at 0 and climbs one object per B1 ghost hit: where recency is all there is, it stayed
below LRU for thousands of requests; where it is not, the excess shows within tens of ghost hits).  The split is
undone where it does not pay: an LRU of L1's capacity, started at the split from the one list and run on a sample of
the keys asked for (:mod:`~mpcache.eviction.shadow`), says which the recency phase's order would have found, and
once L1, past :data:`JOIN_SETTLING` of its capacity in bytes missed, trails it by :data:`JOIN_SIGMAS` standard
deviations since the split, or trails it and has fallen by more than :data:`JOIN_FALL_SIGMAS` standard deviations of
the steps since its lead was highest (a lead built while ARC served better does not hide for long that it no longer
does), an access counted as one piece of evidence (:meth:`PhaseTests.join_due`), T1 and T2 are one list again, in
their objects' last uses, until the recency phase's test, asking for twice its standard deviations per join, splits
it again.  After a join that test counts at most :data:`RESPLIT_HITS_PER_ACCESS` of an access's ghost hits: a
request whose long context was evicted comes back with hundreds of them at once, which tell one thing, and would
pass any bar counted one by one.
"""

from __future__ import annotations

SPLIT_SIGMAS = 3.0  # how far B2's ghost hits must exceed their share (in standard deviations) to end the recency phase
RESPLIT_HITS_PER_ACCESS = 16  # after a join, the split test counts at most this many of an access's ghost hits
JOIN_SIGMAS = 2.0  # how far L1's finds must trail an LRU's since the split (in standard deviations) to end ARC's phase
JOIN_FALL_SIGMAS = 2.5  # or, trailing, how far from their highest lead (more: it is tested afresh from each highest)
JOIN_SETTLING = 0.5  # L1's capacities of bytes missed after the split before L1's finds are compared with an LRU's


class PhaseTests:
    """The evidence of an order of L1's ``capacity_bytes``: in the recency phase, B2's ghost hits against their
    share (:meth:`split_due`); in ARC's phase, L1's finds against its shadow LRU's (:meth:`join_due`).  The order
    calls :meth:`split` and :meth:`join` as its phase changes; ``joins``: ARC phases ended so far."""

    def __init__(self, capacity_bytes: float) -> None:
        self._capacity = capacity_bytes
        # the recency phase's B2 ghost hits, and the sum and variance of what they would be were an object seen
        # again no likelier to return than one seen once
        self._b2_hits = 0
        self._expected = self._variance = 0.0
        self._hit_access, self._access_hits = -1, 0  # after a join: the access of the last ghost hit, its hits so far
        # ARC's phase: the bytes left to miss before L1's lead counts, that lead and the sum of the squares of the
        # accesses' steps, the highest lead and that sum since it, the current access's step so far; the access
        # whose lookup the shadow LRU missed a key of (it finds a prefix)
        self._settling = 0.0
        self._lead = self._squares = self._peak_lead = self._fall_squares = self._step = 0
        self._step_access = -1
        self._shadow_missed_at = -1
        self.joins = 0

    def split_due(self, tier: int, b1: int, b2: int, access: int) -> bool:
        """A ghost hit in the recency phase, in B2 (``tier`` 1: an object seen again, evicted at the age an object
        seen once is) or B1, whose ghost lists now hold ``b1`` and ``b2`` ghosts, by ``access``: whether the phase
        ends.  Were an object seen again no likelier to return, the hit would fall in B2 with the chance of B2's
        share of the ghosts just before it (by count: a ghost hit is one object, whatever its bytes); the phase ends
        once B2's hits exceed the sum of those chances by :data:`SPLIT_SIGMAS` (doubled per join) standard
        deviations of that sum (at least one): then ARC's two lists have something to use.  After a join an
        access's hits past :data:`RESPLIT_HITS_PER_ACCESS` count for nothing."""
        if self.joins:
            if access != self._hit_access:
                self._hit_access, self._access_hits = access, 0
            self._access_hits += 1
            if self._access_hits > RESPLIT_HITS_PER_ACCESS:
                return False
        b1, b2 = b1 + 1 - tier, b2 + tier  # the hit's ghost was taken out just before
        share = b2 / (b1 + b2)
        self._b2_hits += tier
        self._expected += share
        self._variance += share * (1.0 - share)
        sigmas = SPLIT_SIGMAS * 2 ** self.joins
        return self._b2_hits - self._expected > sigmas * max(self._variance, 1.0) ** 0.5

    def join_due(self, halvings: int, nbytes: float, found: bool, lru_found: bool, access: int) -> bool:
        """In ARC's phase, a sampled key of ``nbytes`` asked for by ``access``, which L1 ``found`` and an LRU of
        its capacity (the shadow LRU, whose sample has been halved ``halvings`` times), releasing a request's chunks
        tail first as the recency phase does, holds (``lru_found``; nothing after its first miss in the access: it
        finds a prefix too): whether the phase ends.
        Once L1 has missed :data:`JOIN_SETTLING` of its capacity in bytes since the split (the shadow LRU started
        then from the one list), each access's keys that one found and the other did not add up to its step (+1
        each where L1 found it); the phase ends once L1's lead, the steps' sum, is below -:data:`JOIN_SIGMAS`
        times the root of their squares' sum (a request's chunks are kept or lost together, so the access, not the
        key, is the unit of evidence), or below 0 having fallen from its highest (0 at first) by more than
        :data:`JOIN_FALL_SIGMAS` times the root of the squares' sum of the steps since (a lead ARC built while it
        served better hides no longer than it takes to lose it; it asks for more, and for a lead below 0, as it is
        tested afresh from every new highest)."""
        if self._shadow_missed_at == access:
            lru_found = False
        elif not lru_found:
            self._shadow_missed_at = access
        if self._settling > 0:
            if not found:
                self._settling -= nbytes * (1 << halvings)  # the bytes the sampled key stands for
            return False
        if self._step_access != access:  # a new access: the one before's net lead is one observation
            step, self._step_access, self._step = self._step, access, 0
            if step:
                lead = self._lead = self._lead + step
                self._squares += step * step
                if lead >= self._peak_lead:
                    self._peak_lead, self._fall_squares = lead, 0
                else:
                    self._fall_squares += step * step
                if lead < 0 and (lead < -JOIN_SIGMAS * self._squares ** 0.5
                                 or lead - self._peak_lead < -JOIN_FALL_SIGMAS * self._fall_squares ** 0.5):
                    return True
        if found != lru_found:
            self._step += 1 if found else -1
        return False

    def split(self) -> None:
        """ARC's phase begins: L1's lead over the shadow LRU starts from nothing and counts once L1 has missed
        :data:`JOIN_SETTLING` of its capacity in bytes (what an LRU chose gives way to ARC's choice first; what ARC
        keeps instead is asked for later)."""
        self._settling = JOIN_SETTLING * self._capacity
        self._lead = self._squares = self._peak_lead = self._fall_squares = self._step = 0

    def join(self) -> None:
        """The recency phase begins again: its test starts over, asking for twice the standard deviations it asked
        for before (the split was wrong here)."""
        self.joins += 1
        self._b2_hits = 0
        self._expected = self._variance = 0.0
        self._hit_access, self._access_hits = -1, 0
