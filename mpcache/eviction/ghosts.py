"""ARC's ghost lists: B1 and B2 (tiers 0 and 1), the keys of objects evicted from T1 and T2, oldest first, with their
bytes.  A ghost is added at each eviction and trimmed at once (``arc``'s by ARC's own bounds, a call after each
eviction and each object placed), and a new key is looked up in them at each reservation: the ``adaptive`` order's
costliest bookkeeping per object, so :data:`GhostLists` is the compiled lists
(``_ghosts.c``) where they were built, else :class:`GhostListsReference`, the definition a differential test holds
them to.  A key is in one list at most; bytes are floats (a miniature's objects are fractions of a byte).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class GhostListsReference:
    """B1 and B2 in two ordered dicts (key → bytes, oldest first) and each list's bytes."""

    def __init__(self) -> None:
        self._lists: tuple[OrderedDict[Hashable, float], OrderedDict[Hashable, float]] = (OrderedDict(), OrderedDict())
        self._bytes = [0.0, 0.0]

    def tier(self, key: Hashable, /) -> int:
        """The list that holds ``key`` (0: B1, 1: B2), -1 where neither does."""
        b1, b2 = self._lists
        return 0 if key in b1 else 1 if key in b2 else -1

    def remove(self, key: Hashable, /) -> None:
        """``key`` leaves its list (a ghost hit); KeyError where it is no ghost."""
        for tier, ghosts in enumerate(self._lists):
            if key in ghosts:
                dropped = ghosts.pop(key)  # (before the sum is read: a key's __del__ may change the lists)
                self._bytes[tier] -= dropped
                return
        raise KeyError(key)

    def add(self, tier: int, key: Hashable, nbytes: float, bound: float, /) -> None:
        """``key`` of ``nbytes`` joins list ``tier`` as its newest (leaving the list that held it, if any); then, while
        both lists hold more than ``bound`` bytes, the oldest ghost of the one holding more (B2 on a tie) leaves."""
        tier, nbytes, bound = _checked(tier), _number(nbytes), _number(bound)
        if self.tier(key) >= 0:
            self.remove(key)
        lists, held = self._lists, self._bytes
        lists[tier][key] = nbytes
        held[tier] += nbytes
        while held[0] + held[1] > bound:
            larger = 0 if held[0] > held[1] else 1
            if not lists[larger]:
                larger = 1 - larger
                if not lists[larger]:
                    break  # both empty: a residue of float bytes is all that is left
            self._drop_oldest(larger)

    def trim_as_arc(self, t1: float, resident: float, capacity: float, /) -> None:
        """ARC's bounds, given T1's bytes and all resident bytes: while B1 holds a ghost and T1 + B1 exceed
        ``capacity``, B1's oldest leaves; then while a ghost is left and resident + B1 + B2 exceed twice it, B2's
        oldest (B1's where B2 is empty) leaves."""
        t1, resident, capacity = _number(t1), _number(resident), _number(capacity)
        lists, held = self._lists, self._bytes
        while lists[0] and t1 + held[0] > capacity:
            self._drop_oldest(0)
        while (lists[0] or lists[1]) and resident + held[0] + held[1] > 2 * capacity:
            self._drop_oldest(1 if lists[1] else 0)

    def _drop_oldest(self, tier: int) -> None:
        """The oldest ghost of list ``tier`` leaves, its bytes off the list's once its key is gone (so a key's
        ``__del__`` that changes the lists runs before that sum is read)."""
        key, nbytes = self._lists[tier].popitem(False)
        del key
        self._bytes[tier] -= nbytes

    def nbytes(self, tier: int, /) -> float:
        """The bytes list ``tier``'s ghosts stand for."""
        return self._bytes[_checked(tier)]

    def count(self, tier: int, /) -> int:
        """The ghosts list ``tier`` holds."""
        return len(self._lists[_checked(tier)])

    def keys(self, tier: int, /) -> list[Hashable]:
        """List ``tier``'s keys, oldest first (a copy)."""
        return list(self._lists[_checked(tier)])

    def __contains__(self, key: object) -> bool:
        b1, b2 = self._lists
        return key in b1 or key in b2

    def __len__(self) -> int:
        return len(self._lists[0]) + len(self._lists[1])


def _checked(tier: int) -> int:
    """``tier`` where it names a list (0 or 1), else ValueError."""
    if type(tier) is not int or tier not in (0, 1):
        raise ValueError(f"tier must be 0 or 1, not {tier!r}")
    return tier


def _number(value: float) -> float:
    """``value`` as a float as C's ``PyFloat_AsDouble`` takes it: a float's own value (a subclass's ``__float__`` not
    called), else through ``__float__`` or ``__index__``; TypeError for anything else (a string or buffer too)."""
    if isinstance(value, float):
        return float.__float__(value)
    kind = type(value)
    if not (hasattr(kind, "__float__") or hasattr(kind, "__index__")):
        raise TypeError(f"must be real number, not {kind.__name__}")
    return float(value)


GhostLists: type[GhostListsReference] | type[_ghosts.GhostLists]
try:
    from mpcache.eviction import _ghosts

    GhostLists = _ghosts.GhostLists
    COMPILED = True
except ImportError:  # no C compiler at install time
    GhostLists = GhostListsReference
    COMPILED = False
