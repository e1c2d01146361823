"""The adaptive order's fair shares (:mod:`mpcache.eviction.fairness`): through L1Manager, a group (model and
tenant) that holds no more than its reserve (half of L1 over the active groups) keeps its objects while another
group's can go, one that holds more or is idle does not, and one group alone decides as if no shares were kept."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import trace_gen
from benchmarks.null_cache import NullPublisher
from mpcache.cache import l1 as l1_module
from mpcache.cache.l1 import L1Manager
from mpcache.contract.keys import ChunkKey
from mpcache.eviction.fairness import MAX_GROUPS, FairShares

CHUNKS = 64  # L1's objects in these tests: two active groups' reserves are 16 each


def _l1(chunks: int = CHUNKS) -> L1Manager:
    return L1Manager(np.zeros(chunks * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")


def _request(l1: L1Manager, group: tuple[str, str], hashes: list[int]) -> int:
    """One request as LMCache's front end makes it: look up (read-lock the prefix found), store the rest, release;
    returns the chunks found."""
    found = l1.lock_prefix(*group, hashes, publish=False)
    reservation = l1.reserve_write(*group, hashes[found:])
    l1.commit_write(*group, [hashes[found + position] for position in reservation.positions], 64)
    l1.release_read(*group, hashes[:found])
    return found


def _resident(l1: L1Manager, group: tuple[str, str], hashes: range) -> list[int]:
    return [chunk for chunk in hashes if l1.contains(ChunkKey(*group, chunk))]


@pytest.mark.parametrize("flooder", [("m", "other-tenant"), ("other-model", ""), ("m", "tenant")])
def test_a_flood_takes_room_from_its_own_group_while_the_order_judges_by_recency(flooder):
    """A tenant asks its 2 prompts of 8 chunks in turn (16 chunks, its reserve), and after each, 2 prompts of 16
    chunks never seen again come from another tenant or model (72 chunks between two asks of one prompt: an LRU of
    64 finds nothing).  Nothing comes back from a ghost, so the order stays in its recency phase (an LRU's order)
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
            found += _request(l1, ("m", "tenant"), prompt)
            for _ in range(2):
                _request(l1, flooder, [next(flood) for _ in range(16)])
        rounds.append((found, l1.order.recency))
    if flooder == ("m", "tenant"):
        assert rounds[:2] == [(0, True), (0, True)]
    else:
        assert rounds == [(0, True)] + [(16, True)] * 5


def test_a_group_over_its_reserve_gives_up_its_own_objects_before_an_older_one_of_a_group_within_it():
    """Tenant b stores 16 chunks, then tenant a 48 (L1 full: a over its reserve of 16, b within it).  When either
    stores 8 more, the 8 evicted are a's oldest, though b's 16 are older (LRU's victims); b keeps all of its."""
    for newcomer in ("a", "b"):
        l1 = _l1()
        _request(l1, ("m", "b"), list(range(100, 116)))
        for start in range(200, 248, 8):
            _request(l1, ("m", "a"), list(range(start, start + 8)))
        assert len(_resident(l1, ("m", "a"), range(200, 248))) == 48
        _request(l1, ("m", newcomer), list(range(300, 308)))
        assert _resident(l1, ("m", "b"), range(100, 116)) == list(range(100, 116)), newcomer
        assert _resident(l1, ("m", "a"), range(200, 248)) == list(range(208, 248)), newcomer
        assert _resident(l1, ("m", newcomer), range(300, 308)) == list(range(300, 308))


@pytest.mark.parametrize("asks_every", [None, 20])
def test_a_group_that_has_not_asked_for_anything_lately_is_not_spared(asks_every):
    """Tenant a stores one prompt of 8 chunks; tenant b then makes 400 requests of 4 new chunks each (80 between
    two of a's asks every 20 requests: an LRU of 64 keeps nothing of a's); an epoch is 64 accesses here (L1's
    objects).  Where a asks again every 20 requests, it stays active and within its reserve: every ask finds the
    whole prompt, and the order never leaves its recency phase (no ghost comes back).  Where a never asks again,
    it is idle after two epochs and its prompt goes in LRU's order (b's requests fill L1 many times over)."""
    l1 = _l1()
    prompt = list(range(1, 9))
    _request(l1, ("m", "a"), prompt)
    found = []
    for index in range(400):
        if asks_every and index % asks_every == 0:
            found.append(_request(l1, ("m", "a"), prompt))
        _request(l1, ("m", "b"), list(range(10**6 + 4 * index, 10**6 + 4 * index + 4)))
    if asks_every:
        assert found == [8] * (400 // asks_every)
        assert l1.order.recency
        assert _resident(l1, ("m", "a"), range(1, 9)) == prompt
    else:
        assert _resident(l1, ("m", "a"), range(1, 9)) == []


@pytest.mark.parametrize("kind", ["conversations", "multitenant", "scan"])
def test_one_group_alone_decides_as_without_shares(kind, monkeypatch):
    """One model and tenant: every request's prefix found is the same as under an order built without shares."""
    requests = trace_gen.KINDS[kind](1500, 3)
    blocks = 300

    def replay() -> list[int]:
        l1 = _l1(blocks)
        return [_request(l1, ("m", "t"), request.hashes) for request in requests]

    with_shares = replay()
    monkeypatch.setattr(l1_module, "_chunk_group", None)
    without = replay()
    assert with_shares == without
    assert sum(with_shares) > 0


def test_shares_split_l1_among_the_active_groups_and_the_groups_tracked_are_bounded():
    """Four active groups: each is spared up to half a quarter of L1 (12.5 bytes of 100) and not beyond; groups
    past MAX_GROUPS are not tracked (neither spared nor counted), so a client that invents tenants cannot grow the
    state."""

    class Order:
        sizes = [40.0, 0.0, 0.0]

        def __len__(self) -> int:
            return 1000

    shares = FairShares(100, lambda key: key[0])
    for access, group in enumerate("abcd"):
        shares.touched((group,), access, Order())
    shares.placed(("b",), 12.5)
    shares.placed(("c",), 13)
    assert shares.sharing
    assert shares.spares(("a",)) is False  # 40 bytes, all L1 held when a second group came: over 12.5
    assert shares.spares(("b",)) is True
    assert shares.spares(("c",)) is False
    assert shares.spares(("d",)) is True
    for index in range(2 * MAX_GROUPS):
        shares.touched((f"tenant-{index}",), 10, Order())
    assert shares.groups is not None and len(shares.groups) == MAX_GROUPS
    assert shares.spares(("tenant-999999",)) is False
