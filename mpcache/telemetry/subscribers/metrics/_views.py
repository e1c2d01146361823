"""Vectorised views of an :class:`~mpcache.telemetry.batch.EventBatch` that the
metrics subscribers share.

Decoding a whole event costs about 10 µs in Python; the hot L1 and storage
manager events arrive at up to hundreds of thousands a second.  So the
lifecycle subscribers read, from cell columns, the ``salt_counts`` /
``sampled`` rows of every record with the position of the record's head cell
(records are contiguous runs of cells, and a continuation cell's ``index`` is
its offset from the head; see :mod:`mpcache.shm.layout`).  Grouped sums are
:func:`mpcache.telemetry.batch.group_sums`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mpcache.contract.events import EventType, has_inline_salt
from mpcache.shm import layout
from mpcache.telemetry.batch import EventBatch, rows_of


class SampledRow(NamedTuple):
    head: int  # position of the record's head cell in the batch: equal heads = same event
    etype: int
    timestamp_ns: int
    chunk_hash: int
    cache_salt: str
    model_name: str


def sampled_rows(batch: EventBatch, etypes: Sequence[EventType]) -> list[SampledRow]:
    """Every sampled key of records of these types, in ring order, without decoding the records."""
    cells = batch.cells
    positions = np.flatnonzero((cells["kind"] == layout.CELL_SAMPLED) & rows_of(cells["etype"], etypes))
    if len(positions) == 0:
        return []
    heads = positions - cells["index"][positions]
    timestamps = cells["slots"][heads, 0]
    slots = cells["slots"][positions]
    hashes = slots[:, 0].view(np.uint64)
    name = _NameCache(batch)
    return [
        SampledRow(head, etype, ts, chunk_hash, name(salt), name(model))
        for head, etype, ts, chunk_hash, salt, model in zip(
            heads.tolist(), cells["etype"][positions].tolist(), timestamps.tolist(), hashes.tolist(),
            slots[:, 1].tolist(), slots[:, 2].tolist(),
        )
    ]


def salt_rows(batch: EventBatch, etypes: Sequence[EventType]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(head position, cache_salt id, count) of every salt group of records of these types, by head position."""
    cells = batch.cells
    positions = np.flatnonzero((cells["kind"] == layout.CELL_SALT) & rows_of(cells["etype"], etypes))
    heads = [positions - cells["index"][positions]]
    salts = [cells["slots"][positions, 0]]
    counts = [cells["slots"][positions, 2]]
    inline_types = [e for e in etypes if has_inline_salt(e)]
    if inline_types:
        inline = np.flatnonzero((cells["kind"] == layout.CELL_HEAD) & rows_of(cells["etype"], inline_types))
        inline = inline[cells["slots"][inline, layout.INLINE_SALT_SLOT + 2] != 0]
        heads.append(inline)
        salts.append(cells["slots"][inline, layout.INLINE_SALT_SLOT])
        counts.append(cells["slots"][inline, layout.INLINE_SALT_SLOT + 2])
    head, salt, count = (np.concatenate(parts) for parts in (heads, salts, counts))
    order = np.argsort(head, kind="stable")
    return head[order], salt[order], count[order]


class _NameCache:
    """Interned id → name for one batch, each id looked up once."""

    def __init__(self, batch: EventBatch) -> None:
        self._lookup = batch.names.name
        self._names: dict[int, str] = {}

    def __call__(self, name_id: int) -> str:
        name = self._names.get(name_id)
        if name is None:
            name = self._names[name_id] = self._lookup(name_id)
        return name
