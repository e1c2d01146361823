"""Sampled chunk accesses, the cache process's whole share of the miss-ratio curves and miss reasons
(``docs/MRC.md``): a key is sampled when ``chunk_hash mod 1_000_003 < rate × 1_000_003`` (SHARDS' spatial
rule, the same in every process and after every restart).  Each finished lookup publishes one
``MRC_LOOKUP_SAMPLED`` and each store one ``MRC_STORE_SAMPLED``; the telemetry process does the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpcache.cache.l1 import L1Manager
from mpcache.cache.mrc.headfields import head_fields, held_past_gap, tail_mark_words
from mpcache.contract.events import (
    MRC_EXACT_GAP_SHIFT,
    MRC_EXACT_TAIL_SHIFT,
    MRC_HEAD_FIELDS,
    MRC_TAIL_MARK_FIELDS,
    EventType,
)
from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.shm.publish import EventPublisher

_MRC_LOOKUP_SAMPLED = EventType.MRC_LOOKUP_SAMPLED
_MRC_STORE_SAMPLED = EventType.MRC_STORE_SAMPLED


GROUP_LABEL = "{model}@g{group}"  # a hybrid model's KV cache group g > 0 in the curves ('@' is in no model name)
MAX_EXACT_CHUNKS = len(MRC_HEAD_FIELDS)  # head keys travel as fixed fields: no per-key cells on the hot path
MAX_MODELS_SIZED = 1024  # models whose object size is remembered (then forgotten all at once and re-sent)
_PADDING = [(0,) * (MAX_EXACT_CHUNKS - n) for n in range(MAX_EXACT_CHUNKS + 1)]  # head fields left empty after n
# the fixed fields after the counts: the head keys, then (a lookup of head chunks only has no tail) its zero marks
_AFTER_COUNTS = MAX_EXACT_CHUNKS + len(MRC_TAIL_MARK_FIELDS)


class AccessSampler:
    """Publishes what lookups and stores did to the sampled keys: a lookup's first ``exact_chunks`` chunks
    (its hot keys) always, every other key when its hash passes ``rate`` in [0, 1] (0: publishes nothing)."""

    def __init__(self, publisher: EventPublisher, rate: float, exact_chunks: int = MAX_EXACT_CHUNKS) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"sample rate must be in [0, 1], got {rate}")
        if not 0 <= exact_chunks <= MAX_EXACT_CHUNKS:
            raise ValueError(f"exact chunks must be 0..{MAX_EXACT_CHUNKS}, got {exact_chunks}")
        self._pub = publisher
        self._emit_lookup = publisher.fields_emitter(_MRC_LOOKUP_SAMPLED)  # a lookup without sampled keys
        self._threshold = rate * SAMPLE_MODULUS
        self._exact_chunks = exact_chunks
        self._sizes: dict[str, int] = {}  # per model, the object size last published
        self.enabled = rate > 0

    def lookup(self, l1: L1Manager, model: str, salt: str, hashes: Sequence[int], ranks: int, l1_hits: int,
               found: int, label: str | None = None) -> None:
        """A finished lookup of ``hashes`` (``ranks`` objects per chunk): ``hashes[:l1_hits]`` were in L1,
        ``hashes[l1_hits:found]`` came from L2.  A missing key past the first missing chunk that L1 holds is
        "after the gap"; the telemetry process tells cold from evicted for the other misses.  The first
        chunks go as their first rank's key (``head_i``; ``exact``: how many, | bit 5 + i: chunk i after the gap,
        | the objects past them << 21; the marks of the chunks past them, :mod:`mpcache.contract.tail_marks`).
        Published under ``label`` where the curves key the keys apart from ``model``."""
        if not self.enabled:
            return
        fields = head_fields(model, salt, hashes, ranks, l1_hits, found, self._exact_chunks, _AFTER_COUNTS,
                             MRC_EXACT_GAP_SHIFT, l1.entry_of)
        name = model if label is None else label
        if fields is not None:  # every chunk a head chunk: fixed fields only
            self._emit_lookup(fields if label is None else (label, *fields[1:]), "")
            return
        if l1_hits > found:  # a trailing partial chunk given back shrinks found, not the L1 count
            l1_hits = found
        count = len(hashes)
        exact = count // ranks
        if exact > self._exact_chunks:
            exact = self._exact_chunks
        gap_chunk = found // ranks
        firsts = hashes[:exact] if ranks == 1 else hashes[: exact * ranks : ranks]
        gap_mask = held_past_gap(model, salt, firsts, gap_chunk, MRC_EXACT_GAP_SHIFT, l1.entry_of)
        threshold = self._threshold
        l1_rows: list[tuple[int, str, str]] = []
        l2_rows: list[tuple[int, str, str]] = []
        gap_rows: list[tuple[int, str, str]] = []
        miss_rows: list[tuple[int, str, str]] = []
        for position in range(exact * ranks, len(hashes)):
            chunk_hash = hashes[position]
            if chunk_hash % SAMPLE_MODULUS < threshold:
                row = (chunk_hash, salt, name)
                if position < l1_hits:
                    l1_rows.append(row)
                elif position < found:
                    l2_rows.append(row)
                elif position // ranks > gap_chunk and l1.contains((model, salt, chunk_hash)):
                    gap_rows.append(row)
                else:
                    miss_rows.append(row)
        tail = count - exact * ranks  # the objects the sampled keys are drawn from: the curves judge all of them
        self._pub.emit(_MRC_LOOKUP_SAMPLED,
                       (name, salt, ranks, found, l1_hits, exact | gap_mask | tail << MRC_EXACT_TAIL_SHIFT,
                        len(l1_rows), len(l2_rows),
                        len(gap_rows), *firsts, *_PADDING[exact], *tail_mark_words(hashes, exact * ranks, ranks)),
                       sampled=l1_rows + l2_rows + gap_rows + miss_rows)

    def lookup_groups(self, l1: L1Manager, model: str, salt: str, hashes: Sequence[int], stride: int,
                      windows: Sequence[int], hit: int) -> None:
        """A finished lookup of a hybrid model (``hashes`` chunk-major, ``stride`` objects a chunk: per KV cache
        group, its ranks; a prefix of ``hit`` chunks found in L1), one sampled lookup per group under its own
        :func:`group_label`: the chunks its window needs for the whole request, of which those up to the hit
        were found."""
        if not self.enabled:
            return
        ranks = stride // len(windows)
        chunks = len(hashes) // stride
        for group, window in enumerate(windows):
            first = 0 if window <= 0 else max(0, chunks - window)
            keys = [hashes[chunk * stride + group * ranks + rank] for chunk in range(first, chunks)
                    for rank in range(ranks)]
            found = max(0, hit - first) * ranks
            self.lookup(l1, model, salt, keys, ranks, found, found, label=group_label(model, group))

    def store(self, model: str, salt: str, hashes: Sequence[int], object_bytes: int) -> None:
        """A store of ``hashes`` (objects of ``object_bytes``): written now or already held, all touched.
        Published when a key is sampled or the model's object size is new (the curves size keys by it)."""
        if not self.enabled:
            return
        threshold, modulus = self._threshold, SAMPLE_MODULUS
        for chunk_hash in hashes:  # most stores hold no sampled key: find that out without building a list
            if chunk_hash % modulus < threshold:
                sampled = [(h, salt, model) for h in hashes if h % modulus < threshold]
                break
        else:
            if self._sizes.get(model) == object_bytes:
                return
            sampled = []
        if len(self._sizes) >= MAX_MODELS_SIZED and model not in self._sizes:
            self._sizes.clear()
        self._sizes[model] = object_bytes
        self._pub.emit(_MRC_STORE_SAMPLED, (model, salt, len(hashes), object_bytes), sampled=sampled)


def group_label(model: str, group: int) -> str:
    """The model name KV cache group ``group`` of a hybrid model is curved under: the model's own for group 0
    (keyed as a model of one group), ``model@g<group>`` for the others (each group's objects have their own size)."""
    return model if group == 0 else GROUP_LABEL.format(model=model, group=group)
