"""Tail marks (mpcache.contract.tail_marks): what a lookup's marks say of how much of the head key's last tail it
shares, against the chunk where two chained tails really part."""

from __future__ import annotations

import random

import pytest

from mpcache.contract import tail_marks
from mpcache.contract.tail_marks import END_MARK_BITS, END_MARKS, FROM_START, MARK_BITS, mark, pack, shared_chunks


def fresh(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(count)]


def parted(rng: random.Random, first: list[int], at: int, length: int) -> list[int]:
    """A tail of ``length`` chunks sharing the first ``at`` of ``first``; each chunk after differs from
    ``first``'s in every mark (a chance match is the one thing this leaves out)."""
    out = first[:at]
    for chunk in range(at, length):
        key = rng.getrandbits(64)
        while chunk < len(first) and mark(key, MARK_BITS) == mark(first[chunk], MARK_BITS):
            key = rng.getrandbits(64)
        out.append(key)
    return out


def test_the_marks_fill_the_mark_words_exactly_and_reach_past_600_chunks():
    """And the lookup event with its mark words still takes the compiled publisher's path (fixed fields only)."""
    from mpcache.contract.events import SCHEMAS, EventType
    from mpcache.shm import layout, publish

    fields = len(SCHEMAS[EventType.MRC_LOOKUP_SAMPLED].fields)
    assert fields <= layout.HEAD_FIELD_SLOTS + publish.PLAIN_FIELD_CELLS * layout.SLOTS_PER_CELL
    assert len(FROM_START) * MARK_BITS + END_MARKS * END_MARK_BITS == 64 * tail_marks.MARK_WORDS
    assert list(FROM_START) == sorted(set(FROM_START)) and FROM_START[-1] > 600
    assert all(later <= round(earlier * tail_marks.GROWTH) + 1 for earlier, later in zip(FROM_START, FROM_START[1:]))


@pytest.mark.parametrize("at", [0, 1, 5, 15, 16, 17, 30, 47, 100, 130, 200, 500])
def test_two_tails_are_found_to_part_between_the_marks_around_the_chunk_where_they_do(at):
    """Where marks are a chunk apart, and at the tails' last chunks, the answer is exact; between sparser marks it
    is the middle of the two around the parting, never past the later one."""
    rng = random.Random(at)
    for length, other in ((at + 1, at + 1), (at + 3, at + 3), (700, 700), (at + 40, at + 25), (at + 9, at + 30)):
        first = fresh(rng, length)
        second = parted(rng, first, at, other)
        got = shared_chunks(pack(second, 0, 1), other, pack(first, 0, 1), length)
        shorter = min(length, other)
        comparable = sorted(marked(length) & marked(other) & set(range(shorter)))
        after = min((c for c in comparable if c >= at), default=None)
        before = max((c + 1 for c in comparable if c < at), default=0)
        assert (shorter if after is None else (before + after) // 2) == got, (length, other, got)
        if at < 16 or length == other and at >= length - END_MARKS:
            assert got == at


def marked(chunks: int) -> set[int]:
    """The chunks a tail of ``chunks`` has a mark of: those of FROM_START it has, and its last END_MARKS."""
    return {c for c in FROM_START if c < chunks} | set(range(max(0, chunks - END_MARKS), chunks))


def test_the_next_turn_of_a_conversation_shares_the_whole_last_tail():
    rng = random.Random(1)
    for last_length in (1, 9, 40, 130, 500, 900):
        last = fresh(rng, last_length)
        turn = last + fresh(rng, rng.randint(1, 6))
        assert last_length == shared_chunks(pack(turn, 0, 1), len(turn), pack(last, 0, 1), last_length)


def test_a_document_asked_about_again_shares_all_but_its_question():
    """The same document behind the head key and a new one-chunk question: the last chunks' 8-bit marks part them
    exactly at any length of document (a 2-bit mark would match by chance one time in four)."""
    rng = random.Random(2)
    exact = 0
    for _ in range(400):
        document = fresh(rng, rng.randint(20, 800))
        asked, again = document + fresh(rng, 1), document + fresh(rng, 1)
        exact += shared_chunks(pack(again, 0, 1), len(again), pack(asked, 0, 1), len(asked)) == len(document)
    assert exact >= 396  # a chance match at 8 bits: one in 256


def test_a_chance_match_puts_a_parting_one_mark_later_one_time_in_four():
    """Random keys parting within the first 16 chunks: never found before they part, and found where they do
    three times in four (the doc's "one in four")."""
    rng = random.Random(3)
    found = 0
    for _ in range(4000):
        at = rng.randrange(16)
        first = fresh(rng, 40)
        second = first[:at] + fresh(rng, 40 - at)
        got = shared_chunks(pack(second, 0, 1), 40, pack(first, 0, 1), 40)
        assert got >= at
        found += got == at
    assert 0.70 < found / 4000 < 0.80


def test_keys_whose_low_bits_repeat_still_part():
    """A client whose keys are multiples of 256 (or any counter): the marks read the mixed key's top bits."""
    first = [(1 << 40) + 256 * n for n in range(60)]
    second = first[:20] + [(2 << 40) + 256 * n for n in range(40)]
    assert 20 <= shared_chunks(pack(second, 0, 1), 60, pack(first, 0, 1), 60) < 25


def test_the_marks_are_the_first_rank_s_key_of_each_chunk_after_the_head():
    rng = random.Random(4)
    ranks, head = 4, 16
    keys = fresh(rng, (head + 30) * ranks)
    assert pack(keys, head * ranks, ranks) == pack(keys[head * ranks::ranks], 0, 1)
    moved = list(keys)
    moved[(head + 3) * ranks + 1] ^= 1 << 63  # another rank's key: not marked
    assert pack(moved, head * ranks, ranks) == pack(keys, head * ranks, ranks)


def test_without_both_tails_marks_nothing_is_taken_as_shared():
    words = pack(fresh(random.Random(5), 50), 0, 1)
    assert (0, 0, 0) == (shared_chunks((), 50, words, 50), shared_chunks(words, 50, (), 50),
                         shared_chunks(words[:1], 50, words, 50))
    assert 50 == shared_chunks(words, 50, words, 50)


def test_a_negative_start_or_no_rank_is_refused():
    for start, ranks in ((-1, 1), (0, 0)):
        with pytest.raises(ValueError):
            pack([1, 2, 3], start, ranks)


def test_corrupt_words_and_counts_never_claim_more_than_the_shorter_tail():
    rng = random.Random(6)
    for _ in range(2000):
        words = [rng.choice((0, -1, 2**64 - 1, 2**70, rng.getrandbits(64))) for _ in range(rng.randint(0, 3))]
        last = [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
        chunks, last_chunks = rng.randint(-5, 900), rng.randint(-5, 900)
        assert 0 <= shared_chunks(words, chunks, last, last_chunks) <= max(0, min(chunks, last_chunks))
