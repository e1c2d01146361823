"""Tail marks (mpcache.contract.tail_marks): what a lookup's marks say of how much of the head key's last tail it
shares, against the chunk where two chained tails really part."""

from __future__ import annotations

import random

import pytest

from mpcache.contract import tail_marks
from mpcache.contract.tail_marks import END_MARK_BITS, END_MARKS, FROM_START, MARK_BITS, pack, shared_chunks


def chained(rng: random.Random, parent: list[int], count: int) -> list[int]:
    """``count`` new chunk keys after ``parent``."""
    return [*parent, *(rng.getrandbits(64) for _ in range(count))]


def parting(rng: random.Random, length: int, at: int, other_length: int) -> tuple[list[int], list[int]]:
    """Two tails that share their first ``at`` chunks; each key after differs from the other's in every bit the
    marks read (a chance match is the one thing this leaves out)."""
    first = chained(rng, [], length)
    second = first[:at]
    for chunk in range(at, other_length):
        key = rng.getrandbits(64)
        if chunk < length:
            key = key & ~((1 << END_MARK_BITS) - 1) | (~first[chunk] & ((1 << END_MARK_BITS) - 1))
        second.append(key)
    return first, second


def test_the_marks_fill_the_mark_words_exactly():
    assert len(FROM_START) * MARK_BITS + END_MARKS * END_MARK_BITS == 64 * tail_marks.MARK_WORDS
    assert list(FROM_START) == sorted(set(FROM_START))


@pytest.mark.parametrize("at", [0, 1, 5, 15, 16, 17, 30, 47, 48, 50, 100, 111, 200])
def test_two_tails_of_one_length_are_found_to_part_where_they_do_at_the_last_chunks_and_near_it_elsewhere(at):
    """Where marks are a chunk apart, and at a tail's last chunks, the answer is exact; between sparser marks it
    is the middle of the two around the parting, never past the later one.  The lengths here are equal, so both
    tails' last chunks are marked at the same places."""
    rng = random.Random(at)
    length = 240
    for chunks in (at + 1, at + 3, length):
        first, second = parting(rng, chunks, at, chunks)
        got = shared_chunks(pack(second, 0, 1), chunks, pack(first, 0, 1), chunks)
        marked = sorted({c for c in FROM_START if c < chunks} | set(range(max(0, chunks - END_MARKS), chunks)))
        after = min(c for c in marked if c >= at)
        before = max((c + 1 for c in marked if c < at), default=0)
        assert (before + after) // 2 == got and before <= got <= after, (chunks, got)
        if at < 16 or at >= chunks - END_MARKS:
            assert got == at


def test_the_next_turn_of_a_conversation_shares_the_whole_last_tail():
    rng = random.Random(1)
    for last_length in (1, 9, 40, 130, 500):
        last = chained(rng, [], last_length)
        turn = chained(rng, last, rng.randint(1, 6))
        assert last_length == shared_chunks(pack(turn, 0, 1), len(turn), pack(last, 0, 1), last_length)


def test_a_document_asked_about_again_shares_all_but_its_question():
    """The same document behind the head key and a new one-chunk question: the last chunks' marks part them
    exactly, at any length of document (before end marks, 8 bits each, a 2-bit mark matched by chance one time
    in four and the question counted as shared)."""
    rng = random.Random(2)
    exact = 0
    for _ in range(400):
        document = chained(rng, [], rng.randint(20, 200))
        asked, again = chained(rng, document, 1), chained(rng, document, 1)
        exact += shared_chunks(pack(again, 0, 1), len(again), pack(asked, 0, 1), len(asked)) == len(document)
    assert exact >= 396  # a chance match at 8 bits: one in 256


def test_the_marks_are_the_first_rank_s_key_of_each_chunk_after_the_head():
    rng = random.Random(3)
    ranks, head = 4, 16
    keys = [rng.getrandbits(64) for _ in range((head + 30) * ranks)]
    firsts = keys[head * ranks::ranks]
    assert pack(keys, head * ranks, ranks) == pack(firsts, 0, 1)
    moved = list(keys)
    moved[(head + 3) * ranks + 1] ^= 3  # another rank's key: not marked
    assert pack(moved, head * ranks, ranks) == pack(keys, head * ranks, ranks)


def test_corrupt_words_and_counts_never_claim_more_than_the_shorter_tail():
    rng = random.Random(4)
    for _ in range(2000):
        words = [rng.choice((0, -1, 2**64 - 1, 2**70, rng.getrandbits(64))) for _ in range(rng.randint(0, 3))]
        last = [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
        chunks, last_chunks = rng.randint(-5, 300), rng.randint(-5, 300)
        assert 0 <= shared_chunks(words, chunks, last, last_chunks) <= max(0, min(chunks, last_chunks))
