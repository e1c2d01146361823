"""Publishing events from a cache process: encode by schema, append to the ring.  One precompiled struct per
record shape, so a publish is one ``pack_into`` and one store; it never blocks or raises.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from mpcache.contract.events import (
    BLOCK_REQUEST_ID_MAX_BYTES,
    SCHEMAS,
    SESSION_ID_MAX_BYTES,
    TEXT_FIELD_BLOCK_REQUESTS,
    TEXT_FIELD_SESSION,
    TEXT_MAX_BYTES,
    EventType,
    FieldKind,
    has_inline_salt,
)
from mpcache.shm import layout
from mpcache.shm.intern import Interner
from mpcache.shm.ring import RingWriter

SaltCounts = Mapping[tuple[str, str], int]  # (cache_salt, model_name) -> count
Sampled = Iterable[tuple[int, str, str]]  # (chunk_hash, cache_salt, model_name)
Blocks = Iterable[tuple[str, int, int]]  # (request_id, block_id, token_hash)
_ShapeKey = tuple[int, int, int, int, int]  # (etype, salt groups, sampled keys, blocks, text cells)

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_CELL = layout.CELL_PREFIX[1:]  # prefix format without the byte-order mark
_SALT_FMT = _CELL + "qqq32x"
_SAMPLED_FMT = _CELL + "Qqq32x"
_BLOCK_FMT = _CELL + "qqQ32x"
_TEXT_FMT = layout.CELL_TEXT_FMT[1:]
_SLOT_FORMATS = {FieldKind.FLOAT: "d", FieldKind.HASH: "Q"}  # struct formats of the slots; every other kind: q
PLAIN_FIELD_CELLS = 3  # fixed-field events of up to 6 + 3 × 7 fields take the plain (compiled) emitter


class _Shape:
    """Per event type: which fixed fields are names, and the fixed-cell formats."""

    def __init__(self, etype: EventType) -> None:
        schema = SCHEMAS[etype]
        kinds = [kind for _, kind in schema.fields]
        self.etype = int(etype)
        self.name_positions = tuple(i for i, kind in enumerate(kinds) if kind is FieldKind.NAME)
        self.n_fields = len(kinds)
        self.inline_salt = has_inline_salt(etype)
        slot_fmt = [_SLOT_FORMATS.get(kind, "q") for kind in kinds]
        self.slot_kinds = ["n" if kind is FieldKind.NAME else fmt for kind, fmt in zip(kinds, slot_fmt)]
        head = slot_fmt[: layout.HEAD_FIELD_SLOTS]
        if self.inline_salt:
            pad = layout.INLINE_SALT_SLOT - 1 - len(head)
            self.head_fmt = _CELL + "q" + "".join(head) + "8x" * pad + "qqq"
        else:
            self.head_fmt = _CELL + "q" + "".join(head) + "8x" * (layout.HEAD_FIELD_SLOTS - len(head))
        rest = slot_fmt[layout.HEAD_FIELD_SLOTS :]
        self.field_cells: list[tuple[int, str]] = []  # (number of fields, format) per FIELDS cell
        self.field_ranges: list[tuple[int, int, int]] = []  # (cell index, first field, end) per FIELDS cell
        for start in range(0, len(rest), layout.SLOTS_PER_CELL):
            part = rest[start : start + layout.SLOTS_PER_CELL]
            self.field_cells.append((len(part), _CELL + "".join(part) + "8x" * (layout.SLOTS_PER_CELL - len(part))))
            first = layout.HEAD_FIELD_SLOTS + start
            self.field_ranges.append((1 + len(self.field_ranges), first, first + len(part)))
        self.text_fields = tuple(
            (number, TEXT_MAX_BYTES[name]) for number, name in enumerate(schema.texts, start=TEXT_FIELD_SESSION + 1)
        )


def _cells(record: bytes) -> list[bytes]:
    """A packed record split into its cells."""
    return [record[i : i + layout.CELL_SIZE] for i in range(0, len(record), layout.CELL_SIZE)]


def _text_pieces(text: str, max_bytes: int) -> list[bytes]:
    data = text.encode("utf-8", "replace")[:max_bytes]
    step = layout.TEXT_BYTES_PER_CELL
    return [data[i : i + step] for i in range(0, len(data), step)]


class Publisher:
    """Encodes events by schema and appends them to this process's ring."""

    def __init__(
        self,
        writer: RingWriter,
        interner: Interner,
        *,
        threadsafe: bool = False,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._writer = writer
        self._interner = interner
        self._ids = interner.ids
        self._lock = threading.Lock() if threadsafe else None
        self._clock_ns = clock_ns
        self._shapes = {etype: _Shape(etype) for etype in EventType}
        self._structs: dict[_ShapeKey, struct.Struct] = {}
        self._one_cell = {
            etype: struct.Struct("<" + self._shapes[etype].head_fmt)
            for etype in EventType
            if has_inline_salt(etype) and not SCHEMAS[etype].fields
        }
        self._emitters = {
            etype: writer.one_cell_emitter(record, int(etype), clock_ns) for etype, record in self._one_cell.items()
        }
        self.emit_salted = self._make_emit_salted()
        self._plain_emitters = {
            etype: self._make_plain_emitter(shape) for etype, shape in self._shapes.items()
            if not shape.inline_salt and len(shape.field_cells) <= PLAIN_FIELD_CELLS  # more: the general path
        }
        self._salted_fields_emitters = {
            etype: self._make_salted_fields_emitter(shape) for etype, shape in self._shapes.items()
            if shape.inline_salt and shape.n_fields
        }

    def _make_plain_emitter(self, shape: _Shape, fallback: Callable[..., bool] | None = None) -> Callable[..., bool]:
        """``emit(fields, session_id, timestamp_ns=None)`` for one event type: fixed fields and at most a
        one-cell session id — the MP server's events, a dozen per request — built once with the record shapes
        and name positions bound.  For a type with its first salt group inline, ``fields`` ends with the
        group's cache_salt, model_name and count, three more slots of the head cell.  Compiled where the
        ring's writer is (:meth:`~mpcache.shm.ring.RingWriter.fields_emitter`), with ``fallback`` (the Python
        closure below by default) for what it declines.  Never raises."""
        etype, n_cells = shape.etype, len(shape.field_cells)
        zeros = [0.0 if kind == "d" else 0 for kind in shape.slot_kinds]
        head_slots, per_cell, group = layout.HEAD_FIELD_SLOTS, layout.SLOTS_PER_CELL, layout.INLINE_SALT_SLOT
        head = [layout.CELL_HEAD, etype, 1 + n_cells, 0, *zeros[:head_slots], *([0, 0, 0] * shape.inline_salt)]
        fields = []
        for index, start, end in shape.field_ranges:
            fields += [0, layout.CELL_FIELDS, etype, index, *zeros[start:end]]
        plain = _cells(self._compile(shape, (etype, 0, 0, 0, 0)).pack(0, *head, *fields))
        head[2] += 1  # the head cell counts the text cell too
        text = [0, layout.CELL_TEXT, etype, 1 + n_cells, TEXT_FIELD_SESSION, 0, b""]
        with_text = _cells(self._compile(shape, (etype, 0, 0, 0, 1)).pack(0, *head, *fields, *text))
        slots = tuple(
            (0, layout.slot_offset(1 + i), kind) if i < head_slots
            else (1 + (i - head_slots) // per_cell, layout.slot_offset((i - head_slots) % per_cell), kind)
            for i, kind in enumerate(shape.slot_kinds)
        ) + ((0, layout.slot_offset(group), "n"), (0, layout.slot_offset(group + 1), "n"),
             (0, layout.slot_offset(group + 2), "q")) * shape.inline_salt
        return self._writer.fields_emitter(
            head_templates=(plain[0], with_text[0]), fields_templates=tuple(plain[1 : 1 + n_cells]),
            text_template=with_text[-1], field_slots=slots, ids=self._ids, clock_ns=self._clock_ns,
            fallback=fallback or self._make_python_plain_emitter(shape),
        )

    def _make_python_plain_emitter(self, shape: _Shape) -> Callable[..., bool]:
        """The Python form of :meth:`_make_plain_emitter`'s emitter (and its fallback)."""
        etype, n_fields, name_positions = shape.etype, shape.n_fields, shape.name_positions
        without_session, with_session = (self._compile(shape, (etype, 0, 0, 0, texts)) for texts in (0, 1))
        head, n_cells, cell_ranges = layout.HEAD_FIELD_SLOTS, len(shape.field_cells), shape.field_ranges
        ids, intern, clock_ns, writer = self._ids, self._interner.id_of, self._clock_ns, self._writer
        cell_head, cell_fields, cell_text = layout.CELL_HEAD, layout.CELL_FIELDS, layout.CELL_TEXT
        general = self._emit
        eventtype = EventType(etype)

        def emit(fields: tuple[Any, ...], session_id: str, timestamp_ns: int | None = None) -> bool:
            try:
                if len(fields) != n_fields:
                    raise ValueError(f"{eventtype.name} takes {n_fields} fields, got {len(fields)}")
                values = list(fields)
                for position in name_positions:
                    name_id = ids.get(values[position])
                    values[position] = name_id if name_id is not None else intern(values[position])
                data = session_id.encode("utf-8", "replace") if session_id else b""
            except Exception:  # noqa: BLE001 - never raise into the data path
                writer.count_drop()
                return False
            if len(data) > layout.TEXT_BYTES_PER_CELL:
                return general(eventtype, fields, None, (), session_id, (), (), timestamp_ns)
            seq = writer.seq & _MASK32
            ncells = 1 + n_cells + (1 if data else 0)
            timestamp = clock_ns() if timestamp_ns is None else timestamp_ns
            args = [seq, cell_head, etype, ncells, timestamp, *values[:head]]
            for index, start, end in cell_ranges:
                args += (seq, cell_fields, etype, index, *values[start:end])
            if data:
                args += (seq, cell_text, etype, ncells - 1, TEXT_FIELD_SESSION, len(data), data)
                return writer.append(with_session, ncells, args)
            return writer.append(without_session, ncells, args)

        return emit

    def _make_salted_fields_emitter(self, shape: _Shape) -> Callable[..., bool]:
        """:meth:`_make_plain_emitter`'s emitter for a type with fixed fields and its first salt group inline
        (``SM_WRITE_FINISHED``, twice a request), the general encoder its fallback.  Never raises."""
        etype, general, n_fields = EventType(shape.etype), self._emit, shape.n_fields

        def python_emit(values: Any, session_id: str, timestamp_ns: int | None = None) -> bool:
            try:
                if len(values) != n_fields + 3:
                    raise ValueError(f"{etype.name} takes {n_fields} fields and a salt group, got {len(values)}")
                *fields, salt, model, count = values
                salt_counts = {(salt, model): count}
            except Exception:  # noqa: BLE001 - never raise into the data path
                self._writer.count_drop()
                return False
            return general(etype, tuple(fields), salt_counts, (), session_id, (), (), timestamp_ns)

        return self._make_plain_emitter(shape, python_emit)

    def salted_emitter(self, etype: EventType) -> Callable[[int, int, int], bool]:
        """``emit(cache_salt_id, model_name_id, count)`` for one event type without fixed
        fields: the hottest publish — one call, one pack, one store.  Ids come from
        :meth:`name_id`; resolve them once per request, not once per event."""
        return self._emitters[etype]

    def fields_emitter(self, etype: EventType) -> Callable[[tuple[Any, ...], str], bool]:
        """``emit(fields, session_id)`` for one fixed-field event type, bound once: the compiled emitter where
        there is one, so a hot caller skips :meth:`emit`'s keyword handling.  Never raises."""
        plain = self._plain_emitters.get(etype)
        if plain is None or self._lock is not None:
            return lambda fields, session_id: self.emit(etype, fields, session_id=session_id)
        return plain

    def name_id(self, name: str) -> int:
        """The interned id of a low-cardinality name (appended to the table on first use)."""
        return self._interner.id_of(name)

    def _make_emit_salted(self) -> Callable[[EventType, str, str, int], bool]:
        """``emit_salted(etype, cache_salt, model_name, count)``: the hot shape by name.

        For an event without fixed fields whose keys share one (cache_salt,
        model_name) and include no sampled key: one cell.  Never raises.
        """
        emitters, ids = self._emitters, self._ids

        def slow(etype: EventType, cache_salt: str, model_name: str, count: int) -> bool:
            return self.emit(etype, salt_counts={(cache_salt, model_name): count})

        if self._lock is not None:
            return slow  # shared by threads: take the locked general path

        def emit_salted(etype: EventType, cache_salt: str, model_name: str, count: int) -> bool:
            try:
                return emitters[etype](ids[cache_salt], ids[model_name], count)
            except KeyError:  # a name not interned yet, or a type without a one-cell shape
                return slow(etype, cache_salt, model_name, count)

        return emit_salted

    def emit(
        self,
        etype: EventType,
        fields: tuple[Any, ...] = (),
        *,
        salt_counts: SaltCounts | None = None,
        sampled: Sampled = (),
        session_id: str = "",
        texts: tuple[str, ...] = (),
        blocks: Blocks = (),
        timestamp_ns: int | None = None,
    ) -> bool:
        """Publish one event; False if it was dropped (ring full or bad values).  Never raises."""
        if self._lock is None:
            if not (sampled or texts or blocks):
                if not salt_counts:
                    plain = self._plain_emitters.get(etype)
                    if plain is not None:
                        return plain(fields, session_id, timestamp_ns)
                elif len(salt_counts) == 1:
                    salted = self._salted_fields_emitters.get(etype)
                    if salted is not None:
                        return self._emit_one_group(salted, fields, salt_counts, session_id, timestamp_ns)
            return self._emit(etype, fields, salt_counts, sampled, session_id, texts, blocks, timestamp_ns)
        with self._lock:
            return self._emit(etype, fields, salt_counts, sampled, session_id, texts, blocks, timestamp_ns)

    def _emit_one_group(self, salted: Callable[..., bool], fields: tuple[Any, ...], salt_counts: SaltCounts,
                        session_id: str, timestamp_ns: int | None) -> bool:
        """An event with fixed fields and one salt group, through its salted fields emitter."""
        try:
            ((salt, model), count), = salt_counts.items()
            values = (*fields, salt, model, count)
        except Exception:  # noqa: BLE001 - never raise into the data path
            self._writer.count_drop()
            return False
        return salted(values, session_id, timestamp_ns)

    def _emit(self, etype: EventType, fields: tuple[Any, ...], salt_counts: SaltCounts | None, sampled: Sampled,
              session_id: str, texts: tuple[str, ...], blocks: Blocks, timestamp_ns: int | None) -> bool:
        try:
            shape = self._shapes[etype]
            values = list(fields)
            if len(values) != shape.n_fields:
                raise ValueError(f"{etype.name} takes {shape.n_fields} fields, got {len(values)}")
            ids = self._ids
            for position in shape.name_positions:
                name = values[position]
                name_id = ids.get(name)
                values[position] = name_id if name_id is not None else self._interner.id_of(name)
            timestamp = self._clock_ns() if timestamp_ns is None else timestamp_ns
            record, ncells, args = self._general(shape, values, timestamp, salt_counts, sampled, session_id,
                                                 texts, blocks)
        except Exception:  # noqa: BLE001 - an encoding bug must never reach the data path
            self._writer.count_drop()
            return False
        return self._writer.append(record, ncells, args)

    def _head_and_fields(self, shape: _Shape, values: list[Any], timestamp: int, seq: int,
                         ncells: int) -> list[Any]:
        """Arguments of the head cell and the FIELDS cells."""
        et = shape.etype
        args = [seq, layout.CELL_HEAD, et, ncells, timestamp]
        args += values[: layout.HEAD_FIELD_SLOTS]
        for index, start, end in shape.field_ranges:
            args += (seq, layout.CELL_FIELDS, et, index, *values[start:end])
        return args

    def _general(self, shape: _Shape, values: list[Any], timestamp: int, salt_counts: SaltCounts | None,
                 sampled: Sampled, session_id: str, texts: tuple[str, ...],
                 blocks: Blocks) -> tuple[struct.Struct, int, list[Any]]:
        ids, intern = self._ids, self._interner.id_of  # (a name interned already is a lookup, not a call)
        salts = []
        if salt_counts:
            for (salt, model), count in salt_counts.items():
                salt_id, model_id = ids.get(salt), ids.get(model)
                salts.append((intern(salt) if salt_id is None else salt_id,
                              intern(model) if model_id is None else model_id, count))
        samples = []
        for chunk_hash, salt, model in sampled or ():
            salt_id, model_id = ids.get(salt), ids.get(model)
            samples.append((chunk_hash & _MASK64, intern(salt) if salt_id is None else salt_id,
                            intern(model) if model_id is None else model_id))
        blocks = list(blocks or ())
        text_cells = self._text_cells(shape, session_id, texts, blocks) if session_id or texts or blocks else []
        if shape.inline_salt:
            inline = salts[0] if salts else (0, 0, 0)
            salts = salts[1:]
        seq = self._writer.seq & _MASK32
        et = shape.etype
        ncells = 1 + len(shape.field_cells) + len(salts) + len(samples) + len(blocks) + len(text_cells)
        args = self._head_and_fields(shape, values, timestamp, seq, ncells)
        index = 1 + len(shape.field_cells)
        if shape.inline_salt:  # at most three fields, all in the head cell: the group follows them
            args += inline
        for row in salts:
            args += (seq, layout.CELL_SALT, et, index, *row)
            index += 1
        for row in samples:
            args += (seq, layout.CELL_SAMPLED, et, index, *row)
            index += 1
        for i, (_, block_id, th) in enumerate(blocks):
            args += (seq, layout.CELL_BLOCK, et, index, TEXT_FIELD_BLOCK_REQUESTS + i, block_id, th & _MASK64)
            index += 1
        for number, piece in text_cells:
            args += (seq, layout.CELL_TEXT, et, index, number, len(piece), piece)
            index += 1
        key = (shape.etype, len(salts), len(samples), len(blocks), len(text_cells))
        return self._structs.get(key) or self._compile(shape, key), ncells, args

    @staticmethod
    def _text_cells(shape: _Shape, session_id: str, texts: tuple[str, ...],
                    blocks: list[tuple[str, int, int]]) -> list[tuple[int, bytes]]:
        cells: list[tuple[int, bytes]] = []
        if session_id:
            cells += [(TEXT_FIELD_SESSION, p) for p in _text_pieces(session_id, SESSION_ID_MAX_BYTES)]
        for (number, max_bytes), text in zip(shape.text_fields, texts):
            cells += [(number, p) for p in _text_pieces(text, max_bytes)]
        for i, (request_id, _, _) in enumerate(blocks):
            cells += [(TEXT_FIELD_BLOCK_REQUESTS + i, p) for p in _text_pieces(request_id, BLOCK_REQUEST_ID_MAX_BYTES)]
        return cells

    def _compile(self, shape: _Shape, key: _ShapeKey) -> struct.Struct:
        _, n_salts, n_samples, n_blocks, n_text_cells = key
        fmt = "<" + shape.head_fmt + "".join(fmt for _, fmt in shape.field_cells)
        fmt += _SALT_FMT * n_salts + _SAMPLED_FMT * n_samples + _BLOCK_FMT * n_blocks + _TEXT_FMT * n_text_cells
        record = struct.Struct(fmt)
        if len(self._structs) < 4096:  # bound the cache; unusual shapes still work uncached
            self._structs[key] = record
        return record


class EventPublisher(Protocol):
    """What a cache process publishes through: the ring's :class:`Publisher`, or a benchmark's (one that drops
    everything, one that feeds LMCache-style in-process sinks)."""

    def emit(self, etype: EventType, fields: tuple[Any, ...] = (), *, salt_counts: SaltCounts | None = None,
             sampled: Sampled = (), session_id: str = "", texts: tuple[str, ...] = (), blocks: Blocks = (),
             timestamp_ns: int | None = None) -> bool: ...

    def emit_salted(self, etype: EventType, cache_salt: str, model_name: str, count: int) -> bool: ...

    def fields_emitter(self, etype: EventType) -> Callable[[tuple[Any, ...], str], bool]: ...

