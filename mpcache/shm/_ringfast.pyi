"""Type stub of the optional C extension ``mpcache.shm._ringfast`` (``_ringfast.c``).

What its PyMethodDef / PyMemberDef tables, ``tp_init`` keyword lists and
vectorcall entry points define.  Keep it in step with the C file.
"""

import struct
from collections.abc import Callable, Sequence
from typing import Any, final

from _typeshed import ReadableBuffer, WriteableBuffer
from typing_extensions import disjoint_base

@disjoint_base  # a C layout of its own: a class cannot derive from it and another such base
class WriterCore:
    """The ring producer's state and append protocol (compiled); RingWriter subclasses it."""

    # PyMemberDef, writable (T_ULONGLONG)
    _head: int  # cells committed so far
    _limit: int  # last tail seen plus capacity
    seq: int  # sequence number of the next record
    # PyMemberDef, READONLY
    @property
    def _buf(self) -> WriteableBuffer: ...  # the segment's buffer (T_OBJECT)
    @property
    def _capacity(self) -> int: ...  # ring capacity in cells
    @property
    def _mask(self) -> int: ...  # capacity - 1
    @property
    def _cells_off(self) -> int: ...  # byte offset of cell 0 (T_PYSSIZET)
    def __init__(
        self,
        buffer: WriteableBuffer,
        cells_offset: int,
        capacity: int,
        cell_size: int,
        head_offset: int,
        tail_offset: int,
        dropped_offset: int,
        empty_cell: ReadableBuffer,
    ) -> None: ...
    # PyMethodDef
    def append(self, record: struct.Struct, ncells: int, args: Sequence[Any], /) -> bool: ...  # METH_FASTCALL
    def _has_room(self, ncells: int, /) -> bool: ...  # METH_O
    def count_drop(self) -> None: ...  # METH_NOARGS

@final
class OneCellEmitter:
    """emit(a, b, c) -> bool: publish one templated cell into a ring (compiled hot path)."""

    def __init__(
        self,
        core: WriterCore,
        template: ReadableBuffer,
        seq_offset: int,
        timestamp_offset: int,
        value_offsets: tuple[int, int, int],
        clock: Callable[[], int] | None = None,
    ) -> None: ...
    def __call__(self, a: int, b: int, c: int, /) -> bool: ...  # vectorcall, positional only

@final
class FieldsEmitter:
    """emit(fields, session_id[, timestamp_ns]) -> bool: publish one fixed-field record (compiled hot path)."""

    def __init__(
        self,
        core: WriterCore,
        head_templates: tuple[ReadableBuffer, ReadableBuffer],
        fields_templates: tuple[ReadableBuffer, ...],  # one per FIELDS cell, at most 3
        text_template: ReadableBuffer,
        field_slots: tuple[tuple[int, int, str], ...],  # (cell, byte offset, kind 'q' | 'Q' | 'd' | 'n')
        seq_offset: int,
        timestamp_offset: int,
        text_length_offset: int,
        text_data_offset: int,
        ids: dict[str, int],
        clock: Callable[[], int] | None,
        fallback: Callable[..., bool],
    ) -> None: ...
    def __call__(
        self, fields: Sequence[object], session_id: str, timestamp_ns: int | None = None, /
    ) -> bool: ...  # vectorcall, positional only
