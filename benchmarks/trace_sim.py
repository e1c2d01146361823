"""Request traces of prefix block hashes (Mooncake's format, one JSON object a line: ``hash_ids``, one per
``BLOCK_TOKENS``-token block of the input, and ``input_length``) and their block-level simulation, offline:
LRU as mpcache's L1 does it, and Belady's MIN (evict the block used farthest in the future, or do not store
a block used later than every evictable one: the offline optimum for a cache of whole blocks); and ARC
(Megiddo and Modha's adaptive replacement cache, online, as LMCache ships it), touching a request's blocks
first to last or last to first (``tail_first``: a prefix's tail is then evicted before its head, which
the tail cannot be used without).

And W-TinyLFU (Caffeine's policy, online: a window LRU, then a segmented LRU that a block enters only if asked for
more often lately than what it would evict), the frequency-based policy of the state of the art.

All count a request's hit as its longest cached prefix, as a prefix lookup does.  A request's own blocks
are never evicted to make room for it (L1 locks the prefix it found and the blocks it is writing), and the
LRU order after a request is mpcache's: blocks present past the prefix, then the blocks stored, then the
prefix (its read locks are released last).  With one object size mpcache's L1 is exactly this LRU.
``tail_first`` puts a request's blocks into the order last to first instead, the head most recently used.
"""

from __future__ import annotations

import heapq
import json
import os
from collections import OrderedDict
from typing import NamedTuple

BLOCK_TOKENS = 512  # tokens per hash id in the trace format


class TraceRequest(NamedTuple):
    hashes: list[int]  # prefix block hashes, first to last, without repeats
    input_tokens: int


class Outcome(NamedTuple):
    """One policy's result over a trace: the prefix found per request, and its sums."""

    found: list[int]
    hit_ratio: float  # blocks found over blocks asked for
    tokens_saved: int  # prefill tokens found in cache: per request min(found × BLOCK_TOKENS, input tokens)


class TraceUnreadable(ValueError):
    """A trace file that cannot be read as a trace: the file, and the line with what is wrong in it."""


def load(path: str, limit: int | None = None) -> list[TraceRequest]:
    """The trace's first ``limit`` requests (all by default); a block repeated within a request counts once.
    :class:`TraceUnreadable` for a file that cannot be opened, is not UTF-8, or holds a line that is not a JSON
    object with ``hash_ids`` (block hashes: integers in 0..2**64-1) and, if given, ``input_length`` (a
    non-negative integer), or no request at all."""
    out: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if limit is not None and len(out) >= limit:
                    break
                if line.strip():
                    out.append(_request(line, f"{path}, line {number}"))
    except OSError as exc:
        raise TraceUnreadable(f"{path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceUnreadable(f"{path}: not UTF-8 text ({exc.reason})") from exc
    if not out:
        raise TraceUnreadable(f"{path}: no request in it")
    return out


def trace_name(path: str) -> str:
    """The name a trace file goes by in the benchmarks' tables: its file name without the extension."""
    return os.path.splitext(os.path.basename(path))[0]


def _request(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise TraceUnreadable(f"{where}: not JSON ({exc})") from exc
    except RecursionError:
        raise TraceUnreadable(f"{where}: JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise TraceUnreadable(f"{where}: a JSON {type(record).__name__}, not an object")
    hashes = record.get("hash_ids")
    if not isinstance(hashes, list) or not all(_is_u64(h) for h in hashes):
        raise TraceUnreadable(f"{where}: hash_ids must be a list of integers in 0..2**64-1, not {_brief(hashes)}")
    unique = list(dict.fromkeys(hashes))
    tokens = record.get("input_length", len(unique) * BLOCK_TOKENS)
    if not _is_u64(tokens):
        raise TraceUnreadable(f"{where}: input_length must be a non-negative integer, not {_brief(tokens)}")
    return TraceRequest(unique, tokens)


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 64  # bool is an int subclass: not a hash


def _brief(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def outcome(requests: list[TraceRequest], found: list[int]) -> Outcome:
    """Hit ratio and tokens saved of ``found`` (a prefix length per request)."""
    asked = sum(len(r.hashes) for r in requests) or 1
    saved = sum(min(f * BLOCK_TOKENS, r.input_tokens) for r, f in zip(requests, found))
    return Outcome(found, sum(found) / asked, saved)


def _prefix(hashes: list[int], cached) -> int:
    found = 0
    for h in hashes:
        if h not in cached:
            break
        found += 1
    return found


def lru(requests: list[TraceRequest], capacity: float, tail_first: bool = False) -> Outcome:
    """LRU over ``capacity`` blocks (``math.inf``: the infinite cache)."""
    order: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently used first
    found_per = []
    for request in requests:
        hashes = request.hashes
        found = _prefix(hashes, order)
        prefix, rest = hashes[:found], hashes[found:]
        for h in prefix:
            del order[h]
        present = [h for h in rest if h in order]
        for h in present:
            del order[h]
        held = found + len(present)
        stored: list[int] = []
        for h in rest:
            if h in order or h in present:
                continue
            if len(order) + held + len(stored) >= capacity:
                if not order:
                    break
                order.popitem(last=False)
            stored.append(h)
        if tail_first:
            kept = {*present, *stored, *prefix}
            touched = [h for h in reversed(hashes) if h in kept]
        else:
            touched = [*present, *stored, *prefix]
        for h in touched:
            order[h] = None
        found_per.append(found)
    return outcome(requests, found_per)


def _next_uses(requests: list[TraceRequest]) -> list[list[float]]:
    """Per request and block: the index of the next request that asks for that block (inf: none)."""
    upcoming: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        hashes = requests[index].hashes
        out[index] = [upcoming.get(h, float("inf")) for h in hashes]
        for h in hashes:
            upcoming[h] = index
    return out


def belady(requests: list[TraceRequest], capacity: float) -> Outcome:
    """Belady's MIN with bypass over ``capacity`` blocks."""
    next_use: dict[int, float] = {}  # cached block → the request that next asks for it
    heap: list[tuple[float, int]] = []  # (-next use, block), stale entries skipped
    found_per = []
    for request, uses in zip(requests, _next_uses(requests)):
        hashes = request.hashes
        found_per.append(_prefix(hashes, next_use))
        mine = set(hashes)
        for h, use in zip(hashes, uses):
            if h in next_use:
                next_use[h] = use
                heapq.heappush(heap, (-use, h))
        for h, use in zip(hashes, uses):
            if h in next_use or use == float("inf"):
                continue
            if len(next_use) >= capacity:
                aside = []
                victim = None
                while heap:
                    negative, candidate = heapq.heappop(heap)
                    if next_use.get(candidate) != -negative:
                        continue  # stale
                    if candidate in mine:
                        aside.append((negative, candidate))
                        continue
                    victim = (negative, candidate)
                    break
                for entry in aside:
                    heapq.heappush(heap, entry)
                if victim is None or -victim[0] <= use:  # nothing evictable, or every one is needed sooner
                    if victim is not None:
                        heapq.heappush(heap, victim)
                    continue
                del next_use[victim[1]]
            next_use[h] = use
            heapq.heappush(heap, (-use, h))
    return outcome(requests, found_per)


class _Arc:
    """ARC's four lists over ``capacity`` blocks: T1 (seen once) and T2 (seen again) cached, B1 and B2 their
    ghosts; ``target`` is T1's adaptive share.  A request's own blocks (``mine``) are never evicted."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.target = 0.0

    def __contains__(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def _replace(self, in_b2: bool, mine: set[int]) -> bool:
        """Evict one block to its ghost list, from T1 when it is over its share, else from T2."""
        first = (self.t1, self.b1), (self.t2, self.b2)
        if not (self.t1 and (len(self.t1) > self.target or (in_b2 and len(self.t1) == self.target))):
            first = first[::-1]
        for cached, ghosts in first:
            victim = next((block for block in cached if block not in mine), None)
            if victim is not None:
                del cached[victim]
                ghosts[victim] = None
                return True
        return False

    def _room(self, in_b2: bool, mine: set[int]) -> bool:
        return len(self.t1) + len(self.t2) < self.capacity or self._replace(in_b2, mine)

    def touch(self, block: int, mine: set[int]) -> None:
        """One access (a hit is promoted to T2; a miss is admitted if anything can make room)."""
        t1, t2, b1, b2, size = self.t1, self.t2, self.b1, self.b2, self.capacity
        if block in t1:
            del t1[block]
            t2[block] = None
        elif block in t2:
            t2.move_to_end(block)
        elif block in b1 or block in b2:
            in_b2 = block in b2
            if in_b2:
                self.target = max(0.0, self.target - max(len(b1) / len(b2), 1))
            else:
                self.target = min(size, self.target + max(len(b2) / len(b1), 1))
            if self._room(in_b2, mine):
                del (b2 if in_b2 else b1)[block]
                t2[block] = None
        else:
            if len(t1) + len(b1) >= size:
                if len(t1) < size:
                    b1.popitem(last=False)
                elif not self._evict_t1(mine):
                    return
            elif len(t1) + len(t2) + len(b1) + len(b2) >= 2 * size:
                (b2 or b1).popitem(last=False)
            if self._room(False, mine):
                t1[block] = None

    def _evict_t1(self, mine: set[int]) -> bool:
        victim = next((block for block in self.t1 if block not in mine), None)
        if victim is not None:
            del self.t1[victim]
        return victim is not None


def arc(requests: list[TraceRequest], capacity: float, tail_first: bool = False) -> Outcome:
    """ARC over ``capacity`` blocks, a request's blocks touched first to last (or last to first)."""
    return _replay(requests, _Arc(capacity), tail_first)


def _replay(requests: list[TraceRequest], cache: _Arc | _WTinyLfu, tail_first: bool) -> Outcome:
    """Each request's prefix found in ``cache``, then its blocks touched first to last (or last to first), each
    touch given the request's blocks (one set per request)."""
    found_per = []
    for request in requests:
        hashes = request.hashes
        found_per.append(_prefix(hashes, cache))
        mine = set(hashes)
        for block in reversed(hashes) if tail_first else hashes:
            cache.touch(block, mine)
    return outcome(requests, found_per)


TINYLFU_WINDOW = 0.01  # W-TinyLFU's admission window: its share of the capacity (Caffeine's default)
TINYLFU_PROTECTED = 0.8  # the main area's protected segment's share of it (Caffeine's)
TINYLFU_SAMPLE = 10  # counts between two halvings of the frequencies, per block of capacity (Caffeine's)


class _WTinyLfu:
    """W-TinyLFU (Einziger, Friedman and Manes, ACM ToS 2017; Caffeine's policy) over ``capacity`` blocks: a window
    LRU of :data:`TINYLFU_WINDOW` of it, then a segmented LRU (probation, and :data:`TINYLFU_PROTECTED` of the rest
    protected, where a block asked for again in probation goes); a block the window evicts enters the main area only
    if it was asked for more often lately than the block the main area would evict for it (probation's least
    recently used, else protected's).  Frequencies are exact counts halved every :data:`TINYLFU_SAMPLE` × capacity
    counts (an ideal sketch: no collisions).  A request's own blocks (``mine``) are never evicted; the blocks it
    stores pass through the window and the filter as any other (one refused is not stored).  It never holds more
    than ``capacity`` blocks."""

    def __init__(self, capacity: float) -> None:
        self.window_size = max(1, int(capacity * TINYLFU_WINDOW))
        self.main_size = capacity - self.window_size
        self.protected_size = int(self.main_size * TINYLFU_PROTECTED)
        self.window: OrderedDict[int, None] = OrderedDict()
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.frequency: dict[int, int] = {}
        self._counted = 0
        self._period = max(1.0, TINYLFU_SAMPLE * capacity)
        self._mine: set[int] = set()  # the current request's blocks, and those of them held when it came
        self._held: set[int] = set()

    def __contains__(self, block: int) -> bool:
        return block in self.window or block in self.probation or block in self.protected

    def _count(self, block: int) -> None:
        self.frequency[block] = self.frequency.get(block, 0) + 1
        self._counted += 1
        if self._counted >= self._period:
            self._counted = 0
            self.frequency = {key: count // 2 for key, count in self.frequency.items() if count > 1}

    def touch(self, block: int, mine: set[int]) -> None:
        """One access of the request whose blocks are ``mine``: counted; a hit is used again (from probation into
        protected); a miss enters the window, whose least recently used block but those held when the request came
        moves on to the main area."""
        if mine is not self._mine:  # the request's first touch: what it found or had is held for it
            self._mine, self._held = mine, {key for key in mine if key in self}
        held = self._held
        self._count(block)
        if block in self.window:
            self.window.move_to_end(block)
        elif block in self.probation:
            del self.probation[block]
            self.protected[block] = None
            while len(self.protected) > self.protected_size:
                self.probation[self.protected.popitem(last=False)[0]] = None
        elif block in self.protected:
            self.protected.move_to_end(block)
        else:
            self.window[block] = None
            while len(self.window) > self.window_size:
                candidate = next(key for key in self.window if key not in held)  # ``block`` is not held
                del self.window[candidate]
                self._admit(candidate, mine)

    def _admit(self, candidate: int, mine: set[int]) -> None:
        """The window's victim enters the main area where there is room, or where it was asked for more often than
        the block the main area would evict for it (which then goes); else it goes (a block the request stores is
        then not stored)."""
        if len(self.probation) + len(self.protected) < self.main_size:
            self.probation[candidate] = None
            return
        for segment in (self.probation, self.protected):
            victim = next((key for key in segment if key not in mine), None)
            if victim is not None:
                if self.frequency.get(candidate, 0) > self.frequency.get(victim, 0):
                    del segment[victim]
                    self.probation[candidate] = None
                return


def wtinylfu(requests: list[TraceRequest], capacity: float) -> Outcome:
    """W-TinyLFU over ``capacity`` blocks (:class:`_WTinyLfu`), a request's blocks touched last to first (a prefix's
    head most recently used, so that its tail goes first: better for it here than first to last)."""
    return _replay(requests, _WTinyLfu(capacity), True)


def lru_capacity_for(requests: list[TraceRequest], share: float, infinite: float) -> int:
    """The fewest blocks at which LRU's hit ratio reaches ``share`` of ``infinite`` (binary search)."""
    low, high = 1, max(1, len({h for r in requests for h in r.hashes}))
    while low < high:
        middle = (low + high) // 2
        if lru(requests, middle).hit_ratio >= share * infinite:
            high = middle
        else:
            low = middle + 1
    return low
