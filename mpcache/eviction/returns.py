"""Whether large stores come back, the ``adaptive`` order's measure for refusing them on first sight.  A store whose new
bytes exceed :data:`LARGE_STORE_SHARE` of L1's capacity evicts that much of what L1 holds; where such stores are
one-off prompts (a pasted document) that is a loss every time, where they are a conversation's long first turn it is
not.  Which, is measured, not assumed: from the first large store on (before it there is nothing to refuse, and a
workload of smaller stores pays nothing), each store's first new key is watched until it is asked for again (the
store returned) or until, the oldest watched, the watched stores' new bytes exceed L1's capacity (it did not: about
when an LRU admitting them all would have evicted it; a store that returned leaves the window, so one watched with
many that return is watched longer), and the returns are counted for large and smaller stores apart, halved every
:data:`RETURNS_WINDOW` settled stores (the recent ones count most: a size that makes up less than :data:`RETURNS_MIN`
of a window's stores is never compared).  Large stores are refused on first sight only while they return less often
than smaller ones, by :data:`RETURNS_SIGMAS` standard deviations of the difference, on :data:`RETURNS_MIN` settled
stores of each at least (a large store refused that would have returned costs its whole return); a refused store's
return is its second sight, which admits it, and is counted all the same.  The state is bounded: watched keys as many
as L1's capacity in stores' new bytes, and four counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

LARGE_STORE_SHARE = 0.1  # a store whose new bytes exceed this share of L1's capacity is large
RETURNS_WINDOW = 512  # settled stores between two halvings of the counts
RETURNS_MIN = 16  # settled stores of each size before their returns are compared
RETURNS_SIGMAS = 2.0  # how far below smaller stores' share large stores' returns must be for them to be refused


class StoreReturns:
    """Watched stores (``watched``: first new key → new bytes; oldest first) and, for smaller and large stores,
    the settled ones (``settled``) and those that returned (``returned``)."""

    def __init__(self, capacity_bytes: float) -> None:
        self.capacity = capacity_bytes
        self.large_bytes = LARGE_STORE_SHARE * capacity_bytes
        self.watched: OrderedDict[Hashable, float] = OrderedDict()
        self.watch_above = self.large_bytes  # the new bytes a store watched has more of: 0 from the first large one
        self._watched_bytes = 0.0
        self.settled = [0.0, 0.0]
        self.returned = [0.0, 0.0]

    def stored(self, first_new: Hashable, new_bytes: float) -> None:
        """A store reserves ``new_bytes`` of objects L1 does not hold, ``first_new`` the first: watched from the first
        large store on, and the oldest watched stores settled as not returned while the watched hold more than L1's
        capacity (a store larger than L1 at once)."""
        if new_bytes <= self.watch_above:
            return  # before the first large store, nothing to refuse; a store of no new bytes evicts nothing
        self.watch_above = 0.0
        watched = self.watched
        if first_new in watched:
            return  # watched already (a retried store)
        watched[first_new] = new_bytes
        held = self._watched_bytes + new_bytes
        while held > self.capacity and watched:  # (``popitem(False)``: last=False by position, no keyword parse)
            nbytes = watched.popitem(False)[1]
            held -= nbytes
            self._settle(nbytes, 0)
        self._watched_bytes = held if watched else 0.0  # a miniature's float bytes leave a residue

    def asked(self, key: Hashable) -> None:
        """A watched store's first new key was asked for again: it returned."""
        watched = self.watched
        nbytes = watched.pop(key)
        self._watched_bytes = self._watched_bytes - nbytes if watched else 0.0
        self._settle(nbytes, 1)

    def _settle(self, nbytes: float, returned: int) -> None:
        """A store of ``nbytes`` new bytes settled: ``returned`` (1) or not (0)."""
        large = nbytes > self.large_bytes
        settled = self.settled
        settled[large] += 1
        self.returned[large] += returned
        if settled[0] + settled[1] > RETURNS_WINDOW:
            for counts in (settled, self.returned):
                counts[0] /= 2
                counts[1] /= 2

    def large_return_less(self) -> bool:
        """Whether large stores returned less often than smaller ones, on enough of each, by more than
        :data:`RETURNS_SIGMAS` standard deviations of the difference of the two shares."""
        (small, large), (small_returned, large_returned) = self.settled, self.returned
        if small < RETURNS_MIN or large < RETURNS_MIN:
            return False
        small_share, large_share = small_returned / small, large_returned / large
        variance = small_share * (1 - small_share) / small + large_share * (1 - large_share) / large
        return small_share - large_share > RETURNS_SIGMAS * variance ** 0.5
