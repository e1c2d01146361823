"""How often each key was asked for lately, in bounded memory: the ``adaptive`` order compares a store it would
admit with what that store would evict (TinyLFU's comparison, Einziger, Friedman and Manes).
:data:`FrequencySketch` is the compiled sketch (``_sketch.c``) where it was built, else
:class:`FrequencySketchReference`, the definition a differential test holds it to.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Hashable

SATURATED = 255  # a counter is one byte
MIN_WIDTH = 1024  # counters per row at the least
MAX_WIDTH = 1 << 32  # counters per row at the most: a row's index reads the mixed word's low 64 bits only
COUNTERS_PER_COUNT = 4  # a row's counters per count its window holds: few keys share both their counters
_HALF = bytes(count >> 1 for count in range(256))  # every counter halved, by bytearray.translate
ENDED = 1  # ``add``'s flag: the count ended a window
SAMPLED = 2  # ``add``'s flag: the key is sampled at ``sample_bits``
WORD = (1 << 64) - 1  # a mixed code is its product with MIX modulo 2 ** 64
MIX = 0x9E3779B97F4A7C15  # spreads a small integer's hash (its own value) over the bits an index or a sample reads


class FrequencySketchReference:
    """A count-min sketch: two rows of byte counters; a key is counted in one counter of each row (two parts of
    its mixed ``code``, by default its hash: a number that does not change between processes keeps the estimates,
    and what the order decides on them, the same from run to run) and its estimate is the smaller.  Once
    ``window`` counts are held every counter is halved (and so is what they hold), so what was asked for long ago
    fades; the owner sets the window again at each halving (a row has :data:`COUNTERS_PER_COUNT` counters per
    count: new, empty rows when it grows past them).  ``item``, instead of ``code``: a tuple key's item at that index
    is its code (the compiled sketch reads it without a call)."""

    def __init__(self, window: int, code: Callable[[Hashable], int] = hash, *, item: int | None = None) -> None:
        if not callable(code):
            raise TypeError("code must be callable")
        if item is not None:
            if code is not hash:
                raise TypeError("give code or item, not both")
            code = _item_code(item)
        self._code = code
        self._rows = (bytearray(0), bytearray(0))
        self._mask = -1
        self._counted = 0
        self.window = 0
        self._sample_bits = -1
        self.resize(window)

    def resize(self, window: int, /) -> None:
        """Halve once ``window`` counts are held (at least 1; past ``sys.maxsize`` clipped: a window that long never
        ends); rows too narrow for it are replaced by empty ones wide enough (on an error nothing changes)."""
        window = min(max(1, operator.index(window)), sys.maxsize)
        width = min(MAX_WIDTH, max(MIN_WIDTH, 1 << (COUNTERS_PER_COUNT * window - 1).bit_length()))
        if width > self._mask + 1:
            self._rows = (bytearray(width), bytearray(width))
            self._mask = width - 1
        self.window = window

    @property
    def sample_bits(self) -> int:
        """Which keys :meth:`add` says are sampled: -1 (at first) none, 0 every key, n (to 64) a key whose mixed
        word's top n bits are 0; another value is a ValueError (a TypeError for what is not an int)."""
        return self._sample_bits

    @sample_bits.setter
    def sample_bits(self, bits: int) -> None:
        if not isinstance(bits, int):
            raise TypeError("sample_bits must be an int")
        if not -1 <= bits <= 64:
            raise ValueError("sample_bits must be from -1 to 64")
        self._sample_bits = int(bits)

    def add(self, key: Hashable, /) -> int:
        """Counts ``key`` once.  Returns :data:`ENDED` where this count ended a window (every counter was halved),
        plus :data:`SAMPLED` where the key is sampled at ``sample_bits`` (a cheap test for a sampled simulation:
        the word is mixed here anyway)."""
        mixed = self._code(key) * MIX  # its low 64 bits are all a row's index reads: no mask to the word needed
        mask = self._mask
        first, second = self._rows
        index = mixed & mask
        count = first[index]
        if count < SATURATED:
            first[index] = count + 1
        index = (mixed >> 32) & mask
        count = second[index]
        if count < SATURATED:
            second[index] = count + 1
        bits = self._sample_bits
        flags = SAMPLED if bits >= 0 and not (mixed & WORD) >> (64 - bits) else 0
        counted = self._counted = self._counted + 1
        if counted < self.window:
            return flags
        self._rows = (first.translate(_HALF), second.translate(_HALF))
        self._counted >>= 1  # the counts halved: the next window ends sooner by what they still hold
        return flags | ENDED

    def estimate(self, key: Hashable, /) -> int:
        """How often ``key`` was counted lately (never less; more where other keys share both its counters)."""
        mixed = self._code(key) * MIX
        mask = self._mask
        return min(self._rows[0][mixed & mask], self._rows[1][(mixed >> 32) & mask])


def _item_code(item: int) -> Callable[[Hashable], int]:
    """The code of a key that is a tuple of more than ``item`` items: its item there, an int (else a TypeError, as a
    key of another kind; an ``item`` that is not an int is a TypeError, one below 0 a ValueError)."""
    if not isinstance(item, int):
        raise TypeError(f"item must be an int, not {type(item).__name__}")
    if not -sys.maxsize - 1 <= item <= sys.maxsize:
        raise OverflowError("Python int too large to convert to C ssize_t")
    if item < 0:
        raise ValueError("item must be 0 or more")

    def code(key: Hashable) -> int:
        if not isinstance(key, tuple) or len(key) <= item:
            raise TypeError(f"a key must be a tuple of more than {item} items")
        value = key[item]
        if not isinstance(value, int):
            raise TypeError(f"a key's code must be an int, not {type(value).__name__}")
        return value

    return code


FrequencySketch: type[FrequencySketchReference] | type[_sketch.FrequencySketch]
try:
    from mpcache.eviction import _sketch

    FrequencySketch = _sketch.FrequencySketch
    COMPILED = True
except ImportError:  # no C compiler at install time
    FrequencySketch = FrequencySketchReference
    COMPILED = False
