"""The curves' Fenwick-tree steps: the compiled ``add``/``prefix`` (``_fenwick.c``) and their Python definition
leave the same trees and give the same sums and the same errors, and both equal plain prefix sums."""

from __future__ import annotations

import random
from array import array

import pytest

from mpcache.telemetry.mrc import fenwick

compiled = pytest.mark.skipif(not fenwick.COMPILED, reason="mpcache.telemetry.mrc._fenwick was not built")
WAYS = [pytest.param((fenwick.add_reference, fenwick.prefix_reference), id="python"),
        pytest.param((fenwick.add, fenwick.prefix), id="compiled", marks=compiled)]




@pytest.mark.parametrize("way", WAYS)
def test_prefix_sums_equal_the_plain_sums_of_the_values_added(way):
    """After random adds, every prefix is the plain sum of the values added at slots up to it."""
    add, prefix = way
    rng = random.Random(4)
    tree, values = array("q", bytes(8 * 65)), [0] * 65
    for _ in range(2000):
        slot, delta = rng.randrange(1, 65), rng.randrange(-10**12, 10**12)
        add(tree, slot, delta)
        values[slot] += delta
        probe = rng.randrange(0, 65)
        assert sum(values[1 : probe + 1]) == prefix(tree, probe)


def _outcome(call, *args):
    try:
        return call(*args)
    except (IndexError, OverflowError, TypeError) as exc:
        return type(exc)


@compiled
def test_the_compiled_steps_do_what_their_python_definition_does():
    """Random calls, in range and not (slots outside the tree, deltas and sums past int64): the same result
    or the same exception, and the same tree after each (an overflow changes nothing)."""
    rng = random.Random(8)
    big = (1 << 63) - 1
    trees = [array("q", bytes(8 * 33)) for _ in range(2)]
    for _ in range(5000):
        slot = rng.choice([rng.randrange(0, 33), -1, 33, 2**70])
        if rng.random() < 0.6:
            delta = rng.choice([rng.randrange(-1000, 1000), big, -big - 1, big + 1, big // 3])
            results = [_outcome(add, tree, slot, delta)
                       for add, tree in zip((fenwick.add_reference, fenwick.add), trees)]
        else:
            results = [_outcome(prefix, tree, slot)
                       for prefix, tree in zip((fenwick.prefix_reference, fenwick.prefix), trees)]
        assert results[0] == results[1] and trees[0] == trees[1]
    assert any(value != 0 for value in trees[0])


@compiled
@pytest.mark.parametrize("tree", [[0, 1, 2], array("i", [0, 1, 2]), array("d", [0.0, 1.0]), b"\0" * 16],
                         ids=["list", "int32", "double", "read-only bytes"])
def test_a_tree_that_is_not_a_writable_int64_array_is_a_type_error(tree):
    with pytest.raises(TypeError):
        fenwick.add(tree, 1, 1)
