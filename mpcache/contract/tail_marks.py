"""Tail marks: a few bits of a lookup's keys at chunks past its head chunks, so the telemetry process can tell how
much of a tail the next lookup under the same head key shares.  Keys chain their prefix, so two tails agree at
every chunk up to where they part and, after it, at a mark only by chance.

The marked chunks: fixed ones from the tail's start, every one at first and then further apart (where conversations
behind a shared prompt part), and the tail's last ones (where a document asked about again parts from its last
question).  A mark is the top bits of the key mixed (MurmurHash3's 64-bit finalizer), so keys that differ in a few
bits or by a constant (a client's counters) still mark apart.  The cache process packs them into
``MRC_LOOKUP_SAMPLED``'s mark words; the curves compare a lookup's marks with those of the head key's last tail
(:func:`shared_chunks`).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

MARK_WORDS = 2  # 64-bit words: the record's fixed fields stay within the compiled publisher's four cells
MARK_BITS = 2  # of a chunk marked from the tail's start: a chance match is one in four
END_MARKS, END_MARK_BITS = 4, 8  # the tail's last chunks marked, and their bits: a chance match is one in 256
DENSE, GEOMETRIC, GROWTH = 16, 32, 1.125  # from the start: every one of the first 16, then 32 each ⅛ further on
FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)  # MurmurHash3's fmix64 multipliers
_WORD = (1 << 64) - 1


def _from_start() -> tuple[int, ...]:
    chunks = list(range(DENSE))
    while len(chunks) < DENSE + GEOMETRIC:
        chunks.append(max(chunks[-1] + 1, round(chunks[-1] * GROWTH)))
    return tuple(chunks)


FROM_START = _from_start()  # the tail chunks marked from its start (chunk 0: the first past the head)
_PLACE = {chunk: index for index, chunk in enumerate(FROM_START)}
_END_SHIFT = MARK_BITS * len(FROM_START)  # where the end marks begin in the packed words


def mark(key: int, bits: int) -> int:
    """A key's mark of ``bits`` bits: the top bits of fmix64 of its low 64 (a key is read as its integer value,
    ``operator.index``)."""
    mixed = operator.index(key) & _WORD
    for multiplier in FMIX:
        mixed = ((mixed ^ (mixed >> 33)) * multiplier) & _WORD
    return (mixed ^ (mixed >> 33)) >> (64 - bits)


def pack(hashes: Sequence[int], start: int, ranks: int) -> tuple[int, ...]:
    """The mark words of the tail of ``hashes`` (``ranks`` keys a chunk) that begins at ``start``: each chunk
    marked by its first rank's key; the marks of ``FROM_START`` it has, then of its last ``END_MARKS``."""
    if start < 0 or ranks < 1:
        raise ValueError(f"a tail starts at 0 or later, with a rank or more a chunk (start {start}, ranks {ranks})")
    chunks = -(-max(0, len(hashes) - start) // ranks)
    packed = 0
    for index, chunk in enumerate(FROM_START):
        if chunk >= chunks:
            break
        packed |= mark(hashes[start + chunk * ranks], MARK_BITS) << (MARK_BITS * index)
    for chunk in range(max(0, chunks - END_MARKS), chunks):
        at = _END_SHIFT + END_MARK_BITS * (chunk - chunks + END_MARKS)
        packed |= mark(hashes[start + chunk * ranks], END_MARK_BITS) << at
    return tuple(packed >> (64 * word) & _WORD for word in range(MARK_WORDS))


def _whole(words: Sequence[int]) -> int:
    return sum((word & _WORD) << (64 * index) for index, word in enumerate(words[:MARK_WORDS]))


def _mark_at(whole: int, chunks: int, chunk: int) -> tuple[int, int] | None:
    """A tail's mark of ``chunk`` and its bits (an end mark where it has both), or None where it has none."""
    if chunks - END_MARKS <= chunk < chunks:
        at = _END_SHIFT + END_MARK_BITS * (chunk - chunks + END_MARKS)
        return whole >> at & (1 << END_MARK_BITS) - 1, END_MARK_BITS
    index = _PLACE.get(chunk)
    if index is None or chunk >= chunks:
        return None
    return whole >> (MARK_BITS * index) & (1 << MARK_BITS) - 1, MARK_BITS


def _differ(first: tuple[int, int], second: tuple[int, int]) -> bool:
    """Whether two marks of one chunk differ in the bits both have (the top ones)."""
    bits = min(first[1], second[1])
    return first[0] >> (first[1] - bits) != second[0] >> (second[1] - bits)


def shared_chunks(marks: Sequence[int], chunks: int, last_marks: Sequence[int], last_chunks: int) -> int:
    """How many chunks, from its start, a tail of ``chunks`` with mark words ``marks`` likely shares with the last
    one of ``last_chunks``: up to the first chunk both have a mark of and differ on, the middle between it and the
    one before both mark; where no mark differs, the shorter tail whole (the next turn of a conversation holds the
    last one).  A chance match (one in four) puts a parting one mark later.  Without both tails' words, none."""
    if len(marks) < MARK_WORDS or len(last_marks) < MARK_WORDS:
        return 0
    shorter = max(0, min(chunks, last_chunks))
    mine, theirs = _whole(marks), _whole(last_marks)
    placed = bisect.bisect_left(FROM_START, shorter)  # the marks from the start both have
    differ = (mine ^ theirs) & ((1 << (MARK_BITS * placed)) - 1)
    parting = FROM_START[((differ & -differ).bit_length() - 1) // MARK_BITS] if differ else shorter
    ends = sorted({*range(max(0, chunks - END_MARKS), chunks), *range(max(0, last_chunks - END_MARKS), last_chunks)})
    agreeing = []  # the chunks of the tails' last ones, before the parting, that both mark alike
    for chunk in ends:
        if chunk >= parting:
            break
        own, last = _mark_at(mine, chunks, chunk), _mark_at(theirs, last_chunks, chunk)
        if own is None or last is None:
            continue
        if _differ(own, last):
            parting = chunk
            break
        agreeing.append(chunk)
    if parting >= shorter:
        return shorter
    before = [FROM_START[index - 1]] if (index := bisect.bisect_left(FROM_START, parting)) else []
    agreed = max(before + agreeing) + 1 if before or agreeing else 0
    return (agreed + parting) // 2
