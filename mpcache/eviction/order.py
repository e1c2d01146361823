"""The order in which L1 evicts (``--l1-policy``): which ready, unlocked object goes first when a store needs room.

* ``lru``: least recently used first, a request's chunks released head to tail (one pass over the reuse
  distances gives its miss-ratio curve at every size; :mod:`~mpcache.eviction.lru_order`).
* ``arc``: Megiddo and Modha's adaptive replacement cache, which LMCache ships: objects seen once (T1) and seen
  again (T2) in two LRU lists; a miss on the ghost of what T1 evicted (B1) grows T1's target share, one on
  what T2 evicted (B2) shrinks it; a request's chunks released head to tail.
  An access is what stores reserve between two lookups (an engine step's stores, one per TP rank): as ARC never
  evicts the page it admits, T1 gives up none of the current access's objects, nor of the current named store's
  however many lookups came between its parts (see ``admitting``), while T2 has one to give (else a request's
  second rank's store would evict what its first rank's store just wrote).
* ``adaptive`` (the default): ARC made prefix-aware.  A request's chunks are released tail to head, so within each list
  a prefix loses its tail before its head; and an object whose parent (the chunk before it in the store that wrote it)
  is evicted is an orphan, worth nothing until its parent is back, so orphans go before anything else.  It admits on
  second sight where room costs an object seen again: a store none of whose chunks was evicted (a ghost) or refused
  before is refused when T1 has nothing to give and only T2 could make room, while T2 is in use: after a refusal, the
  next waits until a lookup finds an object in T2 again (else objects seen twice and never again would keep out every
  new one).  Such a store is judged whole: one that needs more room than T1 and the orphans hold is refused before any
  of it is placed (placed in part, its head would evict T1's objects and its tail be refused all the same).  The parts
  of one named store (a request's TP ranks, a hybrid model's KV cache groups) take one verdict
  (:mod:`~mpcache.eviction.verdicts`): a later part is refused even once T2 is no longer in use, and admitted even if it
  is again.  A refusal is counted as L1's allocation failure, the client told as for a full L1; its keys are remembered
  (the newest, as many bytes as T2 holds), so the same store a second time is admitted, unless the frequency gate
  refuses it (or a store of a ghost's key, admitted alike): none of its new keys asked for more often lately
  (:mod:`~mpcache.eviction.frequency`) than T2's least recently used object, and the gate's earlier such decisions
  proved right (what they would have evicted was asked for again before the store was: :mod:`~mpcache.eviction.gate`).
  The gate judges a first-sight store too, wherever it needs more room than the orphans give (against T1's least
  recently used while T1 holds more than its target), where ``first_sight`` (no L2 tier, which a refused store would not
  reach either).  It starts in a recency phase: T1 and T2 are one list, least recently used first, and every store is
  admitted as under LRU (but as below); it splits into ARC's lists once objects seen again prove likelier to return
  than objects seen once, and joins them again where an LRU of L1's capacity would find more
  (:mod:`~mpcache.eviction.phases`).  In either phase, where an LRU admitting first-sight stores by chance finds more
  than L1 and than one admitting every store, L1 admits so (a refusal counted as above, its keys remembered as many
  bytes as L1's capacity), and the other way round; where an LRU under an age floor finds more than L1 and than both,
  L1 refuses a store whose room would evict an object used within the floor (counted and remembered alike), in the
  recency phase, which it enters if it is not in it and does not leave while it admits so (the floor keeps what LRU's
  order would evict; :mod:`~mpcache.eviction.admission`); and, where ``first_sight``, a
  store that needs more than :data:`~mpcache.eviction.returns.LARGE_STORE_SHARE` of L1's capacity is refused on first
  sight (counted and remembered alike) while stores that large return less often than smaller ones
  (:mod:`~mpcache.eviction.returns`).  It adapts by ghost hits and those comparisons alone: nothing to tune per
  workload.  Each model and tenant keeps a reserve of L1 from the others' stores (:mod:`~mpcache.eviction.fairness`).

Sizes are bytes (objects of different models differ): T1's, T2's and the orphans' sizes (every resident object of each,
locked or not), T1's target and the ghosts' budget (``arc``: T1 and B1 within L1's capacity and all four lists within
twice it, B2 given up first, as ARC does; ``adaptive``: both ghost lists within L1's capacity, the larger trimmed first;
the lists: :mod:`~mpcache.eviction.ghosts`).  The state is bounded: the ghosts by that budget, the rest a list slot, a
tier, two accesses (its store's and its last use's), a store's name, a parent and its children, and a reference to its
group's fair-share count per resident object, the shadow LRU's at most :data:`~mpcache.eviction.shadow.SHADOW_KEYS`
keys, the admission trial's three LRUs (as many each, with their last uses, and the keys the chance LRU's refusals
remember within L1's capacity in sampled bytes), the newest :data:`PARENT_HINTS` lookups' hints, named stores' verdicts
(:mod:`~mpcache.eviction.verdicts`), the frequency sketch (two rows of byte counters,
:data:`~mpcache.eviction.frequency.COUNTERS_PER_COUNT` per count of its window, which is :data:`FREQUENCY_WINDOW` counts
per evictable object, the most it has been set to at a halving), the gate's decisions (:mod:`~mpcache.eviction.gate`),
the stores watched for their return (:mod:`~mpcache.eviction.returns`), and the fair shares' counts (at most
:data:`~mpcache.eviction.fairness.MAX_GROUPS` groups).

:class:`~mpcache.cache.l1.L1Manager` keeps an evictable object in ``lists[entry.tier]`` itself (the hot path
costs what one ordered dict costs) and calls ``promote`` when it takes one out whose tier is not ``again``
(ARC: seen again), ``admitting`` around a store's reservations and ``refuses`` before the first, ``new`` (unless
None: LRU) when it reserves space, ``victim`` to evict one and ``forget`` when a reservation is given back; and, for
a prefix-aware order, ``asked`` for the objects a lookup finds and the new ones a store reserves.
"""

from __future__ import annotations

import heapq
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, cast

from mpcache.config.derived import L1_POLICIES as POLICIES
from mpcache.eviction.admission import TRIAL_HALVINGS, AdmissionTrial
from mpcache.eviction.fairness import FairShares
from mpcache.eviction.frequency import ENDED, SAMPLED, FrequencySketch
from mpcache.eviction.gate import FrequencyGate, would_evict
from mpcache.eviction.ghosts import GhostLists
from mpcache.eviction.links import add_child, drop_child
from mpcache.eviction.lru_order import LruOrder
from mpcache.eviction.phases import PhaseTests
from mpcache.eviction.refusal import RefusedKeys, draw
from mpcache.eviction.returns import StoreReturns
from mpcache.eviction.shadow import ShadowLru, quiet_for
from mpcache.eviction.verdicts import StoreVerdicts

PARENT_HINTS = 4096  # lookups whose next chunk a store may reserve; a store follows its lookup within moments
_UNBOUNDED = float("inf")  # ``arc``'s ghosts are bounded as ARC bounds them, after they are added
FREQUENCY_WINDOW = 30  # counts between two halvings of the frequency sketch, per resident object (at least 16)


class ArcOrder:
    """ARC over bytes; with ``prefix_aware``, orphans first and tails before heads (the ``adaptive`` policy).
    Tiers: 0 T1 (seen once), 1 T2 (seen again), 2 orphans (neither, evicted first)."""

    again = 1

    def __init__(self, capacity_bytes: int, entry_of: Callable[[Any], Any], prefix_aware: bool = False,
                 code: Callable[[Any], int] | int = hash, fair: bool = False, trial: int | None = TRIAL_HALVINGS,
                 first_sight: bool = True) -> None:
        self.capacity = capacity_bytes
        self._ghost_budget = float(capacity_bytes)  # the adaptive order's ghosts' bytes at most (a float: read as is)
        self.first_sight = prefix_aware and first_sight  # whether a first-sight store may be refused by frequency
        self.prefix_aware = self.tail_first = prefix_aware
        self._entry_of = entry_of
        # T1, T2, orphans; in the recency phase T1 and T2 are one list (``recency``)
        self.lists: list[OrderedDict[Any, Any]] = [OrderedDict(), OrderedDict(), OrderedDict()]
        if prefix_aware:
            self.lists[1] = self.lists[0]
        # whether T1 and T2 are one list, least recently used first (the recency phase): kept by split and join, not
        # derived from the lists, as every store reads it
        self.recency = prefix_aware
        self.phases = PhaseTests(capacity_bytes)  # the evidence that splits the one list and joins ARC's lists again
        self._ghosts = GhostLists()  # B1 and B2: the keys of T1's and T2's victims, with their bytes
        # bytes of T1's, T2's and the orphans' resident objects (floats: whole numbers of bytes, exact below 2 ** 53,
        # which L1's gigabytes need no bignum arithmetic to add, nor a conversion to compare with the floats they meet)
        self.sizes = [0.0, 0.0, 0.0]
        self.target = 0.0  # T1's share, bytes
        self._storing: Sequence[Any] | None = None  # the keys the store being reserved names (``admitting``)
        self._admitted: bool | None = None  # whether the store may evict from T2 (None: not looked yet)
        self.reused = False  # whether a lookup found an object seen again (T2) since the last refusal
        self._storing_bytes: Sequence[float] | float = 0  # each key's bytes (one number: every key's)
        self._need = 0.0  # the bytes the store being reserved still needs beyond L1's free bytes (``refuses``)
        self._store: Any = None  # the name of the store being reserved (``admitting``), None: unnamed
        self._placed = False  # whether the named store being reserved has placed an object
        self.named = StoreVerdicts()  # named stores' verdicts, which their later parts take
        self._refused = RefusedKeys()
        self.returns = StoreReturns(capacity_bytes)  # how often large stores and smaller ones are asked for again
        self._large_need = self.returns.large_bytes if self.first_sight else float("inf")  # a large store's need
        self._refused_large = False  # whether a large store was refused: later parts take its verdict in any phase
        self.hints: OrderedDict[Any, Any] = OrderedDict()  # the chunk after a lookup's prefix → its parent
        self.access = 0  # lookups so far: what is reserved between two lookups is one access
        # how often each key was asked for lately (by a tuple key's item where ``code`` is its index: no call)
        code_of: Callable[[Any], int]
        if isinstance(code, int):
            self.frequency = FrequencySketch(FREQUENCY_WINDOW * 16, item=code)
            code_of = cast(Callable[[Any], int], operator.itemgetter(code))  # (a tuple's item: typed by its use)
        else:
            self.frequency = FrequencySketch(FREQUENCY_WINDOW * 16, code)
            code_of = code
        self.gate = FrequencyGate()  # its decisions to refuse a store asked for less often than what it evicts
        self._code = code_of
        self._shadow: ShadowLru | None = None  # in ARC's phase, an LRU of L1's capacity on sampled keys asked for
        self._trial = (AdmissionTrial(capacity_bytes, code_of, self.frequency, trial)
                       if self.first_sight and trial is not None else None)
        # the chance a first-sight store is admitted while it needs room, and the age floor in accesses (0: none;
        # :mod:`~mpcache.eviction.admission`): the trial's, copied as it sees a key (they change nowhere else), as
        # L1's gauges read the chance after every operation
        self.chance = 1.0
        self.floor = 0.0
        # groups' reserves (prefix-aware, ``fair``), ``fair`` once two groups count; the access that touched one last
        self._shares = FairShares(capacity_bytes) if prefix_aware and fair else None
        self.fair: FairShares | None = None
        self._fair_access = -1
        self._placing: list[Any] | None = None  # while a store reserves, its group's count in ``fair`` (or None)

    def evictable(self) -> int:
        """How many objects the lists hold (a method, as the fair shares ask at every touch: ``len()`` of an object
        whose ``__len__`` is Python costs more than the call)."""
        t1, t2, orphans = self.lists
        return len(t1) + len(orphans) + (0 if t2 is t1 else len(t2))

    __len__ = evictable

    def new(self, key: Any, entry: Any, parent: Any) -> None:
        """Space reserved for ``key`` (stored right after the resident ``parent`` entry, which L1 names only to a
        prefix-aware order; None: not known): it joins T1, or T2 after a ghost hit, which moves T1's target by
        the object's bytes times the other ghost list's weight over this one's (at least once).  With a parent,
        it is an orphan once its parent is evicted."""
        if parent is not None:  # (inline :func:`~mpcache.eviction.links.add_child`: a call costs more than the test)
            entry.parent = parent
            children = parent.children
            if children is None:
                parent.children = key  # an only child (a chain's every link): its key, no dict to allocate
            elif type(children) is dict:
                children[key] = None
            else:
                parent.children = {children: None, key: None}  # a dict, not a set: orphaned in the stores' order
        entry.access = entry.used = self.access
        store = self._store
        if store is not None:
            entry.store = store
            self._placed = True
        placing = self._placing
        if placing is not None:  # a store's object, of the group its store touched (FairShares.placed without a call)
            placing[0] += entry.size
            entry.group = placing  # its count, which eviction takes off again without looking the group up
        else:
            shares = self._shares
            if self._storing is None and shares is not None and (self.fair is not None or key[:2] != shares.first):
                self.fair = shares.touched(key, self)  # not a store (an L2 landing): touched here
            if self.fair is not None:
                self.fair.placed(key, entry.size)
        tier = self._ghosts.tier(key)
        if tier < 0:  # no ghost (most new keys)
            self.sizes[0] += entry.size  # a new entry's tier is 0: T1
            if not self.prefix_aware:
                self._trim_ghosts_as_arc()
            return
        self._ghost_hit(tier, key, entry.size)
        self._admitted = True
        entry.tier = 1
        self.sizes[1] += entry.size
        if not self.prefix_aware:
            self._trim_ghosts_as_arc()

    def _ghost_hit(self, tier: int, key: Any, size: int) -> None:
        ghosts = self._ghosts
        held = ghosts.nbytes(tier)
        step = size * max(ghosts.nbytes(1 - tier) / held, 1.0) if held else size  # 0: empty ghosts
        ghosts.remove(key)
        if self.recency and not self.floor and self.phases.split_due(tier, ghosts.count(0), ghosts.count(1),
                                                                     self.access):
            self.split()
        self.target = min(float(self.capacity), max(0.0, self.target + (step if tier == 0 else -step)))

    def split(self) -> None:
        """End the recency phase (ARC's order has none): the objects seen again leave T1's list for T2's, in their
        order.  The shadow LRU starts from the one list (less what the current access holds locked or is writing,
        and the orphans), for the join test (:meth:`~mpcache.eviction.phases.PhaseTests.join_due`)."""
        if not self.recency:
            return
        t1 = self.lists[0]
        self._shadow = ShadowLru(self.capacity, self._code)
        self._shadow.seed((key, entry.size) for key, entry in t1.items())
        t2 = OrderedDict((key, entry) for key, entry in t1.items() if entry.tier == 1)
        for key in t2:
            del t1[key]
        self.lists[1] = t2
        self.recency = False
        self.phases.split()

    def join(self) -> None:
        """End ARC's phase: T1 and T2 are one list again, least recently used first, and the recency phase's test
        starts over, asking for twice the standard deviations it asked for before (the split was wrong here)."""
        t1, t2 = self.lists[0], self.lists[1]
        if t2 is t1:
            return
        self.lists[0] = self.lists[1] = OrderedDict(heapq.merge(t1.items(), t2.items(), key=lambda kv: kv[1].used))
        self.recency = True
        self._shadow = None
        self.phases.join()

    def promote(self, entry: Any) -> None:
        """An object of T1 (or an orphan) was taken out of the order to be used: it is seen again, T2."""
        sizes = self.sizes
        sizes[entry.tier] -= entry.size
        sizes[1] += entry.size
        entry.tier = 1

    def victim(self) -> tuple[Any, Any] | None:
        """The next object to evict, out of the order (its ghost kept; the ghosts trimmed: ``arc``'s as ARC bounds
        them, the adaptive order's the larger list first until both fit L1's capacity); None when every object is
        locked or being written.  (``popitem(False)``: last=False by position, which skips a keyword parse.)"""
        t1, t2, orphans = self.lists
        fair = self.fair
        count: list[Any] | None = None  # the victim's group's count in ``fair``, where the sharing test read it
        if orphans:
            key, entry = orphans.popitem(False)
            self.sizes[2] -= entry.size
        else:  # (groups' reserves: ``fair`` passes over what it spares, in the list evicted from; orphans never)
            sizes, sharing = self.sizes, fair if fair is not None and fair.sharing else None
            if t2 is t1:  # the recency phase: one list, least recently used first, its ghost by its tier
                if not t1:
                    return None
                key, entry = t1.popitem(False)
                if sharing is not None:  # (FairShares.spares inline: most heads are not spared, a call costs more)
                    count = entry.group  # its group's count, unless the group left the table since (or never held it)
                    if count is None or count[2]:
                        count = sharing.groups.get(key[:2])
                    if count is not None and count[1] >= sharing.active_epoch and count[0] <= sharing.reserve:
                        t1[key] = entry  # spared: back at the head, and the list passed over
                        t1.move_to_end(key, False)
                        sharing.pass_over(t1)
                        key, entry = t1.popitem(False)
                        count = None  # the new head's, read below
                tier = entry.tier
            elif t1 and (not t2 or sizes[0] > self.target):
                if sharing is not None:
                    sharing.pass_over(t1)
                key, entry = t1.popitem(False)
                tier = 0
                if t2 and not self._evictable_now(entry):
                    t1[key] = entry  # being admitted (the current access's or store's): T2 gives one instead
                    t1.move_to_end(key, False)
                    if sharing is not None:
                        sharing.pass_over(t2)
                    key, entry = t2.popitem(False)
                    tier = 1
            elif t2 and (t1 or self._admits()):  # T1 has nothing to give: a store may be refused
                source = sharing.pick(t2, t1, self._evictable_now) if sharing is not None else t2
                key, entry = source.popitem(False)
                tier = 1 if source is t2 else 0
            else:
                return None
            size = entry.size
            sizes[tier] -= size
            if self.prefix_aware:  # both ghost lists within L1's capacity, the larger trimmed first
                self._ghosts.add(tier, key, size, self._ghost_budget)
            else:
                self._ghosts.add(tier, key, size, _UNBOUNDED)
                self._trim_ghosts_as_arc()
        parent = entry.parent  # only the prefix-aware order links entries
        if parent is not None:  # no longer its child (inline: a call per eviction costs more than the test)
            children = parent.children
            if type(children) is dict:
                children.pop(key, None)
            elif children == key:
                parent.children = None
        if entry.children:
            self._orphan_children(entry)
        if fair is not None:  # (FairShares.gone inline while its group keeps bytes: a call per object costs more)
            if count is None:  # (a count that left the table holds 0: gone() below looks the group up again)
                count = entry.group or fair.groups.get(key[:2])
            if count is not None and count[0] > entry.size:
                count[0] -= entry.size
            else:
                fair.gone(key, entry.size)
        if self._storing is not None:
            self._need -= entry.size  # what the store still needs, should it be judged now (``_admits``)
        return key, entry

    def _trim_ghosts_as_arc(self) -> None:
        """``arc``'s ghosts bounded as ARC bounds them, after each eviction and each object that joins (so a store of
        B2's oldest ghost is a ghost hit, as in ARC, where the eviction comes after the miss)."""
        sizes = self.sizes
        self._ghosts.trim_as_arc(sizes[0], sizes[0] + sizes[1], self.capacity)

    def _evictable_now(self, entry: Any) -> bool:
        """Whether T1 may give up ``entry``: not being admitted (the current access's or named store's)."""
        return entry.access != self.access and (self._store is None or entry.store != self._store)

    def admitting(self, keys: Sequence[Any] | None, nbytes: Sequence[float] | float = 0, store: Any = None,
                  new: Sequence[int] | None = None) -> None:
        """A store begins reserving ``keys`` of ``nbytes`` each (or those bytes, key by key), those at ``new`` not
        held (None: all), watched for its return (:mod:`~mpcache.eviction.returns`); None: it ended.  ``store``
        names it across the parts that make it up: the first part judged (:meth:`_admits`) or placing an object
        gives the name its verdict (:mod:`~mpcache.eviction.verdicts`); a part with nothing to place gives none."""
        if keys is None:  # the store ended: what it judged or placed gives its name a verdict
            named = self._store
            if named is not None and self.prefix_aware and self._storing and (self._admitted is not None
                                                                              or self._placed):
                self.named.record(named, self._storing, self._admitted is not False)
            # ``refusing`` says False again; the rest is read only while a store reserves
            self._storing = self._store = self._placing = self._admitted = None
            return
        self._storing, self._storing_bytes, self._store = keys, nbytes, store
        if keys and self.first_sight and new != []:  # (bytes key by key: a miniature's, every key new)
            new_bytes = nbytes * len(new or keys) if isinstance(nbytes, (int, float)) else sum(nbytes)
            if new_bytes > self.returns.watch_above:  # (no call for a store not watched)
                self.returns.stored(keys[new[0]] if new else keys[0], new_bytes)
        self._need = 0.0
        self._admitted = None
        self._placed = False
        shares = self._shares
        placing = None
        if keys and shares is not None and (self.fair is not None or keys[0][:2] != shares.first):
            self.fair = shares.touched(keys[0], self)
            if self.fair is not None:  # a store's keys are one group's: new() counts its objects there
                placing = shares.last
        self._placing = placing

    def refuses(self, need: float) -> bool:
        """Whether the store being reserved, which needs ``need`` bytes more than L1 has free, is refused whole: in
        either phase as large while large stores return less often than smaller ones
        (:mod:`~mpcache.eviction.returns`), by chance, or in ARC's phase by frequency (:meth:`_refuses_first_sight`);
        or as T1 and the orphans hold less than that, so it would evict an object seen again (T2), and
        :meth:`_admits` says no (placed in part, its head would evict T1's objects only for its tail to be refused).
        A later part of a named store refused before is refused whole whatever room there is."""
        self._need = need
        if need > self._large_need and self.returns.large_return_less():
            if self._refuses_first_sight(False, self._verdict(), 0.0):
                self._refused_large = True
                return True
        if self.floor and need > 0 and self._refuses_by_floor(need):
            return True
        if self.recency and self._trial is None and not self._refused_large:
            return False  # the recency phase admits every store, as LRU does (nothing refused by chance or size)
        named, storing = self._store, self._storing  # (:meth:`_verdict` inline: a call per store costs more)
        verdict = None if named is None or not storing else self.named.of(named, storing)
        if need > 0 and self.chance < 1.0 and self._refuses_first_sight(False, verdict, self.chance):
            return True
        if self.recency and verdict is not False:
            return False  # as above, but a later part of a store refused by chance is refused too
        if verdict is False:
            return not self._admits()
        if need > self.sizes[2] and self.first_sight and self._refuses_first_sight(True, verdict, 1.0):
            return True
        sizes = self.sizes
        return need > sizes[0] + sizes[2] and bool(self.lists[1]) and not self._admits()  # ARC: _admits says yes

    def _refuses_first_sight(self, by_frequency: bool, verdict: bool | None, chance: float) -> bool:
        """Whether a first-sight store (none of it evicted or refused before), not judged (nor its name's
        ``verdict``), is refused: admitted with ``chance`` (0: never), unlucky; or ``by_frequency``, as it needs more
        room in ARC's phase than the orphans give: none of its new keys was asked for more often lately than the
        object it would evict first (T1's least recently used while T1 holds more than its target, else T2's), and
        the gate's decisions proved right (:meth:`_gate`); then the next refusal on second sight waits as after its
        own (:meth:`_admits`).  A refused store's keys are remembered, as many bytes as L1's capacity."""
        storing = self._storing
        if not storing or self._admitted is not None or verdict is not None:
            return self._admitted is False
        if not by_frequency:
            if draw(self.access) < chance or self._seen(storing):
                return False
        else:
            t1, t2 = self.lists[0], self.lists[1]
            source = t1 if t1 and (not t2 or self.sizes[0] > self.target) else t2
            if not source or self._seen(storing) or not self._gate(storing, source):
                return False
            self.reused = False
        self._admitted = False
        self._refused.remember(storing, self._storing_bytes, self.capacity)
        return True

    def _refuses_by_floor(self, need: float) -> bool:
        """Whether the store being reserved, not judged (nor its name), is refused, its keys remembered: the least
        recently used objects it would evict for ``need`` bytes beyond the orphans include one used within the floor."""
        storing = self._storing
        if not storing or self._admitted is not None or self._verdict() is not None:
            return self._admitted is False
        uses = ((entry.used, entry.size) for entry in self.lists[0].values())
        if quiet_for(uses, need - self.sizes[2], self.access - self.floor):
            return False
        self._admitted = False
        self._refused.remember(storing, self._storing_bytes, self.capacity)
        return True

    def _seen(self, storing: Sequence[Any]) -> bool:
        """Whether a key of the store was evicted (a ghost) or refused before: its second sight."""
        ghosts, refused = self._ghosts, self._refused
        return any(key in ghosts or key in refused for key in storing)

    def _refused_bound(self) -> float:
        """Keys of stores second sight refuses remembered: the newest, as many bytes as T2 holds (L1's capacity
        while L1 admits by chance, as for the stores it refuses by chance or frequency)."""
        return self.sizes[1] if self.chance == 1.0 else self.capacity

    @property
    def refusing(self) -> bool:
        """Whether the order refused the store being reserved (``victim`` gave None for it: not for want of room)."""
        return self._admitted is False

    def _admits(self) -> bool:
        """Whether the store being reserved may evict an object seen again (T2).  The adaptive order refuses a
        store none of whose objects was evicted (a ghost) or refused before, as an object seen once is worth less
        than one seen again, but only while T2 is in use: after a refusal, the next one waits until a lookup finds
        an object in T2 again (else objects seen twice and never again would keep out every new one).  A refused
        store's keys are remembered (the newest, see ``_refused_bound``) so that storing them again admits
        them.  A later part of a named store takes its name's verdict, even where its own objects were evicted or
        refused before (one part's keys may be remembered longer than another's; :mod:`~mpcache.eviction.verdicts`).
        What is not a store (an L2 landing) and ARC always may."""
        storing = self._storing
        if storing is None or not self.prefix_aware:
            return True
        if self._admitted is None:
            verdict = self._verdict()
            self._admitted = (not self.reused or self._seen(storing)) if verdict is None else verdict
            if self._admitted and verdict is None and self.reused and storing and self.lists[1]:
                self._admitted = not self._gate(storing, self.lists[1])
            if not self._admitted:
                if verdict is None:
                    self.reused = False
                bound = self._refused_bound() if verdict is None else self.capacity  # the first part's kept too
                self._refused.remember(storing, self._storing_bytes, bound)
        return self._admitted

    def asked(self, keys: Sequence[Any], nbytes: float, found: bool) -> None:
        """A lookup ``found`` each of ``keys`` (of ``nbytes``), or a store reserves them (once per request, as L1 calls
        it), in order: counted in the frequency sketch, evidence for the gate's decisions (:attr:`gate`) and, when
        sampled in ARC's phase, compared with an LRU's find (:attr:`phases`); a watched store's return
        (:attr:`returns`); an access's first key touches its group's fair share."""
        access = self.access
        if self._fair_access != access:  # (most calls are a lookup's later keys, one by one: this test first)
            shares = self._shares
            if shares is not None and keys:
                self._fair_access = access
                first = keys[0]
                if self.fair is not None or first[:2] != shares.first:
                    self.fair = shares.touched(first, self)
        watched, gate = self.returns.watched, self.gate  # (pairs: no tuple built)
        frequency, trial = self.frequency, self._trial
        shadow = self._shadow  # (a comparison may end ARC's phase, and the shadow LRU with it)
        for key in keys:
            if watched and key in watched:
                self.returns.asked(key)
            if shadow is not None:
                lru_found = shadow.sees(key, nbytes, access)
                if lru_found is not None and self.phases.join_due(shadow.halvings, nbytes, found, lru_found,
                                                                  access):
                    self.join()
                    shadow = None
            if gate.open and (key in gate.protected or key in gate.contested):  # most keys settle nothing: no call
                gate.asked(key)
            counted = frequency.add(key)
            if counted:
                if counted & SAMPLED and trial is not None:  # sampled for the trial (it sets the sampling)
                    trial.sees(key, nbytes, access, found)
                    self.chance, self.floor = trial.chance, trial.floor
                    if self.floor and not self.recency:  # the floor keeps what the recency phase would evict
                        self.join()
                        shadow = None
                if counted & ENDED:  # a window ended: the next one from the objects held now, never narrower
                    frequency.resize(max(frequency.window, FREQUENCY_WINDOW * max(len(self), 16)))

    def _gate(self, storing: Sequence[Any], source: OrderedDict[Any, Any]) -> bool:
        """Whether the frequency gate refuses a store that would evict from ``source`` (T2 for one that second sight
        admits while T2 is in use, a ghost's or one refused before; T1 or T2 for a first sight in ARC's phase): none
        of its new keys was asked for more often lately than the least recently used object there, the first it
        would evict, and the gate's score says its decisions proved right (each such store is one, naming the
        objects it would evict, :func:`~mpcache.eviction.gate.would_evict`: the gate's class in that module)."""
        entry_of = self._entry_of
        fresh = [key for key in storing if entry_of(key) is None]  # what it would place: the objects it has not
        if not fresh:
            return False
        frequency = self.frequency
        first = frequency.estimate(next(iter(source)))
        if any(frequency.estimate(key) >= first for key in fresh):
            return False
        victims = would_evict(self.lists, self.sizes, self.target, self._need - self.sizes[2], len(fresh))
        return self.gate.decide(fresh, victims)

    def _verdict(self) -> bool | None:
        """The verdict the store being reserved takes from its name (:mod:`~mpcache.eviction.verdicts`); None:
        unnamed, not judged yet, or a part stored again, which is judged afresh."""
        named, storing = self._store, self._storing
        return None if named is None or not storing else self.named.of(named, storing)

    def hint(self, key: Any, parent_key: Any) -> None:
        """``key`` comes right after a lookup's prefix, whose last chunk is its parent once a store reserves it."""
        hints = self.hints
        hints[key] = parent_key
        if len(hints) > PARENT_HINTS:
            hints.popitem(False)

    def _orphan_children(self, entry: Any) -> None:
        lists = self.lists
        children = entry.children
        for child_key in children if type(children) is dict else (children,):
            child = self._entry_of(child_key)
            if child is None or child.tier == 2:
                continue
            child.parent = None
            if child_key in lists[child.tier]:  # evictable: it goes first; a locked child is left alone
                del lists[child.tier][child_key]
                self.sizes[child.tier] -= child.size
                self.sizes[2] += child.size
                child.tier = 2
                lists[2][child_key] = child

    def forget(self, key: Any, entry: Any) -> None:
        """An object gone other than by ``victim`` (a reservation given back, a miniature's key forgotten): no
        longer in its list's size, nor its parent's child."""
        self.sizes[entry.tier] -= entry.size
        parent = entry.parent
        if parent is not None and parent.children:
            drop_child(parent, key)
        if entry.children:
            self._orphan_children(entry)
        if self.fair is not None:
            self.fair.gone(key, entry.size)

    def grow(self, key: Any, entry: Any, nbytes: float) -> None:
        """A resident object now holds ``nbytes`` more (a miniature's tail segment that took in the next one)."""
        self.sizes[entry.tier] += nbytes
        if self.fair is not None:
            self.fair.placed(key, nbytes)
        entry.size += nbytes

    def merge(self, key: Any, entry: Any, other_key: Any, other: Any) -> None:
        """``other``, out of its list already, joins ``entry`` (a miniature's two adjacent tail segments become
        one): its bytes count in ``entry``'s list, its children become ``entry``'s, and the shadow LRUs hold it
        as part of ``entry``."""
        children, other.children = other.children, None  # not orphaned by forget: re-linked below
        self.forget(other_key, other)
        self.grow(key, entry, other.size)
        for child_key in children if type(children) is dict else (children,) if children is not None else ():
            child = self._entry_of(child_key)
            if child is not None and child.parent is other:
                child.parent = entry
                add_child(entry, child_key)
        for shadow in (self._shadow, *(self._trial.shadows if self._trial is not None else ())):
            if shadow is not None:
                shadow.merge(key, other_key)


def build(policy: str, capacity_bytes: int, entry_of: Callable[[Any], Any], code: Callable[[Any], int] | int = hash,
          fair: bool = False, trial: int | None = TRIAL_HALVINGS, first_sight: bool = True) -> LruOrder | ArcOrder:
    """The order ``--l1-policy`` names; ``code``: a key's number for the frequency sketch and the samples (its hash
    by default; an int: the index of a tuple key's item that is, which the compiled sketch reads without a call);
    ``fair``: ``adaptive`` keeps each model and tenant a reserve (keys are :class:`~mpcache.contract.keys.ChunkKey`
    tuples: their first two fields); ``first_sight``: ``adaptive`` may refuse a store seen first (by frequency, and,
    where ``trial`` is not None, by chance or under an age floor, as its admission trial finds, sampling 1 / 2 **
    ``trial`` of the keys at first: :class:`~mpcache.eviction.admission.AdmissionTrial`); False where a store L1
    refuses would reach no L2 tier either."""
    if policy == "lru":
        return LruOrder(capacity_bytes, entry_of)
    if policy in ("arc", "adaptive"):
        return ArcOrder(capacity_bytes, entry_of, prefix_aware=policy == "adaptive", code=code, fair=fair,
                        trial=trial, first_sight=first_sight)
    raise ValueError(f"unknown L1 policy {policy!r}: expected one of {', '.join(POLICIES)}")

