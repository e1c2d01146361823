"""Fair shares of L1 among the groups that use it (a model and tenant: a chunk key's model and cache salt): the
``adaptive`` order spares an object of an active group that holds no more than its reserve, :data:`RESERVED_SHARE`
of an equal share (L1's capacity over the groups active lately), while another group's object can go instead: a
group that floods L1 with stores cannot push another below its reserve, and what is not reserved goes where the
order finds it most useful (a reservation beside a shared pool, as in Memshare: a whole equal share for each group
costs the whole L1 hits where one group's objects are worth more than another's).

A group is active while it asked for something (a lookup that found an object, a store) in this epoch or the one
before; an epoch is as many accesses (lookups) as L1 held evictable objects when it began, at least
:data:`MIN_EPOCH_ACCESSES`: a group stays active while it asks at least once per pass over L1's objects.  Until a
second group asks for something nothing is counted (``groups`` is None): one group has L1 to itself.  State: a
resident-bytes count and the epoch last active per group, at most :data:`MAX_GROUPS` groups (one more is not
tracked: neither spared nor counted), and the groups active in the two epochs; those with no resident object
leave once inactive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

RESERVED_SHARE = 0.5  # of an equal share, what a group keeps whatever the others store (at most half of L1 in all)
MAX_GROUPS = 4096  # groups tracked at most: a client that invents tenants cannot grow the order's state past it
MIN_EPOCH_ACCESSES = 16  # an epoch's accesses at the least (an L1 of a handful of objects still needs a window)
SPARED_PER_EVICTION = 16  # a list's spared objects passed over at most to find one to evict


class FairShares:
    """Each group's resident bytes and whether it is active; :meth:`spares` says whether an object is spared."""

    def __init__(self, capacity_bytes: float, group_of: Callable[[Any], Hashable]) -> None:
        self.capacity = float(capacity_bytes)
        self._group_of = group_of
        self._first: Hashable = None  # the only group seen while ``groups`` is None
        self.groups: dict[Hashable, list[float]] | None = None  # group → [resident bytes, epoch last active]
        self._epoch = 0
        self._epoch_ends = 0  # the access that ends the epoch
        self._now: set[Hashable] = set()  # groups active in this epoch
        self._before: set[Hashable] = set()  # in the epoch before
        self._carried = 0  # groups active in the epoch before and not yet in this one

    def touched(self, key: Any, access: int, order: Any) -> None:
        """``key``'s group asked for something in ``access``.  The first time a second group does, counting
        starts: the first group holds all ``order`` holds (its ``sizes``); an epoch is as many accesses as
        ``order`` has evictable objects (its length) when the epoch begins."""
        group = self._group_of(key)
        groups = self.groups
        if groups is None:
            if self._first is None or group == self._first:
                self._first = group
                return
            groups = self.groups = {self._first: [float(sum(order.sizes)), 0.0]}
            self._now.add(self._first)
            self._epoch_ends = access + max(MIN_EPOCH_ACCESSES, len(order))
        if access >= self._epoch_ends:
            self._next_epoch(access, len(order))
        state = groups.get(group)
        if state is None:
            if len(groups) >= MAX_GROUPS:
                return
            state = groups[group] = [0.0, self._epoch]
        state[1] = self._epoch
        if group not in self._now:
            self._now.add(group)
            if group in self._before:
                self._carried -= 1

    def _next_epoch(self, access: int, objects: int) -> None:
        """The epoch ends: groups active only in the one before are not any more, and leave if they hold nothing."""
        groups = self.groups
        assert groups is not None
        for group in self._before - self._now:
            if groups.get(group, (1.0,))[0] <= 0:
                del groups[group]
        self._before, self._now = self._now, set()
        self._carried = len(self._before)
        self._epoch += 1
        self._epoch_ends = access + max(MIN_EPOCH_ACCESSES, objects)

    def placed(self, key: Any, nbytes: float) -> None:
        """An object of ``key``'s group became resident (counting has started)."""
        state = self.groups.get(self._group_of(key)) if self.groups is not None else None
        if state is not None:
            state[0] += nbytes

    def gone(self, key: Any, nbytes: float) -> None:
        """An object of ``key``'s group left L1 (counting has started)."""
        state = self.groups.get(self._group_of(key)) if self.groups is not None else None
        if state is not None:
            state[0] -= nbytes

    @property
    def sharing(self) -> bool:
        """Whether two groups or more are active: only then is anything spared."""
        return self.groups is not None and len(self._now) + self._carried > 1

    def spares(self, key: Any) -> bool:
        """Whether ``key``'s object is spared: its group is active and holds no more than its reserve."""
        groups = self.groups
        state = groups.get(self._group_of(key)) if groups is not None else None
        if state is None or state[1] < self._epoch - 1:
            return False
        return state[0] <= RESERVED_SHARE * self.capacity / (len(self._now) + self._carried)

    def pass_over(self, lists: Iterable[OrderedDict[Any, Any]]) -> None:
        """Move the spared objects at the head of each of the order's ``lists`` to its end, at most
        :data:`SPARED_PER_EVICTION` a list: what the order evicts next is the first object of a group over its
        reserve (or not active) in the order's turn, where one is that near."""
        for objects in lists:
            for _ in range(min(SPARED_PER_EVICTION, len(objects))):
                key = next(iter(objects))
                if not self.spares(key):
                    break
                objects.move_to_end(key)
