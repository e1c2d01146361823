"""Fair shares of L1 among the groups that use it (a model and tenant: a chunk key's first two fields, its model and
cache salt, :class:`~mpcache.contract.keys.ChunkKey`): the ``adaptive`` order spares an object of an active group
that holds no more than its reserve, :data:`RESERVED_SHARE` of an equal share (L1's capacity over the groups active
lately), while another group's object can go instead: a group that floods L1 with stores cannot push another
below its reserve, and what is not reserved goes where the order finds it most useful (a reservation beside a
shared pool, as in Memshare: a larger reserve costs the whole L1 hits where one group's objects are worth more
than another's, see benchmarks/HISTORY.md).

A group is active while it asked for something (a lookup that found an object, a store, a landing) in this epoch or the
one before; an epoch ends after as many such touches, of any group, as L1 holds evictable objects (at least
:data:`MIN_EPOCH_TOUCHES`).  Until a second group asks for something nothing is counted (``counting`` is False): one
group has L1 to itself.  Tenants are what clients say they are: one client that spreads its requests over many cache
salts makes many groups, and every reserve smaller.  State: a resident-bytes count, the epoch last active and whether it
left per group, at most :data:`MAX_GROUPS` groups (one more is not tracked: neither spared nor counted; its objects are
not counted, so its count errs low by them once it is tracked, and never goes below 0), and the groups active in the two
epochs; a group leaves once its count is 0 and it is not active.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

RESERVED_SHARE = 0.25  # of an equal share, what a group keeps whatever the others store (a quarter of L1 in all)
MAX_GROUPS = 4096  # groups tracked at most: a client that invents tenants cannot grow the order's state past it
MIN_EPOCH_TOUCHES = 16  # an epoch's touches at the least (an L1 of a handful of objects still needs a window)
SPARED_PER_EVICTION = 64  # objects looked at, at most, from a list's head for one not spared: a bound on the cost


class FairShares:
    """Each group's resident bytes and whether it is active; :meth:`spares` says whether an object is spared."""

    def __init__(self, capacity_bytes: float) -> None:
        self.capacity = float(capacity_bytes)
        self.first: Hashable = None  # the only group seen before counting (the order checks a key against it)
        self.counting = False  # whether a second group asked for something: only then is anything counted
        # group → [resident bytes, epoch last active, left], once counting; ``left`` is set as the group leaves the
        # table, so an object that holds its group's list (L1's ``Entry.group``) knows to look its group up again
        self.groups: dict[Hashable, list[Any]] = {}
        self.last: list[Any] | None = None  # the group :meth:`touched` last: its entry in ``groups`` (None: not kept)
        self._epoch = 0
        self.active_epoch = -1  # the oldest epoch a group asked in to be active: the one before this
        self._touches = 0  # touches since the epoch began
        self._now: set[Hashable] = set()  # groups active in this epoch
        self._before: set[Hashable] = set()  # in the epoch before
        self._carried = 0  # groups active in the epoch before and not yet in this one
        self.sharing = False  # whether two groups or more are active: only then is anything spared (``_recount``)
        self.reserve = 0.0  # the bytes an active group keeps: a share of L1 over the groups active (``_recount``)

    def touched(self, key: Any, order: Any) -> FairShares | None:
        """``key``'s group asked for something (a lookup, a store, a landing).  The first time a second group does,
        counting starts: the first group holds all ``order`` holds (its ``sizes``).  An epoch ends after as many
        touches as ``order`` has evictable objects (its length, now).  Returns these shares once counting (the
        order's ``fair``), else None."""
        group = key[:2]
        groups = self.groups
        if not self.counting:
            if self.first is None or group == self.first:
                self.first = group
                return None
            self.counting = True
            groups[self.first] = [float(sum(order.sizes)), 0.0, False]
            self._now.add(self.first)
        touches = self._touches = self._touches + 1
        if touches >= MIN_EPOCH_TOUCHES and touches >= order.evictable():  # (no max(): a builtin's call costs more)
            self._next_epoch()
        state = self.last = groups.get(group)
        if state is None:
            if len(groups) >= MAX_GROUPS:
                return self
            state = self.last = groups[group] = [0.0, -1, False]  # active in no epoch yet
        epoch = self._epoch
        if state[1] != epoch:  # its first touch this epoch (a tracked group is in ``_now`` while its epoch is this one)
            state[1] = epoch
            self._now.add(group)
            if group in self._before:
                self._carried -= 1
            self._recount()
        return self

    def _next_epoch(self) -> None:
        """The epoch ends: groups active only in the one before are not any more, and leave if they hold nothing."""
        groups = self.groups
        for group in self._before - self._now:
            if groups[group][0] <= 0:  # every group active lately is tracked (gone() keeps them)
                self._leave(group)
        self._before, self._now = self._now, set()
        self._carried = len(self._before)
        self._epoch += 1
        self.active_epoch = self._epoch - 1
        self._touches = 0
        self._recount()

    def _recount(self) -> None:
        """The groups active changed: whether they share L1, and each one's reserve (:data:`RESERVED_SHARE` of L1
        over them; kept, not computed for each object, as eviction reads it for every object it looks at)."""
        active = len(self._now) + self._carried
        self.sharing = active > 1
        self.reserve = RESERVED_SHARE * self.capacity / active if active else 0.0

    def placed(self, key: Any, nbytes: float) -> None:
        """An object of ``key``'s group became resident (counting has started)."""
        state = self.groups.get(key[:2])
        if state is not None:
            state[0] += nbytes

    def gone(self, key: Any, nbytes: float) -> None:
        """An object of ``key``'s group left L1 (counting has started).  A group that holds nothing and is not
        active leaves; one placed while it was not tracked (:data:`MAX_GROUPS` reached) counts from 0, never below."""
        groups, group = self.groups, key[:2]
        state = groups.get(group)
        if state is not None:
            left = state[0] - nbytes
            state[0] = left if left > 0.0 else 0.0
            if not state[0] and group not in self._now and group not in self._before:
                self._leave(group)

    def _leave(self, group: Hashable) -> None:
        """``group`` leaves the table, its count marked so (an object holding it looks the group up again)."""
        self.groups.pop(group)[2] = True

    def spares(self, key: Any) -> bool:
        """Whether ``key``'s object is spared: its group is active and holds no more than its reserve."""
        state = self.groups.get(key[:2])
        return state is not None and state[1] >= self.active_epoch and state[0] <= self.reserve

    def pass_over(self, objects: OrderedDict[Any, Any]) -> bool:
        """Whether one of the first :data:`SPARED_PER_EVICTION` objects of one of the order's lists is not spared;
        if so the spared ones before it move to the list's end, and it is the head (the first object of a group
        over its reserve, or not active, in the order's turn).  If not, nothing moves: the reserve gives way, in
        the list's own order (a prompt's tail first).  Called while :attr:`sharing` only."""
        groups, active, reserve = self.groups, self.active_epoch, self.reserve
        model = salt = None  # the group of the objects just looked at, all spared (a run of one group's is common)
        spared = []
        for key in objects:  # (:meth:`spares` inline: a call per object costs more than the test)
            if key[1] != salt or key[0] != model:
                state = groups.get(key[:2])
                if state is None or state[1] < active or state[0] > reserve:
                    break
                model, salt = key[0], key[1]
            spared.append(key)
            if len(spared) == SPARED_PER_EVICTION:
                return False
        else:
            return False
        for key in spared:
            objects.move_to_end(key)
        return True

    def pick(self, preferred: OrderedDict[Any, Any], other: OrderedDict[Any, Any],
             usable: Callable[[Any], bool]) -> OrderedDict[Any, Any]:
        """The list to evict from: the order's ``preferred`` (passed over), unless all it has near its head is
        spared and ``other`` (passed over) has an object that is not and that the order may evict (``usable``, its
        entry): a group's reserve in one list is not given up while another group's object over its reserve waits
        in the other."""
        if self.pass_over(preferred) or not other or not self.pass_over(other) or not usable(
                next(iter(other.values()))):
            return preferred
        return other
