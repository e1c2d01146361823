"""Fenwick-tree steps over an ``array('q')`` (slots 1..len-1): :func:`add` and :func:`prefix` are the
compiled ones (``_fenwick.c``) where they were built, else :func:`add_reference` and
:func:`prefix_reference`, the definition a differential test holds the compiled ones to.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

_LOW, _HIGH = -(1 << 63), (1 << 63) - 1


def add_reference(tree: array[int], slot: int, delta: int) -> None:
    """``tree[slot] += delta`` and up the tree; IndexError outside 1..len-1, OverflowError (tree unchanged)
    when a sum would leave int64."""
    size = len(tree) - 1
    if not 1 <= slot <= size:
        raise IndexError(f"slot {slot} is outside the tree (1..{size})")
    if not _LOW <= delta <= _HIGH:
        raise OverflowError("delta does not fit int64")
    steps = []
    while slot <= size:
        if not _LOW <= tree[slot] + delta <= _HIGH:
            raise OverflowError("a tree sum leaves int64")
        steps.append(slot)
        slot += slot & -slot
    for slot in steps:
        tree[slot] += delta


def prefix_reference(tree: array[int], slot: int) -> int:
    """The sum over slots 1..``slot`` (0: 0); IndexError outside 0..len-1, OverflowError when a partial sum
    leaves int64."""
    if not 0 <= slot <= len(tree) - 1:
        raise IndexError(f"slot {slot} is outside the tree (0..{len(tree) - 1})")
    total = 0
    while slot > 0:
        total += tree[slot]
        if not _LOW <= total <= _HIGH:
            raise OverflowError("the prefix sum leaves int64")
        slot -= slot & -slot
    return total


add: Callable[[array[int], int, int], None]
prefix: Callable[[array[int], int], int]
try:
    from mpcache.telemetry.mrc._fenwick import add, prefix
    COMPILED = True
except ImportError:  # no C compiler at install time
    add, prefix = add_reference, prefix_reference
    COMPILED = False
