"""Request traces of prefix block hashes (Mooncake's format, one JSON object a line: ``hash_ids``, one per
``BLOCK_TOKENS``-token block of the input, and ``input_length``) and their block-level simulation, offline:
LRU as mpcache's L1 does it, and Belady's MIN (evict the block used farthest in the future, or do not store
a block used later than every evictable one: the offline optimum for a cache of whole blocks).

Both count a request's hit as its longest cached prefix, as a prefix lookup does.  A request's own blocks
are never evicted to make room for it (L1 locks the prefix it found and the blocks it is writing), and the
LRU order after a request is mpcache's: blocks present past the prefix, then the blocks stored, then the
prefix (its read locks are released last).  With one object size mpcache's L1 is exactly this LRU.
"""

from __future__ import annotations

import heapq
import json
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


def load(path: str, limit: int | None = None) -> list[TraceRequest]:
    """The trace's first ``limit`` requests (all by default); a block repeated within a request counts once."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                record = json.loads(line)
                hashes = list(dict.fromkeys(int(h) for h in record["hash_ids"]))
                out.append(TraceRequest(hashes, int(record.get("input_length", len(hashes) * BLOCK_TOKENS))))
    return out


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


def lru(requests: list[TraceRequest], capacity: float) -> Outcome:
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
        for h in (*present, *stored, *prefix):
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
