"""A batch of ring cells: column aggregates (one group-by, :func:`group_sums`) for counter subscribers,
decoded events on demand for the rest."""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpcache.contract.events import (
    SCHEMAS,
    TEXT_FIELD_SESSION,
    EventType,
    FieldKind,
    has_inline_salt,
)
from mpcache.shm import layout
from mpcache.shm.intern import NameTable


@functools.lru_cache(maxsize=512)
def type_mask(etypes: tuple[int, ...]) -> np.ndarray:
    """A table indexed by a cell's event-type byte: True for ``etypes``.  ``type_mask(t)[column]`` selects the
    rows of those types in one gather, where ``np.isin`` sorts both sides on every call (~40 µs)."""
    mask = np.zeros(256, dtype=bool)
    mask[[int(e) for e in etypes if 0 <= int(e) < 256]] = True
    mask.flags.writeable = False
    return mask


def rows_of(column: np.ndarray, etypes: Iterable[int]) -> np.ndarray:
    """``column`` (event-type bytes) is one of ``etypes``: the boolean mask, as ``np.isin`` would give it."""
    rows: np.ndarray = type_mask(tuple(etypes))[column]
    return rows


@functools.lru_cache(maxsize=4096)
def _field_layout(etype: EventType, name: str) -> tuple[int, int, bool]:
    """Where fixed field ``name`` of ``etype`` sits: (cell offset from the head, slot, is a float)."""
    schema = SCHEMAS[etype]
    position = schema.field_names.index(name)  # ValueError for a field the type lacks
    if position < layout.HEAD_FIELD_SLOTS:
        cell, slot = 0, 1 + position
    else:
        extra = position - layout.HEAD_FIELD_SLOTS
        cell, slot = 1 + extra // layout.SLOTS_PER_CELL, extra % layout.SLOTS_PER_CELL
    return cell, slot, schema.fields[position][1] is FieldKind.FLOAT


@functools.lru_cache(maxsize=256)
def _has_field(etype: EventType, name: str) -> bool:
    return name in SCHEMAS[etype].field_names


_MASK64 = (1 << 64) - 1
_KNOWN_ETYPES = tuple(sorted(int(e) for e in EventType))
# the fewest cells a record of each type byte takes: its head, and the cells its fixed fields spill into
_LEAST_CELLS = np.ones(256, dtype=np.int64)
for _etype in EventType:
    _LEAST_CELLS[int(_etype)] = 1 - (-max(0, len(SCHEMAS[_etype].fields) - layout.HEAD_FIELD_SLOTS)
                                     // layout.SLOTS_PER_CELL)
_INLINE_SALT_ETYPES = tuple(sorted(int(e) for e in EventType if has_inline_salt(e)))


def group_sums(keys: Sequence[np.ndarray], weights: Sequence[np.ndarray]) -> dict[tuple[int, ...], list[int]]:
    """Rows grouped by the integer columns ``keys``: per distinct combination, in ascending
    (lexicographic) order, the sum of each column of ``weights`` over the group's rows.

    Every column has one value per row.  Without ``keys`` there is one group, ``()``, when
    there are rows.  The sums are exact integers (bool weights count the true rows).
    """
    rows = len(keys[0]) if keys else len(weights[0]) if weights else 0
    if rows == 0:
        return {}
    if not keys:
        return {(): [int(np.count_nonzero(w)) if w.dtype == np.bool_ else int(w.sum()) for w in weights]}
    order = np.argsort(keys[0], kind="stable") if len(keys) == 1 else np.lexsort(tuple(reversed(keys)))
    ordered = [column[order] for column in keys]
    starts = np.zeros(rows, dtype=bool)
    starts[0] = True
    for column in ordered:
        starts[1:] |= column[1:] != column[:-1]
    first = np.flatnonzero(starts)
    groups = zip(*(column[first].tolist() for column in ordered))
    sums = [np.add.reduceat(w[order].astype(np.int64, copy=False), first).tolist() for w in weights]
    return {group: [column[i] for column in sums] for i, group in enumerate(groups)}


@dataclass
class Event:
    """One decoded event, as subscribers with per-event logic see it."""

    etype: EventType
    timestamp_ns: int
    producer: int
    seq: int
    session_id: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    salt_counts: list[tuple[str, str, int]] = field(default_factory=list)  # (cache_salt, model_name, count)
    sampled: list[tuple[int, str, str]] = field(default_factory=list)  # (chunk_hash, cache_salt, model_name)
    texts: dict[str, str] = field(default_factory=dict)
    blocks: list[tuple[str, int, int]] = field(default_factory=list)  # (request_id, block_id, token_hash)

    @property
    def name(self) -> str:
        return SCHEMAS[self.etype].dotted


class EventBatch:
    """Whole records from one producer's ring, with the producer's name table."""

    def __init__(self, producer: int, cells: np.ndarray, names: NameTable) -> None:
        known = rows_of(cells["etype"], _KNOWN_ETYPES)
        heads = cells["kind"] == layout.CELL_HEAD
        positions = np.flatnonzero(heads)
        etypes = cells["etype"][positions]
        short = cells["index"][positions] < _LEAST_CELLS[etypes]  # too few cells for its type's fields
        if short.any():  # left out whole: its head and the cells after it
            known = known & ~short[np.cumsum(heads) - 1]
        # records of a type this reader does not know, or too short for their type's fields: counted, left out
        self.unknown_records = int(np.count_nonzero(known[positions] == 0))
        if self.unknown_records:
            cells = cells[known]
            positions = np.flatnonzero(cells["kind"] == layout.CELL_HEAD)
            etypes = cells["etype"][positions]
        self.producer = producer
        self.cells = cells
        self.names = names
        self._heads = positions
        self._head_etypes = etypes
        self._present: set[int] | None = None
        self._heads_by_type: dict[int, np.ndarray] = {}
        self._salt_rows_cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._heads)

    @property
    def etypes_present(self) -> set[int]:
        """The event types of the batch's records (computed once; do not modify)."""
        if self._present is None:
            self._present = set(np.unique(self._head_etypes).tolist())
        return self._present

    def count(self, etypes: Iterable[EventType]) -> int:
        return int(np.count_nonzero(rows_of(self._head_etypes, etypes)))

    # -- vectorised aggregates -------------------------------------------------

    def salt_totals(self, etypes: Sequence[EventType]) -> dict[tuple[str, str], int]:
        """Sum of salt_counts over records of these types: {(cache_salt, model_name): count}."""
        salts, models, counts, _ = self.salt_groups(etypes)
        out: dict[tuple[str, str], int] = {}
        for (salt_id, model_id), (total,) in group_sums((salts, models), (counts,)).items():
            pair = (self.names.name(salt_id), self.names.name(model_id))
            out[pair] = out.get(pair, 0) + total
        return out

    def salt_groups(
        self, etypes: Sequence[EventType], fields: Sequence[str] = ()
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Every salt group of records of these types: (cache_salt ids, model_name ids, counts,
        {field: that fixed field of the group's record, per group}) — ``fields`` must be fields
        of every one of ``etypes``.  Groups with count 0 (no group) are left out."""
        row_etypes, row_heads, rows = self._salt_rows()
        mask = rows_of(row_etypes, etypes)
        salts, models, counts = rows[mask, 0], rows[mask, 1], rows[mask, 2]
        columns: dict[str, np.ndarray] = {}
        if fields:
            heads, kinds = row_heads[mask], row_etypes[mask]
            for name in fields:
                columns[name] = np.zeros(len(heads), dtype=np.int64)
            for etype in etypes:
                mine = kinds == etype
                if not np.any(mine):
                    continue
                position = np.searchsorted(self._type_heads(etype), heads[mine])
                for name in fields:
                    columns[name][mine] = self.field_column(etype, name)[position]
        return salts, models, counts, columns

    def field_column(self, etype: EventType, name: str) -> np.ndarray:
        """One fixed field of every record of ``etype``, in order (float fields as float64)."""
        cell, slot, is_float = _field_layout(etype, name)
        heads = self._type_heads(etype)
        raw: np.ndarray = self.cells["slots"][heads + cell if cell else heads, slot]
        return raw.view(np.float64) if is_float else raw

    def fixed_fields(self, etype: EventType) -> np.ndarray:
        """Every fixed field of every record of ``etype``: one row per record in ring order, one column per
        field in schema order, the slots as they are (names as ids, floats as their int64 bits).  One gather
        per cell of the record where :meth:`field_column` makes one per field."""
        heads = self._type_heads(etype)
        nfields = len(SCHEMAS[etype].fields)
        extra_cells = int(_LEAST_CELLS[etype]) - 1  # (a record with fewer is not in the batch)
        slots = self.cells["slots"]
        parts = [slots[heads, 1 : 1 + min(nfields, layout.HEAD_FIELD_SLOTS)]]
        for cell in range(1, 1 + extra_cells):
            parts.append(slots[heads + cell])
        rows: np.ndarray = np.hstack(parts)[:, :nfields] if len(parts) > 1 else parts[0]
        return rows

    def _type_heads(self, etype: EventType) -> np.ndarray:
        """Positions of the head cells of ``etype``'s records, in order (computed once per type)."""
        heads = self._heads_by_type.get(etype)
        if heads is None:
            heads = self._heads_by_type[etype] = self._heads[self._head_etypes == etype]
        return heads

    def _salt_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every salt group of the batch, once: (event type, head position of the record, and
        (salt id, model id, count)) per group.

        Computed on first use and kept: several subscribers ask for salt groups of
        the same batch, and this is the pass over every cell."""
        if self._salt_rows_cache is None:
            cells = self.cells
            salt_cells = np.flatnonzero(cells["kind"] == layout.CELL_SALT)
            inline = self._heads[rows_of(self._head_etypes, _INLINE_SALT_ETYPES)]
            row_etypes = np.concatenate((cells["etype"][salt_cells], cells["etype"][inline]))
            row_heads = np.concatenate((salt_cells - cells["index"][salt_cells], inline))
            rows = np.concatenate((cells["slots"][salt_cells, :3],
                                   cells["slots"][inline, layout.INLINE_SALT_SLOT : layout.INLINE_SALT_SLOT + 3]))
            keep = rows[:, 2] != 0  # an inline group with count 0 means "no group"
            self._salt_rows_cache = (row_etypes[keep], row_heads[keep], rows[keep])
        return self._salt_rows_cache

    def session_ids(self, heads: np.ndarray) -> list[bytes]:
        """The session id (UTF-8 bytes, b"" when none) of each record whose head cell is
        at ``heads`` — from the TEXT cells of field 0, without decoding the records."""
        out = [b""] * len(heads)
        if len(heads) == 0:
            return out
        cells = self.cells
        raw = cells.view(np.uint8).reshape(-1, layout.CELL_SIZE)
        text = np.flatnonzero((cells["kind"] == layout.CELL_TEXT) & (raw[:, 8] == TEXT_FIELD_SESSION))
        if len(text) == 0:
            return out
        owner_head = self._heads[np.searchsorted(self._heads, text, side="right") - 1]
        slot = np.searchsorted(heads, owner_head)
        wanted = (slot < len(heads)) & (heads[np.minimum(slot, len(heads) - 1)] == owner_head)
        text, slot = text[wanted], slot[wanted]
        # One S54 string per cell: numpy drops the trailing NUL padding, and request ids hold no NUL.
        pieces = np.ascontiguousarray(raw[text, 10:]).view(f"S{layout.CELL_SIZE - 10}").ravel().tolist()
        if len(slot) < 2 or np.all(np.diff(slot) > 0):  # every session id fits one cell: no joining
            for position, piece in zip(slot.tolist(), pieces):
                out[position] = piece
            return out
        for position, piece in zip(slot.tolist(), pieces):
            out[position] = out[position] + piece if out[position] else piece
        return out

    def table(self, etypes: Sequence[EventType],
              fields: Sequence[str]) -> tuple[list[int], list[int], dict[str, list[int]]]:
        """Records of these types in ring order, as columns: (event type ids, timestamps ns,
        {field: values}) — a field a type lacks reads 0, a float field its value truncated to an int;
        names stay ids (see ``names``).  Per-event logic loops over these lists instead of decoding events."""
        present = self.etypes_present
        etypes = [etype for etype in etypes if etype in present]
        if len(etypes) == 1:
            heads = self._type_heads(etypes[0])
            etype_ids = [int(etypes[0])] * len(heads)
        else:
            mask = rows_of(self._head_etypes, etypes)
            heads = self._heads[mask]
            etype_col = self._head_etypes[mask]
            etype_ids = etype_col.tolist()
        slots = self.cells["slots"]
        columns = {}
        for name in fields:
            having = [etype for etype in etypes if _has_field(etype, name)]
            layouts = {_field_layout(etype, name) for etype in having}
            if not having:
                columns[name] = [0] * len(heads)
            elif len(layouts) == 1 and len(having) == len(etypes):
                # every type has the field in the same place: one gather over the records' cells
                ((cell, slot, is_float),) = layouts
                raw = slots[heads + cell if cell else heads, slot]
                columns[name] = (raw.view(np.float64).astype(np.int64) if is_float else raw).tolist()
            else:  # several types (the one-type case is one of the two above)
                column = np.zeros(len(heads), dtype=np.int64)
                for etype in having:
                    column[etype_col == etype] = self.field_column(etype, name)
                columns[name] = column.tolist()
        return etype_ids, slots[heads, 0].tolist(), columns

    def heads_of(self, etypes: Sequence[EventType]) -> np.ndarray:
        """Positions of the head cells of these types' records, in ring order."""
        if len(etypes) == 1:
            return self._type_heads(etypes[0])
        heads: np.ndarray = self._heads[rows_of(self._head_etypes, etypes)]
        return heads

    # -- per-event decoding ----------------------------------------------------

    def events(self, etypes: Iterable[EventType] | None = None) -> list[Event]:
        """Decoded events of these types (all types when None), in ring order."""
        if etypes is None:
            selected = self._heads
        else:
            selected = self._heads[rows_of(self._head_etypes, etypes)]
        if len(selected) == 0:
            return []
        return [self._decode(int(h)) for h in selected]

    def _decode(self, head: int) -> Event:
        cells = self.cells
        etype = EventType(int(cells["etype"][head]))
        schema = SCHEMAS[etype]
        ncells = int(cells["index"][head])
        record = cells[head : head + ncells]
        slots = record["slots"].tolist()
        kinds = record["kind"].tolist()
        name = self.names.name
        raw = list(slots[0][1 : 1 + layout.HEAD_FIELD_SLOTS])
        if has_inline_salt(etype) and slots[0][layout.INLINE_SALT_SLOT + 2] != 0:
            salt, model, count = slots[0][layout.INLINE_SALT_SLOT : layout.INLINE_SALT_SLOT + 3]
            inline_salt = [(name(salt), name(model), count)]
        else:
            inline_salt = []
        for kind, row in zip(kinds, slots):
            if kind == layout.CELL_FIELDS:
                raw.extend(row)
        values: dict[str, Any] = {}
        for (fname, fkind), value in zip(schema.fields, raw):
            if fkind is FieldKind.NAME:
                values[fname] = name(value)
            elif fkind is FieldKind.FLOAT:
                values[fname] = struct.unpack("<d", struct.pack("<q", value))[0]
            elif fkind is FieldKind.BOOL:
                values[fname] = bool(value)
            elif fkind is FieldKind.HASH:
                values[fname] = value & _MASK64
            else:
                values[fname] = value
        event = Event(etype, slots[0][0], self.producer, int(record["seq"][0]), fields=values, salt_counts=inline_salt)
        text_parts: dict[int, list[bytes]] = {}
        raw_bytes = record.view(np.uint8).reshape(ncells, layout.CELL_SIZE) if layout.CELL_TEXT in kinds else None
        blocks = []
        for i, (kind, row) in enumerate(zip(kinds, slots)):
            if kind == layout.CELL_SALT:
                event.salt_counts.append((name(row[0]), name(row[1]), row[2]))
            elif kind == layout.CELL_SAMPLED:
                event.sampled.append((row[0] & 0xFFFFFFFFFFFFFFFF, name(row[1]), name(row[2])))
            elif kind == layout.CELL_BLOCK:
                blocks.append((row[0], row[1], row[2] & 0xFFFFFFFFFFFFFFFF))
            elif kind == layout.CELL_TEXT:
                assert raw_bytes is not None  # set whenever kinds has a TEXT cell
                cell = raw_bytes[i]
                length = min(int(cell[9]), layout.TEXT_BYTES_PER_CELL)
                text_parts.setdefault(int(cell[8]), []).append(cell[10 : 10 + length].tobytes())
        texts = {number: b"".join(parts).decode("utf-8", "replace") for number, parts in text_parts.items()}
        event.session_id = texts.get(TEXT_FIELD_SESSION, "")
        for number, text_name in enumerate(schema.texts, start=TEXT_FIELD_SESSION + 1):
            event.texts[text_name] = texts.get(number, "")
        event.blocks = [(texts.get(number, ""), block_id, th) for number, block_id, th in blocks]
        return event
