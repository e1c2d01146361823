"""The shadow LRU the adaptive order compares L1 with: an LRU of L1's capacity that takes an access's keys tail
first, on a hash-sampled share of the keys once they outgrow its key budget; checked against a plain list kept in
least-recently-used order."""

from __future__ import annotations

import random

from mpcache.eviction.frequency import MIX, WORD
from mpcache.eviction.shadow import ShadowLru


def _plain_lru(asks: list[tuple[int, int]], capacity: int) -> list[bool]:
    """Whether an LRU of ``capacity`` bytes held each (key, bytes) asked for: a list, most recently used last."""
    held: list[tuple[int, int]] = []
    found = []
    for key, nbytes in asks:
        before = [item for item in held if item[0] == key]
        found.append(bool(before))
        held = [item for item in held if item[0] != key] + [(key, nbytes)]
        while sum(size for _, size in held) > capacity:
            held.pop(0)
    return found


def test_every_key_is_sampled_while_the_budget_holds_and_finds_are_an_lru_s():
    """Keys of 1-3 bytes drawn from 40, asked for 3,000 times, each by an access of its own, in an LRU of 30
    bytes: each find equals a plain list's, and no key is left out of the sample (30 bytes hold at most 30 keys,
    under the budget of 64)."""
    rng = random.Random(7)
    sizes = {key: rng.randint(1, 3) for key in range(40)}
    asks = [(key, sizes[key]) for key in (rng.randrange(40) for _ in range(3000))]
    shadow = ShadowLru(30, max_keys=64)
    assert _plain_lru(asks, 30) == [shadow.sees(key, nbytes, access) for access, (key, nbytes) in enumerate(asks)]
    assert 0 == shadow.halvings


def _sampled(key: int, halvings: int) -> bool:
    return not ((hash(key) * MIX) & WORD) >> (64 - halvings) if halvings else True


def test_past_the_budget_the_rate_halves_and_the_sampled_keys_make_an_lru_of_the_scaled_capacity():
    """An LRU of 4,000 one-byte keys with a budget of 500 keys halves its rate three times (4,000 / 8 = 500 bytes
    fit the budget, 4,000 / 4 do not).  Then a key outside the sample is answered None, and the sampled keys'
    finds equal a plain LRU's of the capacity scaled by the rate, fed those keys alone."""
    shadow = ShadowLru(4000, max_keys=500)
    rng = random.Random(3)
    warm = list(range(10_000))
    for access, key in enumerate(warm):
        shadow.sees(key, 1, access)
    assert 3 == shadow.halvings and len(shadow) <= 500
    asks = [rng.randrange(20_000) for _ in range(20_000)]
    answers = [shadow.sees(key, 1, len(warm) + access) for access, key in enumerate(asks)]
    assert [None if not _sampled(key, 3) else answer for key, answer in zip(asks, answers)] == answers
    sampled = [(key, 1) for key in warm + asks if _sampled(key, 3)]
    expected = _plain_lru(sampled, 500)[-sum(1 for key in asks if _sampled(key, 3)):]
    assert expected == [answer for answer in answers if answer is not None]
    assert 3 == shadow.halvings


def test_an_access_s_keys_become_the_newest_tail_first_once_the_next_access_begins():
    """An access asks a, b, c (a prompt's head to tail) in an LRU of two keys: none is held yet, and none is until
    the next access begins.  Then a and b are held (the head, newest; c, taken first, left first), as L1's
    recency phase releases a request's chunks tail first and so loses a prefix's tail before its head."""
    shadow = ShadowLru(2)
    assert [False, False, False] == [shadow.sees(key, 1, 1) for key in ("a", "b", "c")]
    assert [False, True, True] == [shadow.sees(key, 1, 2) for key in ("c", "b", "a")]


def test_an_access_that_never_ends_holds_at_most_the_key_budget_waiting():
    """Stores with no lookup between them are one access: its keys wait to be taken in, fewer than ``max_keys``
    at a time (taken in, tail first, whenever that many wait), and what is taken in halves the sampling rate
    as it would over many accesses, so the shadow's memory stays bounded."""
    shadow = ShadowLru(10_000, max_keys=64)
    for key in range(1_000):
        shadow.sees(key, 1, 0)
        assert len(shadow._asked) < 64 and len(shadow) <= 64
    assert shadow.halvings >= 3  # 1,000 distinct keys into a budget of 64


def test_seeded_it_holds_what_an_lru_that_had_seen_those_keys_holds():
    """Seeded with 10,000 one-byte keys, least recently used first, into an LRU of 4,000 with a budget of 500:
    the rate halves as if the keys had been asked for one by one (three times), and every later find equals that
    of a shadow fed the same keys by accesses and a plain LRU's of the sampled keys (4,000 / 8 = 500 bytes)."""
    held = [(key, 1) for key in range(10_000)]
    seeded, fed = ShadowLru(4000, max_keys=500), ShadowLru(4000, max_keys=500)
    seeded.seed(held)
    for access, (key, nbytes) in enumerate(held):
        fed.sees(key, nbytes, access)
    assert (3, 3) == (seeded.halvings, fed.halvings) and len(seeded) <= 500
    rng = random.Random(5)
    asks = [rng.randrange(12_000) for _ in range(5_000)]
    answers = [seeded.sees(key, 1, len(held) + access) for access, key in enumerate(asks)]
    assert [fed.sees(key, 1, len(held) + access) for access, key in enumerate(asks)] == answers
    sampled = [(key, 1) for key, _ in held if _sampled(key, 3)] + [(key, 1) for key in asks if _sampled(key, 3)]
    expected = _plain_lru(sampled, 500)[-sum(1 for key in asks if _sampled(key, 3)):]
    assert expected == [answer for answer in answers if answer is not None] and any(expected)


def test_seeded_with_more_bytes_than_it_holds_the_oldest_leave():
    """Seeded with keys of 3 bytes into an LRU of 10: the newest three are held, the rest are not."""
    shadow = ShadowLru(10)
    shadow.seed([(key, 3) for key in "abcde"])
    assert [False, False, True, True, True] == [shadow.sees(key, 3, 1) for key in "abcde"]


def test_a_key_seeded_again_becomes_the_newest_and_counts_its_bytes_once():
    """Seeded a (3 bytes), b, then a again, into an LRU of 6 bytes, then c: a is the newest but one and held, b
    the oldest and pushed out by c (a counted twice would have pushed a out as well)."""
    shadow = ShadowLru(6)
    shadow.seed([("a", 3), ("b", 3), ("a", 3)])
    shadow.seed([("c", 3)])
    assert [False, True, True] == [shadow.sees(key, 3, 1) for key in ("b", "a", "c")]


def test_a_key_merged_into_another_holds_both_bytes_where_both_were_held_and_leaves_where_only_it_was():
    """A miniature's two tail segments merged: the shadow holds one key of both their bytes, so it evicts at the
    same point as before; merged into a key it does not hold, the merged key's bytes leave with it."""
    shadow = ShadowLru(10)
    for access, (key, nbytes) in enumerate([("a", 3), ("b", 4), ("c", 2)]):
        shadow.sees(key, nbytes, access)
    shadow.sees("d", 1, 3)  # settles the three above, the oldest first
    shadow.merge("a", "b")
    shadow.merge("x", "c")
    assert ["a"] == list(shadow._keys)
    shadow.sees("f", 3, 4)  # settles d: a's 7 bytes and d's 1
    shadow.sees("g", 1, 5)  # settles f: 11 bytes, over 10, so a goes (3 bytes were it not both segments)
    assert [False, True, True] == [shadow.sees(key, 1, 6) for key in ("a", "d", "f")]
