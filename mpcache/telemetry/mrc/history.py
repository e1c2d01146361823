"""One cache process's sampled history (``docs/MRC.md``): its L1 is a cache of its own, so each process's keys
get their own byte-weighted LRU stack (or miniature caches), and a key counts as stored where that process
stored it.

Two strata of keys: a lookup's first chunks, all of them, and every other chunk whose hash passes the sampling
rule.  Each stratum keeps at most half of the history's key budget: past it, its threshold drops to its
largest tracked hash value and the keys at or above it go (SHARDS' fixed-size mode).  An access's reuse
distance is the bytes above it in the stack, each stratum's scaled by 1 / its rate, plus its own.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpcache.contract import tail_marks
from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.eviction.admission import TRIAL_HALVINGS
from mpcache.telemetry import statecheck
from mpcache.telemetry.mrc import spline
from mpcache.telemetry.mrc.mini import MiniCache
from mpcache.telemetry.mrc.stack import ReuseStack

FORGOTTEN_PER_KEY = 2  # stored keys pruned for depth remembered: up to 2 × max_keys (at least max_keys)
MAX_KEY_BYTES = 1 << 40  # a key's bytes at most (a corrupt size cannot overflow the stack's int64 sums)
HEAD, SAMPLED = 0, 1  # the strata: a lookup's first chunks, and the hash-sampled rest
# Two more places a key can sit in the stack: a hash-sampled key that its head key's tail stands for (COVERED,
# its bytes counted there), and that tail itself (TAIL: two keys per head key, the bytes of its last tail)
COVERED, TAIL = 2, 3
_TAIL_KEY_OFFSET = 1 << 64  # a tail key's hash: below zero, where no chunk's is (never checkpointed)
TAIL_MAX_RATE = 0.05  # above this rate of the hash-sampled stratum, its keys alone judge a tail
SEGMENT = "tail"  # a miniature's key for a run of tail objects: (SEGMENT, number), no chunk's key
SEGMENT_PIECES = 16  # a tail's new objects: in up to 16 segments of at least one object and at least 1 / 512 of
SEGMENT_MIN_SHARE = 512  # the smallest miniature's capacity (so a miniature holds at most 512 × its ratio to it)
SEGMENTS_PER_HEAD = 64  # at most, per head key (then the two next to each other of fewest objects become one)
L1_HIT, L2_HIT, AFTER_GAP, MISS = "l1", "l2", "after_gap", "miss"  # what a lookup found of one key

Row = tuple[int, str, str]  # (chunk_hash, cache_salt, model_name), as producers ship sampled keys
Access = tuple[Row, int, str, int]  # (key, stratum, what the lookup found, objects it stands for)
# What a lookup's judged key adds to its curves: (weight, what the lookup found, bucket of its distance or
# None, the (edge index, change in hits) a miniature simulation gives, or None)
Judged = tuple[float, str, "int | None", "list[tuple[int, float]] | None"]
JudgedKey = tuple[Row, int, int, float, str]  # a lookup's sampled key judged: (key, stratum, objects, weight, found)


def _sampling(stack_stratum: int) -> int:
    """The sampling stratum of a key in ``stack_stratum``."""
    return SAMPLED if stack_stratum == COVERED else stack_stratum


def _tail_keys(head: Row) -> tuple[Row, Row]:
    """The two stack keys carrying the bytes of ``head``'s last tail: its first half and the rest."""
    return (-1 - head[0], head[1], head[2]), (-1 - _TAIL_KEY_OFFSET - head[0], head[1], head[2])


def imputed(edges: list[int], base: float, previous: int, common: int, segments: Sequence[tuple[int, str]],
            size: int) -> list[Judged]:
    """The tail objects of a lookup, ``segments`` of (how many, what the lookup found of them) in order, judged
    from the head key's last tail of ``previous`` objects, of which the first ``common`` are this one's too: its
    object j (from 1) was touched ``previous - j`` objects before the tail's end, ``base`` bytes ago, so its
    distance is ``base + (previous - j + 1) × size``; one past ``common`` is judged a miss (beyond every edge)
    here, and by the sampled keys there."""
    out: list[Judged] = []
    beyond, start = len(edges), 1
    for count, found in segments:
        low, high = start, start + count - 1
        start += count
        last = min(high, common) if size > 0 else low - 1  # the objects with a distance: low..last
        position = last
        while position >= low:  # the distance falls as the position rises: one run of positions per bucket
            bucket = bisect.bisect_left(edges, base + (previous - position + 1) * size)
            first = low if bucket == beyond else max(low, min(position, previous + 1 - int((edges[bucket] - base)
                                                                                           // size)))
            out.append((float(position - first + 1), found, bucket, None))
            position = first - 1
        if high > max(last, low - 1):
            out.append((float(high - max(last, low - 1)), found, beyond, None))
    return out


def _found_in(tail: int, tail_found: tuple[int, int]) -> tuple[int, int]:
    """Of a lookup's ``tail`` objects, how many it found in L1 and in L2 (``tail_found`` as the event says,
    clamped to the tail)."""
    in_l1 = max(0, min(tail, tail_found[0]))
    return in_l1, max(0, min(tail - in_l1, tail_found[1]))


def _tail_segments(tail: int, tail_found: tuple[int, int]) -> tuple[tuple[int, str], ...]:
    """A lookup's ``tail`` objects as (how many, what the lookup found of them), in order: L1 hits, L2 hits,
    misses."""
    in_l1, in_l2 = _found_in(tail, tail_found)
    return (in_l1, L1_HIT), (in_l2, L2_HIT), (tail - in_l1 - in_l2, MISS)


class TailSeen:
    """What a head key knows of the last tail after it: its objects, marks (:mod:`mpcache.contract.tail_marks`)
    and tracked sampled keys."""

    __slots__ = ("objects", "marks", "keys", "segments")

    def __init__(self, objects: int, marks: Sequence[int], keys: list[Row]) -> None:
        self.objects, self.marks, self.keys = objects, marks, keys
        self.segments: list[tuple[Hashable, int]] = []  # under a miniature: the last tail's (key, objects)

    def common(self, objects: int, marks: Sequence[int], ranks: int) -> int:
        """The objects a tail of ``objects`` (``ranks`` a chunk) with ``marks`` likely shares with the last one,
        from its start: the chunks their marks say they share."""
        ranks = max(1, ranks)
        chunks = tail_marks.shared_chunks(marks, -(-objects // ranks), self.marks, -(-self.objects // ranks))
        return max(0, min(objects, self.objects, chunks * ranks))


@dataclass(slots=True)
class _Judgment:
    """A lookup's sampled keys as judged before any is touched (:meth:`History._judge`)."""

    keys: list[JudgedKey] = field(default_factory=list)
    curve: list[Judged] = field(default_factory=list)  # under the stack: what they add to the curves
    reasons: list[tuple[str, bool, float]] = field(default_factory=list)  # (found, stored before, weight)
    head: Row | None = None  # the last head chunk's key: the prefix every tail object chains
    uncovered: list[tuple[float, str]] = field(default_factory=list)  # the sampled tail keys its last tail lacked
    held: set[Row] = field(default_factory=set)  # and those it held


class Stratum:
    """One stratum's sampling threshold (in units of ``1/P``) and its tracked keys, largest hash first."""

    def __init__(self, rate: float, budget: int) -> None:
        self.threshold = rate * SAMPLE_MODULUS
        self.budget = budget
        self.heap: list[tuple[int, Row]] = []
        self.keys = 0

    @property
    def rate(self) -> float:
        return self.threshold / SAMPLE_MODULUS

    def admits(self, row: Row) -> bool:
        return row[0] % SAMPLE_MODULUS < self.threshold


class History:
    """The keys one cache process touched: ``edges`` are the capacities (of that process's share of a tier) the
    curves are read at; ``policy`` the order its L1 runs (LRU from the stack, any other by a miniature at each of
    ``mini_edges``, a subset of ``edges``, the others interpolated); ``stored`` the tracked keys known stored
    there (a store named them, or a lookup found them)."""

    def __init__(self, sample_rate: float, max_keys: int, edges: list[int], policy: str,
                 mini_edges: list[int] | None = None, trial: int | None = TRIAL_HALVINGS,
                 first_sight: bool = True) -> None:
        self.max_keys = max_keys
        self.edges = edges
        self.strata = (Stratum(1.0, max_keys // 2), Stratum(sample_rate, max_keys - max_keys // 2))
        self.stack = ReuseStack(max_keys + 2, strata=4)
        self.mini_edges = sorted(set(edges if mini_edges is None else mini_edges))
        self.minis = None if policy == "lru" else [MiniCache(policy, edge, trial, first_sight)
                                                     for edge in self.mini_edges]
        self._spread = spline.spread(edges, self.mini_edges)
        self.stored: set[Row] = set()
        self.tails: dict[Row, TailSeen] = {}
        self._segment = 0  # the last tail segment's number (a miniature's key for a tail's objects)
        self.forgotten: dict[Row, None] = {}  # the stored keys pruned for depth, oldest first

    def lookup(self, accesses: Sequence[Access], size: int, tail: int = 0, tail_found: tuple[int, int] = (0, 0),
               marks: Sequence[int] = (), ranks: int = 1) -> tuple[list[Judged], list[tuple[str, bool, float]]]:
        """One lookup's sampled keys, in order (objects of ``size`` bytes): what each adds to the curves, and
        (found, stored before, weight) of each for the miss reasons.  Every key's distance is taken before any
        is touched (a hit evicts nothing, so within a lookup no key's presence depends on another's); then all
        of them become the most recently used, as the hits are and as the engine's store of the misses makes
        the rest.  Only a store, or a lookup that found it, makes a key stored.

        ``tail``: the objects past the head chunks (``tail_found``: how many of them the lookup found in L1, and
        in L2; ``marks``: the tail's marks, ``ranks`` objects a chunk).  Only their hash-sampled keys are seen,
        but every one of them chains the last head key's prefix, so each is judged from that key's last tail
        (:func:`imputed`), its bytes sit in the stack as that key's tail keys, and a sampled key corrects the
        judgment (× 1 / rate) only where it was not in that tail.  How much of the last tail a tail keeps (from
        its start) its marks say (:class:`TailSeen`): a document asked about again keeps all but its question,
        a system prompt shared by many conversations next to nothing."""
        if not 0 < self.strata[SAMPLED].threshold <= TAIL_MAX_RATE * SAMPLE_MODULUS:
            tail = 0  # a sample this dense judges the tail well by itself (at rate 1 exactly); none, not at all
        weights = self.weights()
        depth = self._depth_weights(weights)
        judgment = self._judge(accesses, tail, weights, depth)
        common = 0
        seen = self.tails.get(judgment.head) if tail > 0 and judgment.head is not None else None
        if seen is not None:
            common = seen.common(tail, marks, ranks)
        curve, segments = self._contributions(judgment, size, tail, tail_found, weights, depth, common)
        self._touch_keys(judgment, size, tail, segments, marks)
        return curve, judgment.reasons

    def _judge(self, accesses: Sequence[Access], tail: int, weights: list[float], depth: list[float]) -> _Judgment:
        """Each sampled key its stratum (the one it sits in, if tracked) still admits, judged where it sits before
        any is touched: its weight, whether it was stored (the miss reasons) and, under the stack, its distance's
        bucket.  With a tail, a hash-sampled key the head key's last tail held counts there (``held``); one it
        did not hold is ``uncovered``, judged where it sits, its imputed miss taken back (:meth:`_tail`)."""
        stack, thresholds = self.stack, [stratum.threshold for stratum in self.strata]
        judgment = _Judgment()
        for row, stratum, found, objects in accesses:
            if stratum == HEAD:
                judgment.head = row
            entry = stack.get(row)
            covered = entry is not None and entry[2] == COVERED
            if entry is not None:
                stratum = _sampling(entry[2])
            if stratum == TAIL or not row[0] % SAMPLE_MODULUS < thresholds[stratum]:
                continue
            weight = weights[stratum] * objects
            in_tail = tail > 0 and stratum == SAMPLED
            if in_tail and covered:
                judgment.held.add(row)
            else:
                if in_tail:
                    judgment.uncovered.append((weight, found))
                if self.minis is None:
                    bucket = len(self.edges) if entry is None else bisect.bisect_left(
                        self.edges, stack.weighted_above(entry[0], depth) + entry[1])
                    judgment.curve.append((weight, found, bucket, None))
            stored = row in self.stored or (bool(self.forgotten) and row in self.forgotten)
            judgment.reasons.append((found, stored, weight))
            judgment.keys.append((row, stratum, objects, weight, found))
        return judgment

    def _contributions(self, judgment: _Judgment, size: int, tail: int, tail_found: tuple[int, int],
                       weights: list[float], depth: list[float],
                       common: int) -> tuple[list[Judged], list[tuple[Hashable, int]]]:
        """What the judged keys and the tail add to the curves, and the segments the tail left in the miniatures:
        the miniatures simulate the lookup (:meth:`_simulate_tail`, :meth:`_simulate`); under the stack the keys
        are judged already and the tail's objects are imputed (:meth:`_tail`).  ``common``: the tail's objects
        the head key's last tail held too.  Before the model's object size is known (``size`` 0: its first store
        names it, and nothing of the model is stored before it) every key and tail object is a miss at every
        capacity, and the miniatures take none: a key they stored would stand for no bytes for as long as they
        held it."""
        if self.minis is not None and size <= 0:
            beyond = len(self.edges)
            heads = judgment.keys if tail <= 0 else [key for key in judgment.keys if key[1] == HEAD]
            return [(weight, found, beyond, None) for _, _, _, weight, found in heads] + imputed(
                self.edges, 0.0, 0, 0, _tail_segments(tail, tail_found), size), []
        if self.minis is not None and tail > 0:
            return self._simulate_tail(judgment.keys, judgment.held, judgment.head, tail, tail_found, size, weights,
                                       common)
        if self.minis is not None:
            return self._simulate([(row, min(size * objects, MAX_KEY_BYTES) * weights[stratum], weight, found)
                                   for row, stratum, objects, weight, found in judgment.keys]), []
        if tail > 0:
            return judgment.curve + self._tail(judgment.head, tail, tail_found, size, depth, judgment.uncovered,
                                               common), []
        return judgment.curve, []

    def _touch_keys(self, judgment: _Judgment, size: int, tail: int, segments: list[tuple[Hashable, int]],
                    marks: Sequence[int]) -> None:
        """The judged keys become the most recently used in the engine's order: the head keys, the first half of
        the tail's bytes (the head key's first tail key), the hash-sampled keys, the rest; the head key then
        stands for this tail of ``marks`` (:meth:`_cover`), or, with none or the head key no longer tracked, for
        none."""
        stack, head = self.stack, judgment.head
        for row, stratum, objects, _, found in judgment.keys:
            if stratum == HEAD:
                self._touch_judged(row, HEAD, min(size * objects, MAX_KEY_BYTES), size, found)
        cover = head if tail > 0 and size > 0 and head is not None and head in stack else None
        if cover is not None:
            stack.touch(_tail_keys(cover)[0], min(tail // 2 * size, MAX_KEY_BYTES), TAIL)
        tracked = []
        for row, stratum, objects, _, found in judgment.keys:
            if stratum != HEAD and self._touch_judged(row, stratum, min(size * objects, MAX_KEY_BYTES), size,
                                                      found):
                tracked.append(row)
        if cover is not None and cover in stack:
            stack.touch(_tail_keys(cover)[1], min((tail - tail // 2) * size, MAX_KEY_BYTES), TAIL)
            self._cover(cover, tail, marks, tracked, segments)
        elif head is not None and head in self.tails:
            self._untail(head)

    def _cover(self, head: Row, tail: int, marks: Sequence[int], keys: list[Row],
               segments: list[tuple[Hashable, int]]) -> None:
        """``head``'s last tail is now one of ``tail`` objects with ``marks`` whose tracked hash-sampled keys are
        ``keys`` (and, under the miniatures, ``segments``): they count as covered (its tail keys hold their
        bytes), and those of the tail before that this one lacks count again."""
        seen = self.tails.get(head)
        old = seen.keys if seen is not None else []
        if seen is None:
            seen = self.tails[head] = TailSeen(tail, marks, keys)
        else:
            seen.objects, seen.marks, seen.keys = tail, marks, keys
        if self.minis is not None:
            seen.segments = segments
        now = set(keys)
        for row in keys:
            self.stack.restratum(row, COVERED)
        for row in old:
            if row not in now and self.stack.stratum_of_or(row) == COVERED:
                self.stack.restratum(row, SAMPLED)

    def _touch_judged(self, row: Row, stratum: int, nbytes: int, size: int, found: str) -> bool:
        """A judged key becomes the most recently used (a new one inserted); whether it is tracked now."""
        stack = self.stack
        entry = stack.get(row)  # a key an earlier insert of this loop made the stack forget is inserted anew
        if entry is not None:  # a head key's size follows its model's (a sampled key's comes with its stores)
            stack.touch(row, nbytes if entry[2] == HEAD and size else entry[1], entry[2])  # a key keeps its stratum
        elif self.strata[stratum].admits(row):  # an earlier insert may have lowered the threshold past it
            self._insert(row, nbytes, stratum)
        else:
            return False
        tracked = row in stack  # (the insert may have lowered the threshold past the key itself: not tracked)
        if found != MISS and tracked:  # found in a tier, or held past the gap: stored here
            self.stored.add(row)
        return tracked

    def _tail(self, head: Row | None, tail: int, tail_found: tuple[int, int], size: int, depth: list[float],
              uncovered: list[tuple[float, str]], common: int) -> list[Judged]:
        """What a lookup's ``tail`` objects add to its curves: each judged from ``head``'s last tail (its first
        ``common`` objects as that tail's; the rest a miss), less, for each of the ``uncovered`` sampled keys
        ((weight, found): judged where they are), its weight as a miss."""
        previous, base = 0, 0.0
        seen = self.tails.get(head) if head is not None else None
        second = self.stack.get(_tail_keys(head)[1]) if seen is not None and head is not None else None
        if seen is not None and second is not None:
            previous = seen.objects
            base = self.stack.weighted_above(second[0], depth)
        else:
            common = 0
        out = imputed(self.edges, base, previous, common, _tail_segments(tail, tail_found), size)
        beyond = len(self.edges)
        return out + [(-weight, found, beyond, None) for weight, found in uncovered]

    def _untail(self, head: Row) -> None:
        """``head`` no longer stands for a tail: its tail keys go, and the sampled keys it covered count again."""
        seen = self.tails.pop(head, None)
        for key in _tail_keys(head):
            self.stack.remove(key)
        for row in seen.keys if seen is not None else ():
            if self.stack.stratum_of_or(row) == COVERED:
                self.stack.restratum(row, SAMPLED)

    def _simulate_tail(self, judged: list[JudgedKey], held: set[Row], head: Row | None,
                       tail: int, tail_found: tuple[int, int], size: int, weights: list[float],
                       common: int) -> tuple[list[Judged], list[tuple[Hashable, int]]]:
        """A lookup with a tail through the miniatures: its tail's bytes as segments after ``head`` (the last
        tail's segments that hold the ``common`` objects this one shares with it, the one shared in part standing
        for that part now, then the new objects in up to ``SEGMENT_PIECES``: a segment is a key of 1 - rate of
        its objects' bytes, so a miniature keeps or evicts it whole; past ``SEGMENTS_PER_HEAD``, the two next to
        each other of fewest objects merge in every miniature, so no segment grows far past the others), each
        tail object judged by its segment; its hash-sampled keys go in at their own bytes (not × 1 / rate: the
        segments hold the tail's), for their place in the order, and those the last tail did not hold (not in
        ``held``) count where they are, × 1 / rate, in place of a miss.  Returns the judgments and the tail's
        segments (key, objects)."""
        seen = self.tails.get(head) if head is not None else None
        ranges: list[tuple[Hashable, int, int, int]] = []  # (segment, its objects, first and last one it judges)
        end = 0
        for key, objects in seen.segments if seen is not None else ():
            if end >= min(common, tail):
                break
            # a segment shared in part stands for that part now (its bytes in the miniatures stay: L1 holds the
            # last tail's other objects too)
            shared = min(objects, common - end, tail - end)
            ranges.append((key, shared, end + 1, end + shared))
            end += shared
        # the first new segment's index: no merge joins it to the last shared one (the new objects, never seen,
        # would be judged by whether the miniature holds that one)
        new = len(ranges)
        # size > 0 here: a lookup before the model's size is known never reaches the miniatures
        least = max(1, int(self.mini_edges[0] // (size * SEGMENT_MIN_SHARE))) if self.mini_edges else 1
        step = max(least, -(-(tail - end) // SEGMENT_PIECES))
        while tail > end:  # the new objects in pieces (a miniature evicts a piece whole)
            self._segment += 1
            objects = min(step, tail - end)
            ranges.append(((SEGMENT, self._segment), objects, end + 1, end + objects))
            end += objects
        share = 1.0 - 1.0 / weights[SAMPLED]  # of the tail's bytes: the sampled keys bring the rest
        while len(ranges) > SEGMENTS_PER_HEAD:  # two as one (under the first's key: not a miss of what it holds)
            at = min((i for i in range(len(ranges) - 1) if i != new - 1),
                     key=lambda i: ranges[i][1] + ranges[i + 1][1])
            (key, objects, first, _), (other, more, _, last) = ranges[at:at + 2]
            for mini in self.minis or ():
                mini.merge(key, other, float(min(more * size, MAX_KEY_BYTES)) * share)
            ranges[at:at + 2] = [(key, objects + more, first, last)]
            new -= at < new - 1
        in_l1, in_l2 = _found_in(tail, tail_found)
        keys: list[tuple[Hashable, float, float, str]] = [
            (row, min(size * objects, MAX_KEY_BYTES) * weights[stratum], weight, found)
            for row, stratum, objects, weight, found in judged if stratum == HEAD]
        for key, objects, first, last in ranges:
            nbytes = float(min(objects * size, MAX_KEY_BYTES)) * share
            for low, high, found in ((1, in_l1, L1_HIT), (in_l1 + 1, in_l1 + in_l2, L2_HIT),
                                     (in_l1 + in_l2 + 1, tail, MISS)):
                part = min(high, last) - max(low, first) + 1
                if part > 0:
                    keys.append((key, nbytes, float(part), found))
        sampled = [(row, weight, found) for row, stratum, _, weight, found in judged if stratum != HEAD]
        keys += [(row, float(size), weight, found) for row, weight, found in sampled]
        out = self._simulate(keys)
        beyond, judged_sampled = len(self.edges), out[len(out) - len(sampled):]
        out = out[: len(out) - len(sampled)]
        for (row, weight, found), one in zip(sampled, judged_sampled):
            if row not in held:
                out += [one, (-weight, found, None, [(beyond, -weight)])]
        return out, [(key, objects) for key, objects, _, _ in ranges]

    def _simulate(self, keys: list[tuple[Hashable, float, float, str]]) -> list[Judged]:
        """One lookup's tracked keys (key, bytes scaled by 1 / its stratum's rate, weight, found) through every
        miniature: an access hit at the capacities whose miniature held its key (not monotone in the capacity: a
        bucket's count is the change in hits from the edge before, and may be negative), each change spread
        over the edges by the interpolation between the miniatures (:func:`spline.spread`)."""
        if not keys:
            return []
        minis = self.minis or []
        sized = [(row, nbytes) for row, nbytes, _, _ in keys]
        parents = minis[0].parents(sized) if minis else {}  # the same for every miniature: made once
        hits = [mini.lookup(sized, parents) for mini in minis]
        spread, beyond = self._spread, len(self.edges)
        out: list[Judged] = []
        for index, (_, _, weight, found) in enumerate(keys):
            changes: list[tuple[int, float]] = []
            before = False
            for of_mini, shares in zip(hits, spread):
                if of_mini[index] != before:
                    before = not before
                    change = weight if before else -weight
                    changes += [(edge, change * share) for edge, share in shares]
            if not before:
                changes.append((beyond, weight))
            out.append((weight, found, None, changes))
        return out

    def store(self, object_bytes: int, rows: Iterable[Row]) -> None:
        """A store's sampled keys, each now the most recently used and stored (a head key keeps its size: it
        stands for every rank of its chunk)."""
        rows = list(rows)
        stack = self.stack
        if self.minis is not None:
            weights = self.weights()
            admitted = []
            for row in rows:
                stratum = _sampling(stack.stratum_of(row)) if row in stack else SAMPLED
                if self.strata[stratum].admits(row):
                    head_bytes = stack.bytes_of(row) if stratum == HEAD and row in stack else 0
                    admitted.append((row, (head_bytes or object_bytes) * weights[stratum]))
            parents = self.minis[0].parents(admitted) if self.minis else {}
            for mini in self.minis:
                mini.store(admitted, parents)
        for row in rows:
            stratum = _sampling(stack.stratum_of(row)) if row in stack else SAMPLED
            if self.strata[stratum].admits(row):
                if row in stack:
                    keep = stratum == HEAD and stack.bytes_of(row)
                    stack.touch(row, stack.bytes_of(row) if keep else object_bytes, stack.stratum_of(row))
                else:
                    self._insert(row, object_bytes, stratum)
                if row in stack:
                    self.stored.add(row)

    def _insert(self, row: Row, nbytes: int, stratum: int) -> None:
        self.stack.touch(row, nbytes, stratum)
        if self.forgotten and row in self.forgotten:  # a stored key pruned for depth comes back still stored
            del self.forgotten[row]
            self.stored.add(row)
        keys = self.strata[stratum]
        heapq.heappush(keys.heap, (-(row[0] % SAMPLE_MODULUS), row))
        keys.keys += 1
        if keys.keys > keys.budget:
            self._prune()
            if keys.keys > keys.budget - keys.budget // 4:
                self._lower(stratum)

    def _prune(self) -> None:
        """Forget the keys deeper than the largest capacity of any curve: every capacity misses them anyway (the
        stored ones are remembered as stored)."""
        for row, stratum in self.stack.prune(self.edges[-1], self._depth_weights(self.weights())) if self.edges else ():
            if stratum == TAIL:
                continue
            if stratum == HEAD and row in self.tails:
                self._untail(row)
            self.strata[_sampling(stratum)].keys -= 1
            if row in self.stored:
                self.stored.discard(row)
                self.forgotten[row] = None
        for index in (HEAD, SAMPLED):  # the pruned keys' heap entries are stale now
            self._compact(index)
        if len(self.forgotten) > FORGOTTEN_PER_KEY * self.max_keys:  # keep the newer half (amortised O(1))
            newest = list(self.forgotten)[-(FORGOTTEN_PER_KEY * self.max_keys // 2):]
            self.forgotten = dict.fromkeys(newest)

    def _lower(self, index: int) -> None:
        """SHARDS fixed-size: the stratum's new threshold is its largest tracked hash value; keys at or above
        it go.  Weights recorded at the old rate stay what they were: estimates of the accesses then.  The
        heap also holds entries of keys pruned since (skipped, and dropped once they outnumber the live ones)."""
        keys, stack = self.strata[index], self.stack
        while keys.heap and not self._live(keys.heap[0][1], index):
            heapq.heappop(keys.heap)
        if not keys.heap:  # nothing left to forget (the count cannot outrun the heap, but never trust it)
            keys.keys = 0
            return
        new_threshold = -keys.heap[0][0]
        while keys.heap and -keys.heap[0][0] >= new_threshold:
            row = heapq.heappop(keys.heap)[1]
            if self._live(row, index):
                stack.remove(row)
                if row in self.tails:
                    self._untail(row)
                self.stored.discard(row)
                keys.keys -= 1
        if self.minis is not None:  # the miniatures forget what the stack forgot, and any untracked key past it
            def admits(row: Any) -> bool:
                return row[0] == SEGMENT or row in stack or row[0] % SAMPLE_MODULUS < new_threshold
            for mini in self.minis:
                mini.keep(admits)
        keys.threshold = new_threshold
        self._compact(index)

    def _compact(self, index: int) -> None:
        """Drop the stratum's stale heap entries (keys pruned or lowered since they were pushed, and repeats)
        once they outnumber the live ones: the heap stays within 2 × the stratum's keys + 16, and each rebuild
        costs the entries pushed since the last (amortised O(1))."""
        keys = self.strata[index]
        if len(keys.heap) > 2 * keys.keys + 16:
            live = dict.fromkeys(row for _, row in keys.heap if self._live(row, index))
            keys.heap = [(-(row[0] % SAMPLE_MODULUS), row) for row in live]
            heapq.heapify(keys.heap)

    def weights(self) -> list[float]:
        """Per stratum, what one tracked byte or access stands for: 1 / its rate (0 for a stratum that admits
        nothing)."""
        return [SAMPLE_MODULUS / stratum.threshold if stratum.threshold else 0.0 for stratum in self.strata]

    @staticmethod
    def _depth_weights(weights: list[float]) -> list[float]:
        """Per place in the stack, what one byte there stands for in a distance: a head or hash-sampled key's
        1 / its rate, a covered key's nothing (its head key's tail counts it), a tail key's its bytes."""
        return [*weights, 0.0, 1.0]

    def _live(self, row: Row, index: int) -> bool:
        return row in self.stack and _sampling(self.stack.stratum_of(row)) == index

    # -- the telemetry process's checkpoint -------------------------------------------------------------

    def save(self) -> dict[str, Any]:
        """The strata's rates, the tracked keys in stack order (sizes and strata), which of them are stored, and
        the stored keys forgotten for depth (up to 4 × ``max_keys`` rows)."""
        return {"strata": [[stratum.threshold, stratum.keys] for stratum in self.strata],
                "stack": [(key, (slot, nbytes, _sampling(stratum))) for key, (slot, nbytes, stratum)
                          in self.stack.entries() if stratum != TAIL],
                "stored": list(self.stored), "forgotten": list(self.forgotten)}

    def check(self, state: object) -> Any:
        """Check a :meth:`save` of a history of this configuration; returns the step adopting it."""
        history = statecheck.fields(state, strata="l", stack="l", stored="l", forgotten="l")
        strata = statecheck.rows(history["strata"], "fi")
        stack = [(key, nbytes, stratum) for key, (_, nbytes, stratum) in
                 statecheck.entries(history["stack"], "iss", "iii")]
        stored = set(statecheck.rows(history["stored"], "iss"))
        forgotten = dict.fromkeys(statecheck.rows(history["forgotten"], "iss"))
        if (len(strata) != len(self.strata) or len(stack) > 2 * self.max_keys + 16 or len(stored) > len(stack)
                or len(forgotten) > (FORGOTTEN_PER_KEY + 1) * self.max_keys
                or any(not 0 <= stratum < len(self.strata) or not 0 <= nbytes <= MAX_KEY_BYTES
                       for _, nbytes, stratum in stack)):
            raise ValueError("not the history of this configuration")

        def adopt() -> None:
            self.stack.load(stack)
            for stratum, (threshold, keys) in zip(self.strata, strata):
                stratum.threshold, stratum.keys = threshold, keys
            for index, stratum in enumerate(self.strata):
                stratum.heap = [(-(key[0] % SAMPLE_MODULUS), key) for key, _, of in stack if of == index]
                heapq.heapify(stratum.heap)
            self.stored = {row for row in stored if row in self.stack}
            self.tails = {}
            self.forgotten = forgotten
        return adopt
