"""Tail marks: the low bits of a lookup's keys at chunks past its head chunks, so the telemetry process can tell
how much of a tail the next lookup under the same head key shares.  Keys chain their prefix, so two tails agree
at every chunk up to where they part and, after it, at a mark only by chance.

The marked chunks: fixed ones from the tail's start (where conversations behind a shared prompt part), and the
tail's last ones (where a document asked about again parts from its last question).  The cache process packs
them into ``MRC_LOOKUP_SAMPLED``'s mark words; the curves compare a lookup's marks with those of the head key's
last tail (:func:`shared_chunks`).
"""

from __future__ import annotations

from collections.abc import Sequence

MARK_WORDS = 2  # 64-bit words
MARK_BITS = 2  # of a chunk's key marked from the tail's start (its low bits): a chance match is one in four
END_MARKS, END_MARK_BITS = 4, 8  # the tail's last chunks marked, and their bits: a chance match is one in 256
MARKS_PER_STEP, STEPS = 16, (1, 2, 4)  # marked from the tail's start: 16 chunks a chunk apart, 16 two apart, 16 four


def _from_start() -> tuple[int, ...]:
    chunks, chunk = [], 0
    for step in STEPS:
        for _ in range(MARKS_PER_STEP):
            chunks.append(chunk)
            chunk += step
    return tuple(chunks)


FROM_START = _from_start()  # the tail chunks marked from its start (chunk 0: the first past the head)
_MARK_MASK, _END_MASK = (1 << MARK_BITS) - 1, (1 << END_MARK_BITS) - 1
_WORD_MASK = (1 << 64) - 1


def pack(hashes: Sequence[int], start: int, ranks: int) -> tuple[int, ...]:
    """The mark words of the tail of ``hashes`` (``ranks`` keys a chunk) that begins at ``start``: a chunk's mark
    is its first rank's key's low bits; the marks of ``FROM_START`` it has, then of its last ``END_MARKS``."""
    chunks = -(-(len(hashes) - start) // ranks)
    packed = shift = 0
    for chunk in FROM_START:
        if chunk >= chunks:
            break
        packed |= (hashes[start + chunk * ranks] & _MARK_MASK) << shift
        shift += MARK_BITS
    shift = MARK_BITS * len(FROM_START)
    for chunk in range(max(0, chunks - END_MARKS), chunks):
        packed |= (hashes[start + chunk * ranks] & _END_MASK) << (shift + END_MARK_BITS * (chunk - chunks + END_MARKS))
    return tuple(packed >> (64 * word) & _WORD_MASK for word in range(MARK_WORDS))


def _known(marks: Sequence[int], chunks: int) -> dict[int, tuple[int, int]]:
    """The marks a tail of ``chunks`` with mark words ``marks`` has, by chunk: (mark, its bits' mask)."""
    whole = 0
    for index, word in enumerate(marks[:MARK_WORDS]):
        whole |= (word & _WORD_MASK) << (64 * index)
    known = {chunk: (whole >> (MARK_BITS * index) & _MARK_MASK, _MARK_MASK)
             for index, chunk in enumerate(FROM_START) if chunk < chunks}
    base = MARK_BITS * len(FROM_START)
    for chunk in range(max(0, chunks - END_MARKS), chunks):
        known[chunk] = (whole >> (base + END_MARK_BITS * (chunk - chunks + END_MARKS)) & _END_MASK, _END_MASK)
    return known


def shared_chunks(marks: Sequence[int], chunks: int, last_marks: Sequence[int], last_chunks: int) -> int:
    """How many chunks, from its start, a tail of ``chunks`` with ``marks`` likely shares with the last one of
    ``last_chunks``: up to the first chunk both have a mark of and differ on (in the bits both have), the middle
    between it and the one before (exact where those are neighbours); where none differs, the shorter tail whole
    (the next turn of a conversation holds the last one).  Corrupt words can make the answer wrong, never more
    than the shorter tail."""
    shorter = max(0, min(chunks, last_chunks))
    mine, theirs = _known(marks, chunks), _known(last_marks, last_chunks)
    agreed = 0  # chunks known shared: those up to and with the last chunk both marks agree on
    for chunk in sorted(chunk for chunk in mine.keys() & theirs.keys() if chunk < shorter):
        (mark, mask), (last, last_mask) = mine[chunk], theirs[chunk]
        if (mark ^ last) & mask & last_mask:
            return (agreed + chunk) // 2
        agreed = chunk + 1
    return shorter
