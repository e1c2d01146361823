"""The fields of a lookup's ``MRC_LOOKUP_SAMPLED`` event when every chunk is a head chunk — the common
lookup, whose event is fixed fields only: :func:`head_fields` is the compiled builder (``_headfields.c``)
where it was built, else :func:`head_fields_reference`, the definition a differential test holds it to —
and the marks of a lookup with a tail (:func:`tail_mark_words`, compiled there too).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from mpcache.contract import tail_marks

EntryOf = Callable[[tuple[str, str, int]], Any]


def head_fields_reference(model: str, salt: str, hashes: Sequence[int], ranks: int, l1_hits: int, found: int,
                          exact_chunks: int, head_slots: int, gap_shift: int,
                          entry_of: EntryOf) -> tuple[Any, ...] | None:
    """``(model, salt, ranks, found, min(l1_hits, found), exact | gap bits, 0, 0, 0, head_0 …)``: the first
    rank's key of each chunk, zeros up to ``head_slots``, bit ``gap_shift + i`` for each chunk i past the
    first missing one that ``entry_of`` says L1 holds (an entry whose ``ready`` is true).  None when it is
    not that case: ``hashes`` not a list, a count that is not a plain int in 0..sys.maxsize, ``ranks`` < 1, more
    head chunks asked for than slots, or chunks past the head (keys to sample: the caller's general path)."""
    counts = (ranks, l1_hits, found, exact_chunks, head_slots, gap_shift)
    if (type(hashes) is not list or any(type(count) is not int or not 0 <= count <= sys.maxsize for count in counts)
            or ranks < 1
            or exact_chunks > head_slots or gap_shift + head_slots > 62):
        return None
    exact = min(len(hashes) // ranks, exact_chunks)
    if exact * ranks != len(hashes):
        return None
    heads = list(hashes[::ranks][:exact])
    gap_mask = held_past_gap(model, salt, heads, found // ranks, gap_shift, entry_of)
    return (model, salt, ranks, found, min(l1_hits, found), exact | gap_mask, 0, 0, 0, *heads,
            *(0,) * (head_slots - exact))


def held_past_gap(model: str, salt: str, heads: Sequence[int], gap_chunk: int, gap_shift: int,
                  entry_of: EntryOf) -> int:
    """Bit ``gap_shift + i`` for each head chunk i past ``gap_chunk`` (the first missing one) that L1 holds:
    an ``entry_of`` entry whose ``ready`` is true."""
    mask, bit = 0, 1 << (gap_shift + gap_chunk + 1)
    for chunk_hash in heads[gap_chunk + 1 :]:
        entry = entry_of((model, salt, chunk_hash))
        if entry is not None and entry.ready:
            mask |= bit
        bit <<= 1
    return mask


def tail_mark_words(hashes: Sequence[int], start: int, ranks: int) -> tuple[int, ...]:
    """The mark words of the tail of ``hashes`` from ``start`` (:func:`mpcache.contract.tail_marks.pack`): in one
    compiled call where it was built and ``hashes`` is a list."""
    if _compiled_marks is not None:
        words = _compiled_marks(hashes, start, ranks, *_MARK_LAYOUT)
        if words is not None:
            return words
    return tail_marks.pack(hashes, start, ranks)


_MARK_LAYOUT = (tail_marks.FROM_START, tail_marks.MARK_BITS, tail_marks.END_MARKS, tail_marks.END_MARK_BITS,
                tail_marks.MARK_WORDS, tail_marks.FMIX)
HeadFields = Callable[[str, str, Sequence[int], int, int, int, int, int, int, EntryOf], "tuple[Any, ...] | None"]
head_fields: HeadFields
_compiled_marks: Callable[..., tuple[int, ...] | None] | None
try:
    from mpcache.cache.mrc._headfields import head_fields
    from mpcache.cache.mrc._headfields import tail_marks as _compiled_marks
    COMPILED = True
except ImportError:  # no C compiler at install time
    head_fields = head_fields_reference
    _compiled_marks = None
    COMPILED = False
