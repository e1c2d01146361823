"""What admission by chance draws (:mod:`~mpcache.eviction.admission`), and the keys of refused stores that it and
admission on second sight remember: a store that names one of them again is its second sight."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from itertools import repeat

from mpcache.eviction.frequency import MIX, WORD


def draw(number: int) -> float:
    """``number``'s draw in [0, 1), the same in every run (the finaliser of splitmix64 over the number)."""
    mixed = (number * MIX) & WORD
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & WORD
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & WORD
    return (mixed ^ (mixed >> 31)) / 2.0 ** 64


class RefusedKeys:
    """The keys of refused stores and their bytes, newest last, within a bound in bytes."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, float] = OrderedDict()
        self._bytes = 0.0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def remember(self, refused: Sequence[Hashable], nbytes: Sequence[float] | float, bound: float) -> None:
        """``refused`` (each of ``nbytes``, or of its bytes in that sequence) become the newest; the oldest are
        forgotten while they hold more than ``bound``."""
        self.remember_pairs(zip(refused, repeat(nbytes) if isinstance(nbytes, (int, float)) else nbytes), bound)

    def remember_pairs(self, refused: Iterable[tuple[Hashable, float]], bound: float) -> None:
        """``refused`` (key, bytes) become the newest; the oldest are forgotten while they hold more than ``bound``."""
        keys = self._keys
        for key, size in refused:
            self._bytes += size - keys.pop(key, 0.0)
            keys[key] = size
        while keys and self._bytes > bound:
            self._bytes -= keys.popitem(False)[1]
        if not keys:  # float bytes (the curves' miniatures) leave a residue
            self._bytes = 0.0
