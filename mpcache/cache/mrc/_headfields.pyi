"""Type stub of the optional C extension ``mpcache.cache.mrc._headfields`` (``_headfields.c``).

What its PyMethodDef table defines.  Keep it in step with the C file.
"""

from collections.abc import Callable, Sequence
from typing import Any

def head_fields(
    model: str, salt: str, hashes: Sequence[int], ranks: int, l1_hits: int, found: int, exact_chunks: int,
    head_slots: int, gap_shift: int, entry_of: Callable[[tuple[str, str, int]], Any], /,
) -> tuple[Any, ...] | None: ...  # METH_FASTCALL
def tail_marks(
    hashes: Sequence[int], start: int, ranks: int, from_start: tuple[int, ...], mark_bits: int, end_marks: int,
    end_mark_bits: int, words: int, fmix: tuple[int, int], /,
) -> tuple[int, ...] | None: ...  # METH_FASTCALL
