"""A lookup's miss-ratio event fields: the compiled ``head_fields`` (``_headfields.c``) and its Python
definition give the same tuple (or None) and raise the same errors on any input, and the tuple is the
event ``AccessSampler`` publishes."""

from __future__ import annotations

import random
import sys

import pytest

from mpcache.cache.mrc import headfields
from mpcache.contract.events import MRC_EXACT_GAP_SHIFT, MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS, SCHEMAS, EventType

compiled = pytest.mark.skipif(not headfields.COMPILED, reason="mpcache.cache.mrc._headfields was not built")
SLOTS, SHIFT = len(MRC_HEAD_FIELDS), MRC_EXACT_GAP_SHIFT


class Entry:
    def __init__(self, ready):
        self.ready = ready


class Refused(Exception):
    pass


def l1_of(held: dict) -> object:
    """An ``entry_of`` over ``held`` (key -> ready); key (…, 13) raises, as a broken lookup would."""
    def entry_of(key):
        if key[2] == 13:
            raise Refused(key)
        return Entry(held[key]) if key in held else None
    return entry_of




def test_the_reference_builds_the_event_a_reader_expects():
    """Three chunks of two ranks, one found: the first rank's key of each, zeros after them, L1 hits capped at
    found, and the gap bit of chunk 2, which L1 holds past the missing chunk 1."""
    hashes = [10, 11, 20, 21, 30, 31]
    held = {("m", "s", 30): True, ("m", "s", 20): False}
    fields = headfields.head_fields_reference("m", "s", hashes, 2, 5, 2, 16, SLOTS, SHIFT, l1_of(held))
    assert ("m", "s", 2, 2, 2, 3 | 1 << (SHIFT + 2), 0, 0, 0, 10, 20, 30, *[0] * (SLOTS - 3)) == fields


def _outcome(call, *args):
    try:
        return call(*args)
    except Refused as exc:
        return ("raised", exc.args)


@compiled
def test_the_compiled_builder_does_what_its_python_definition_does():
    """Random lookups, regular and not (too many chunks, counts negative, bools or floats, a tuple of hashes, a
    lookup that raises): the same tuple, None or exception from both."""
    rng = random.Random(11)
    odd = [-1, True, 2.0, None, 2**70]
    checked = {"tuple": 0, "none": 0, "raised": 0}
    for _ in range(20000):
        ranks = rng.choice([1, 1, 2, 3, rng.choice(odd + [0])])
        chunks = rng.randrange(0, 20)
        per_chunk = ranks if type(ranks) is int and 0 < ranks <= 3 else 1
        hashes = [rng.choice([13, rng.getrandbits(64), rng.randrange(40)]) for _ in range(chunks * per_chunk)]
        if rng.random() < 0.05:
            hashes.append(1)  # a partial chunk
        held = {("m", "s", h): rng.random() < 0.5 for h in hashes if rng.random() < 0.5}
        counts = [rng.choice([rng.randrange(0, len(hashes) + 3), rng.choice(odd)]) if rng.random() < 0.1
                  else rng.randrange(0, len(hashes) + 3) for _ in range(2)]
        exact = rng.choice([16, 16, rng.randrange(0, 17), 17])
        args = ("m", "s", tuple(hashes) if rng.random() < 0.02 else hashes, ranks, *counts, exact, SLOTS, SHIFT,
                l1_of(held))
        expected = _outcome(headfields.head_fields_reference, *args)
        assert expected == _outcome(headfields.head_fields, *args), args
        checked["tuple" if isinstance(expected, tuple) and expected[0] != "raised" else
                "raised" if isinstance(expected, tuple) else "none"] += 1
    assert min(checked.values()) > 100, checked


@compiled
def test_the_compiled_builder_keeps_every_reference_count():
    """Built and dropped 10,000 times, the hashes, names and entries it touched are referenced as before (and
    the keys a tail's marks read)."""
    hashes = [2**64 - 1 - i for i in range(8)]
    model, salt = "model-x", "salt-y"
    entry = Entry(True)
    held = {(model, salt, h): entry for h in hashes}
    before = [sys.getrefcount(h) for h in hashes] + [sys.getrefcount(model), sys.getrefcount(entry)]
    for _ in range(10000):
        headfields.head_fields(model, salt, hashes, 1, 3, 2, 16, SLOTS, SHIFT, held.get)
        headfields.tail_mark_words(hashes, 2, 1)
    assert before == [sys.getrefcount(h) for h in hashes] + [sys.getrefcount(model), sys.getrefcount(entry)]


def _marks_outcome(call, *args):
    try:
        return call(*args)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__


@compiled
def test_the_compiled_tail_marks_are_the_python_definitions():
    """Random tails, regular and not (any length and start, ranks of 1 to the largest, negative, huge, bool,
    numpy and non-integer keys, a negative start): the same mark words from the compiled call (or its None, for
    the Python definition to take) and from mpcache.contract.tail_marks.pack, or the same error from both."""
    import numpy as np

    from mpcache.cache.mrc._headfields import tail_marks as compiled_marks
    from mpcache.contract import tail_marks

    rng = random.Random(12)
    checked = {"words": 0, "TypeError": 0, "ValueError": 0, "left to Python": 0}
    for _ in range(5000):
        ranks = rng.choice([1, 1, 2, 4, sys.maxsize])
        keys = [rng.choice([rng.getrandbits(64), -rng.getrandbits(63), 2**70 + rng.getrandbits(8), 3, True,
                            np.uint64(rng.getrandbits(64)), np.int64(-rng.getrandbits(62))])
                for _ in range(rng.choice([0, rng.randrange(1, 40), rng.randrange(40, 900)]))]
        if keys and rng.random() < 0.2:  # read where it is marked, else not at all
            keys[rng.randrange(len(keys))] = rng.choice([2.0, None, "k"])
        start = rng.choice([0, 16, rng.randrange(0, len(keys) + 3), -1])
        expected = _marks_outcome(tail_marks.pack, keys, start, ranks)
        compiled = _marks_outcome(compiled_marks, keys, start, ranks, *headfields._MARK_LAYOUT)
        assert expected == (expected if compiled is None else compiled), (keys, start, ranks)
        assert expected == _marks_outcome(headfields.tail_mark_words, keys, start, ranks)
        checked[expected if isinstance(expected, str) else "words"] += 1
        checked["left to Python"] += compiled is None
        plain = all(type(key) is int for key in keys) and start >= 0
        assert compiled is not None or not plain, (keys, start, ranks)  # a plain list of ints is packed in C
    assert min(checked.values()) > 50, checked


@compiled
def test_the_compiled_tail_marks_hold_no_memory_after_they_return():
    """Called 20,000 times, the words it returns and the keys it reads are all it allocates: the traced memory
    does not grow (a reference kept to each answer would hold a few megabytes)."""
    import tracemalloc

    hashes = [2**64 - 1 - i for i in range(300)]
    for _ in range(100):
        headfields.tail_mark_words(hashes, 32, 2)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(20000):
        headfields.tail_mark_words(hashes, 32, 2)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 64 * 1024, grown


def test_a_lookup_of_head_chunks_publishes_the_builders_fields():
    """AccessSampler publishes exactly the builder's tuple for a lookup of head chunks only, its tail marks 0."""
    from mpcache.cache.mrc.accesses import AccessSampler

    class Recorder:
        emitted: list = []

        def emit(self, *args, **kwargs):
            raise AssertionError("a head-only lookup takes the fields emitter")

        def fields_emitter(self, etype):
            return lambda fields, session_id: self.emitted.append(fields)

    class L1:
        entry_of = staticmethod({("m", "s", 3): Entry(True)}.get)

    sampler = AccessSampler(Recorder(), 0.01)  # type: ignore[arg-type]
    sampler.lookup(L1(), "m", "s", [1, 2, 3], 1, 1, 1)  # type: ignore[arg-type]
    assert [(*headfields.head_fields_reference("m", "s", [1, 2, 3], 1, 1, 1, 16, SLOTS, SHIFT, L1.entry_of),
             *(0 for _ in MRC_TAIL_MARK_FIELDS))] == Recorder.emitted
    assert len(Recorder.emitted[0]) == len(SCHEMAS[EventType.MRC_LOOKUP_SAMPLED].fields)
    assert Recorder.emitted[0][5] == 3 | 1 << (SHIFT + 2)
