"""The adaptive order's fair shares (:mod:`mpcache.eviction.fairness`): through L1Manager, a group (model and
tenant) that holds no more than its reserve (a quarter of L1 over the active groups) keeps its objects while another
group's can go, one that holds more or is idle does not, and one group alone decides as if no shares were kept."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from support.l1_requests import engine_request

from benchmarks import trace_gen
from benchmarks.null_cache import NullPublisher
from mpcache.cache import l1 as l1_module
from mpcache.cache.l1 import L1Manager
from mpcache.cache.l1_entries import Entry
from mpcache.contract.keys import ChunkKey
from mpcache.eviction import fairness
from mpcache.eviction.fairness import MAX_GROUPS, SPARED_PER_EVICTION, FairShares
from mpcache.eviction.order import ArcOrder

CHUNKS = 128  # L1's objects in these tests: two active groups' reserves are 16 each


def _l1(chunks: int = CHUNKS) -> L1Manager:
    return L1Manager(np.zeros(chunks * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")


def _resident(l1: L1Manager, group: tuple[str, str], hashes: range) -> list[int]:
    return [chunk for chunk in hashes if l1.contains(ChunkKey(*group, chunk))]


@pytest.mark.parametrize("flooder", [("m", "other-tenant"), ("other-model", ""), ("m", "tenant")])
def test_a_flood_takes_room_from_its_own_group_while_the_order_judges_by_recency(flooder):
    """A tenant asks its 2 prompts of 8 chunks in turn (16 chunks, its reserve), and after each, 2 prompts of 32
    chunks never seen again come from another tenant or model (136 chunks between two asks of one prompt: an LRU of
    128 finds nothing).  Nothing comes back from a ghost, so the order stays in its recency phase (an LRU's order)
    throughout: what keeps the prompts from the second round on is the reserve.  The same flood
    from the tenant itself (one group: nothing to share) leaves it finding nothing in the second round, as the
    LRU would, still in the recency phase (the prompts then come back as ghosts, and ARC's lists keep them)."""
    l1 = _l1()
    prompts = [list(range(base, base + 8)) for base in (1000, 2000)]
    flood = iter(range(10**6, 2 * 10**6))
    rounds = []  # (chunks found, whether the order is still in its recency phase after the round)
    for _ in range(6):
        found = 0
        for prompt in prompts:
            found += engine_request(l1, ("m", "tenant"), prompt)
            for _ in range(2):
                engine_request(l1, flooder, [next(flood) for _ in range(32)])
        rounds.append((found, l1.order.recency))
    if flooder == ("m", "tenant"):
        assert rounds[:2] == [(0, True), (0, True)]
    else:
        assert rounds == [(0, True)] + [(16, True)] * 5


def test_a_group_over_its_reserve_gives_up_its_own_objects_before_an_older_one_of_a_group_within_it():
    """Tenant b stores 16 chunks, then tenant a 112 (L1 full: a over its reserve of 16, b within it).  When either
    stores 8 more, the 8 evicted are a's oldest, though b's 16 are older (LRU's victims); b keeps all of its."""
    for newcomer in ("a", "b"):
        l1 = _l1()
        engine_request(l1, ("m", "b"), list(range(100, 116)))
        for start in range(200, 312, 8):
            engine_request(l1, ("m", "a"), list(range(start, start + 8)))
        assert len(_resident(l1, ("m", "a"), range(200, 312))) == 112
        engine_request(l1, ("m", newcomer), list(range(400, 408)))
        assert _resident(l1, ("m", "b"), range(100, 116)) == list(range(100, 116)), newcomer
        assert _resident(l1, ("m", "a"), range(200, 312)) == list(range(208, 312)), newcomer
        assert _resident(l1, ("m", newcomer), range(400, 408)) == list(range(400, 408))


@pytest.mark.parametrize("asks_every", [None, 20])
def test_a_group_that_has_not_asked_for_anything_lately_is_not_spared(asks_every):
    """Tenant a stores one prompt of 8 chunks; tenant b then makes 400 requests of 8 new chunks each (160 between
    two of a's asks every 20 requests: an LRU of 128 keeps nothing of a's); an epoch is 128 touches here (L1's
    objects).  Where a asks again every 20 requests, it stays active and within its reserve: every ask finds the
    whole prompt, and the order never leaves its recency phase (no ghost comes back).  Where a never asks again,
    it is idle after two epochs and its prompt goes in LRU's order (b's requests fill L1 many times over)."""
    l1 = _l1()
    prompt = list(range(1, 9))
    engine_request(l1, ("m", "a"), prompt)
    found = []
    for index in range(400):
        if asks_every and index % asks_every == 0:
            found.append(engine_request(l1, ("m", "a"), prompt))
        engine_request(l1, ("m", "b"), list(range(10**6 + 8 * index, 10**6 + 8 * index + 8)))
    if asks_every:
        assert found == [8] * (400 // asks_every)
        assert l1.order.recency
        assert _resident(l1, ("m", "a"), range(1, 9)) == prompt
    else:
        assert _resident(l1, ("m", "a"), range(1, 9)) == []


@pytest.mark.parametrize("length", [24, 40, 60])
def test_a_prompt_longer_than_a_pass_keeps_within_its_reserve_whole(length):
    """An L1 of 512 chunks, two groups (reserves of 64): a tenant asks one prompt of up to 60 chunks again and again
    while the other sends 640 chunks never seen again between two asks.  The whole prompt is passed over, not just
    its first chunks: every ask after the first finds all of it, the order still in its recency phase."""
    l1 = _l1(512)
    prompt = list(range(1, length + 1))
    flood = iter(range(10**6, 2 * 10**6))
    found = []
    for _ in range(6):
        found.append(engine_request(l1, ("m", "a"), prompt))
        for _ in range(40):
            engine_request(l1, ("m", "b"), [next(flood) for _ in range(16)])
    assert found == [0] + [length] * 5
    assert l1.order.recency


def test_a_group_active_while_l1_fills_stays_active():
    """A fresh L1 of 2,048 chunks: tenant b stores 8 new chunks a request, tenant a asks its 8-chunk prompt every
    300 of b's requests (2,400 chunks between two asks: an LRU keeps nothing of a's).  An epoch is as long as L1
    holds objects now, so while L1 fills a is not idle between its asks: every ask after the first finds its
    prompt."""
    l1 = _l1(2048)
    prompt = list(range(1, 9))
    found = []
    for index in range(1500):
        if index % 300 == 0:
            found.append(engine_request(l1, ("m", "a"), prompt))
        engine_request(l1, ("m", "b"), list(range(10**6 + 8 * index, 10**6 + 8 * index + 8)))
    assert found == [0] + [8] * 4
    assert l1.order.recency


def test_an_idle_group_is_not_spared_while_two_others_share_l1():
    """Tenant a stores 8 chunks (within any reserve here) and goes idle; tenants b and c, both active, store 4 new
    chunks a request in turn.  a is counted in no share and spared by none: its chunks go in LRU's order."""
    l1 = _l1()
    engine_request(l1, ("m", "a"), list(range(1, 9)))
    for index in range(200):
        engine_request(l1, ("m", "bc"[index % 2]), list(range(10**6 + 4 * index, 10**6 + 4 * index + 4)))
    assert _resident(l1, ("m", "a"), range(1, 9)) == []
    assert l1.order.fair is not None and l1.order.fair.sharing


def test_a_landing_of_another_group_starts_the_counting():
    """An object placed with no store being reserved (an L2 landing) touches its group as a store does: a second
    group's landing starts the counting, the first group credited with all L1 held."""
    entries: dict[ChunkKey, Entry] = {}
    order = ArcOrder(100, entries.get, prefix_aware=True, fair=True)
    for number, group in ((1, "a"), (2, "a"), (3, "b")):
        key = ChunkKey("m", group, number)
        if group == "a":
            order.admitting([key], 10)
        entries[key] = entry = Entry(0, 10)
        order.new(key, entry, None)
        order.admitting(None)
        order.lists[entry.tier][key] = entry
    assert order.fair is not None
    assert order.fair.groups == {("m", "a"): [20.0, 0.0, False], ("m", "b"): [10.0, 0, False]}


def _placed(order: ArcOrder, entries: dict, group: str, number: int, again: bool = False,
            store: object = None) -> ChunkKey:
    """One object of 10 bytes of ``group`` stored (its own store, named ``store``); ``again``: then used again
    (T2, in ARC's phase)."""
    key = ChunkKey("m", group, number)
    order.admitting([key], 10, store=store)
    entries[key] = entry = Entry(0, 10)
    order.new(key, entry, None)
    order.admitting(None)
    order.lists[entry.tier][key] = entry
    if again:
        del order.lists[entry.tier][key]
        order.promote(entry)
        order.lists[entry.tier][key] = entry
    return key


@pytest.mark.parametrize("leaves_by", ["gone", "epoch"])
def test_an_object_counted_in_a_group_that_left_the_table_is_judged_by_the_group_s_count_now(monkeypatch, leaves_by):
    """Tenant c, not tracked while the table is full, stores an object it does not count; once tracked it stores one
    it counts (its entry keeps that count), and the uncounted object's departure takes its count to 0: c leaves the
    table, as that departure finds it idle (``gone``) or, still active then, at the end of its second idle epoch
    (``epoch``).  Back, with 10 bytes (within its reserve, 50 of 400 between two groups), the object counted before
    heads the list and is spared by the count c has now, not by the one it left with: tenant b's object, over its
    reserve, goes instead."""
    monkeypatch.setattr(fairness, "MAX_GROUPS", 2)
    entries: dict[ChunkKey, Entry] = {}
    order = ArcOrder(400, entries.get, prefix_aware=True, fair=True)

    def given_back(key: ChunkKey) -> None:
        entry = entries.pop(key)
        del order.lists[entry.tier][key]
        order.forget(key, entry)

    def two_epochs_of_b_alone() -> None:
        for _ in range(2 * fairness.MIN_EPOCH_TOUCHES):
            order.fair.touched(ChunkKey("m", "b", 0), order)

    first = _placed(order, entries, "a", 1)
    b_first = _placed(order, entries, "b", 2)  # counting starts, and the table is full
    uncounted = _placed(order, entries, "c", 3)
    given_back(first)
    two_epochs_of_b_alone()  # a holds nothing and is idle: it leaves, and c is tracked from its next store
    counted = _placed(order, entries, "c", 4)
    left_with = order.fair.groups[("m", "c")]
    if leaves_by == "gone":
        two_epochs_of_b_alone()
        given_back(uncounted)
    else:
        given_back(uncounted)
        assert ("m", "c") in order.fair.groups and left_with[0] == 0.0  # active: it stays, for now
        two_epochs_of_b_alone()
    assert ("m", "c") not in order.fair.groups and left_with == [0.0, left_with[1], True]
    _placed(order, entries, "c", 5)
    b_later = [_placed(order, entries, "b", 10 + number) for number in range(6)]
    given_back(b_first)
    assert next(iter(order.lists[0])) == counted and order.fair.groups[("m", "b")][0] == 60.0
    assert order.victim()[0] == b_later[0]


def test_a_reserve_never_makes_a_store_evict_what_it_is_admitting():
    """ARC's phase, T1 within its target, so T2 gives the next object: T2 holds only tenant v's object, within its
    reserve, and T1 only what the current request's first part just wrote.  The request's second part evicts v's
    object, as with no reserves, not its own first part's (T1 never gives up what it is admitting)."""
    for fair in (False, True):
        entries: dict[ChunkKey, Entry] = {}
        order = ArcOrder(100, entries.get, prefix_aware=True, fair=fair)
        order.split()
        kept = _placed(order, entries, "v", 1, again=True)
        order.access = 2
        written = [_placed(order, entries, "a", 100 + number, store="request") for number in range(4)]
        order.target = 60.0
        order.admitting([ChunkKey("m", "a", 200)], 10, store="request")
        assert order.victim()[0] == kept, fair
        assert all(key in order.lists[0] for key in written)
        assert fair is (order.fair is not None and order.fair.sharing)


def test_finding_an_object_to_evict_looks_at_a_bounded_number_of_objects():
    """ARC's phase: 200 small tenants' objects seen again (T2, each tenant within its reserve) and a large tenant's
    seen once (T1), T1 within ARC's target, so T2 is the list ARC evicts from, and its head is all spared.  Each
    eviction asks whether an object is spared at most SPARED_PER_EVICTION times in T2 and once in T1, whose head
    gives one instead: the large tenant's stores evict its own objects, none of the small tenants'."""
    entries: dict[ChunkKey, Entry] = {}
    order = ArcOrder(10 * 1400, entries.get, prefix_aware=True, fair=True)
    order.split()
    asked: list[ChunkKey] = []

    class Watched(OrderedDict):
        """One of the order's lists, keeping every key a walk over it yields (the objects looked at)."""

        def __iter__(self):
            for key in super().__iter__():
                asked.append(key)
                yield key

    order.lists[0], order.lists[1] = Watched(), Watched()  # (empty: split left T1 and T2 so)
    small = [_placed(order, entries, f"small-{number % 100}", number, again=True) for number in range(200)]
    for number in range(1200):
        _placed(order, entries, "large", 10**6 + number)
    order.target = float(10 * 1400)
    looked = []
    for number in range(300):
        order.access += 1
        key = ChunkKey("m", "large", 10**8 + number)
        order.admitting([key], 10)
        asked.clear()
        victim, _ = order.victim()
        entries.pop(victim)
        looked.append(len(asked))
        assert victim.cache_salt == "large"
        entries[key] = entry = Entry(0, 10)
        order.new(key, entry, None)
        order.admitting(None)
        order.lists[entry.tier][key] = entry
    assert all(key in entries for key in small)
    assert {SPARED_PER_EVICTION + 1} == set(looked)  # T2's first objects, all spared, and T1's head


def test_a_reserve_is_a_quarter_of_l1_over_the_groups_active_now_not_over_every_group_held():
    """Three groups hold objects, one of them idle for two epochs: the reserve is a quarter of L1 (120 bytes) over
    the two active ones, 15 bytes, so a group holding 14 is spared (over all three it would be 10, and it would
    not)."""

    class Order:
        sizes = [50.0, 0.0, 0.0]

        def evictable(self) -> int:
            return 16

    shares = FairShares(120)
    shares.touched(("m", "idle", 1), Order())  # the first group: all L1 holds (50 bytes)
    shares.touched(("m", "b", 2), Order())
    shares.placed(("m", "b", 2), 14)
    for _ in range(2 * 16):
        shares.touched(("m", "b", 3), Order())
        shares.touched(("m", "c", 4), Order())
    assert sorted(shares.groups) == [("m", "b"), ("m", "c"), ("m", "idle")]
    assert shares.spares(("m", "b", 2)) is True
    assert shares.spares(("m", "idle", 1)) is False


@pytest.mark.parametrize("kind", ["conversations", "multitenant", "scan"])
def test_one_group_alone_decides_as_without_shares(kind, monkeypatch):
    """One model and tenant: every request's prefix found is the same as under an order built without shares."""
    requests = trace_gen.KINDS[kind](1500, 3)
    blocks = 300

    def replay() -> list[int]:
        l1 = _l1(blocks)
        return [engine_request(l1, ("m", "t"), request.hashes) for request in requests]

    with_shares = replay()
    build = l1_module.l1_order.build
    monkeypatch.setattr(l1_module.l1_order, "build", lambda *args, **kwargs: build(*args, **{**kwargs, "fair": False}))
    without = replay()
    assert with_shares == without
    assert sum(with_shares) > 0


def test_shares_split_l1_among_the_active_groups_and_the_groups_tracked_are_bounded():
    """Four active groups: each is spared up to a quarter of a quarter of L1 (6.25 bytes of 100) and not beyond.  Past
    MAX_GROUPS a group is not tracked (neither spared nor counted), so a client that invents tenants cannot grow
    the state; and a group that holds nothing leaves once idle (two epochs without a touch), so the table does not
    fill up with tenants long gone."""

    class Order:
        sizes = [40.0, 0.0, 0.0]
        objects = 10**6  # an epoch of a million touches: none ends while the table fills

        def evictable(self) -> int:
            return self.objects

    order = Order()
    shares = FairShares(100)
    for tenant in "abcd":
        shares.touched(("m", tenant, 1), order)
    shares.placed(("m", "b", 2), 6.25)
    shares.placed(("m", "c", 3), 6.5)
    assert shares.sharing
    assert shares.spares(("m", "a", 4)) is False  # 40 bytes, all L1 held when a second group came: over 6.25
    assert shares.spares(("m", "b", 5)) is True
    assert shares.spares(("m", "c", 6)) is False
    assert shares.spares(("m", "d", 7)) is True
    for index in range(2 * MAX_GROUPS):
        shares.touched(("m", f"tenant-{index}", 8), order)
    assert len(shares.groups) == MAX_GROUPS
    assert shares.spares(("m", f"tenant-{2 * MAX_GROUPS - 1}", 9)) is False  # not tracked
    order.objects = 16  # epochs of 16 touches: three of them by one tenant leave the others idle
    for _ in range(3 * 16):
        shares.touched(("m", "z", 10), order)
    assert sorted(shares.groups) == [("m", "a"), ("m", "b"), ("m", "c"), ("m", "z")]  # the three hold bytes
    shares.gone(("m", "b", 2), 6.25)
    assert sorted(shares.groups) == [("m", "a"), ("m", "c"), ("m", "z")]
