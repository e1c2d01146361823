"""LMCache 0.5.7's KV cache groups (hybrid models): each group's object layout, its objects' keys, and which
prefix of a request the groups can serve together.

A hybrid model (full attention beside sliding-window or recurrent layers) registers one ``group_layouts``
entry per KV cache group.  Each group is its own L1 object per chunk and KV rank, sized by its own layout
(a sliding-window group stores only its window of each chunk), keyed apart from the other groups.  A group
of window ``w`` chunks (a recurrent group is ``w`` = 1) needs only the last ``w`` chunks of a prefix to serve
it; full attention needs all of them.  The hit of a lookup is the longest prefix every group can serve, and
each group then holds just the chunks it needs for it: LMCache's ``fold`` and ``unfold``
(``lmcache/v1/distributed/bitmap_ops/fold.py``, whose pure-Python ``_fold_python`` is the reference here).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError

# torch dtype names a worker may register, and their element sizes
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8, "double": 8,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8}
# the name torch gives each dtype (str(dtype) without "torch."): what slots and inline tensors carry
CANONICAL_DTYPE = {**{name: name for name in DTYPE_BYTES}, "half": "float16", "float": "float32", "double": "float64"}
MAX_GROUPS = 64  # LMCache's inline envelope carries at most 64 groups
FULL = -1  # the window of a full-attention group: the whole prefix
_GROUP_PERSON = b"mpcache-kvgroup"  # blake2b personalization: group keys never collide with rank keys
_LAYERS = protocol.int_range(1, 1 << 16)
_HIDDEN = protocol.int_range(1, 1 << 24)
_COUNT = protocol.int_range(0, 1 << 24)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One KV cache group's object (one chunk, one KV rank): its tensor shape, torch dtype name and bytes, and
    the trailing chunks of a prefix it needs for a hit (``FULL``: all of them)."""

    shape: tuple[int, ...]
    dtype: str
    object_bytes: int
    window: int = FULL
    recurrent: bool = False


def layout(shape: Sequence[int], dtype: str, window: int = FULL, recurrent: bool = False) -> GroupLayout:
    """The layout of objects of ``shape`` and ``dtype`` (a name of :data:`DTYPE_BYTES`)."""
    return GroupLayout(tuple(shape), CANONICAL_DTYPE[dtype], math.prod(shape) * DTYPE_BYTES[dtype], window, recurrent)


def check_dtype(value: Any, field: str) -> str:
    if type(value) is not str or value not in DTYPE_BYTES:
        raise ProtocolError(f"{field}: {str(value)[:32]!r} is not a supported torch dtype name")
    return value


def parse_group_layouts(value: Any, use_mla: bool, chunk_tokens: int) -> tuple[GroupLayout, ...]:
    """``group_layouts`` as LMCache's server reads it: per group ``[2,] layers, window_tokens, hidden`` (two planes
    unless ``kv_size`` is 1, or is 0 — unreported — and the top-level ``use_mla`` is set), ``window_tokens`` 0
    meaning the whole chunk, ``window_chunks`` 0 meaning full attention.  A group that cannot be one of this
    server's chunks is a RequestError naming it; a malformed field a ProtocolError."""
    if type(value) is not list:
        raise ProtocolError(f"group_layouts: expected a list, got {type(value).__name__}")
    if len(value) > MAX_GROUPS:
        raise RequestError(f"group_layouts: {len(value)} KV cache groups; at most {MAX_GROUPS} are served "
                           "(LMCache's own inline transfer carries no more)")
    return tuple(_group(item, f"group_layouts[{index}]", use_mla, chunk_tokens) for index, item in enumerate(value))


def _group(item: Any, name: str, use_mla: bool, chunk_tokens: int) -> GroupLayout:
    if not isinstance(item, dict):
        raise ProtocolError(f"{name}: expected a map, got {type(item).__name__}")
    for required in ("num_layers", "hidden_dim_size", "dtype_str", "tokens_per_block"):
        if required not in item:
            raise ProtocolError(f"{name}.{required}: missing")
    layers = _LAYERS(item["num_layers"], f"{name}.num_layers")
    hidden = _HIDDEN(item["hidden_dim_size"], f"{name}.hidden_dim_size")
    dtype = check_dtype(item["dtype_str"], f"{name}.dtype_str")
    _COUNT(item["tokens_per_block"], f"{name}.tokens_per_block")
    tokens = _COUNT(item.get("window_tokens", 0), f"{name}.window_tokens") or chunk_tokens
    if tokens > chunk_tokens:
        raise RequestError(f"{name}.window_tokens: {tokens} tokens per object, more than the {chunk_tokens}-token "
                           "chunk this server hashes")
    planes = protocol.int_range(0, 2)(item.get("kv_size", 0), f"{name}.kv_size") or (1 if use_mla else 2)
    window = _COUNT(item.get("window_chunks", 0), f"{name}.window_chunks") or FULL
    recurrent = item.get("recurrent", False)
    if type(recurrent) is not bool:
        raise ProtocolError(f"{name}.recurrent: expected a boolean")
    shape = (layers, tokens, hidden) if planes == 1 else (2, layers, tokens, hidden)
    return layout(shape, dtype, window, recurrent)


def group_keys(rank_keys: Sequence[int], ranks: int, groups: int) -> list[int]:
    """Every chunk's objects, chunk-major and (group, rank)-minor, from its ``ranks`` rank keys (chunk-major):
    group 0's keys are the rank keys themselves (a model of one group keys its objects the same way), group
    ``g`` > 0's are the rank key hashed with ``g``."""
    blake2b = hashlib.blake2b
    out: list[int] = []
    for start in range(0, len(rank_keys), ranks):
        chunk = rank_keys[start : start + ranks]
        out.extend(chunk)
        for group in range(1, groups):
            suffix = group.to_bytes(4, "little")
            out.extend(int.from_bytes(blake2b(key.to_bytes(8, "little") + suffix, digest_size=8,
                                              person=_GROUP_PERSON).digest(), "little") for key in chunk)
    return out


def parse_skipped(value: Any, groups: int, chunks: int) -> list[set[int]]:
    """prepare_store's ``skipped_chunks``: per KV cache group, the chunk positions of the key (``chunks`` of them)
    the worker will not store, its blocks there all the null block.  Empty, or one list per group of a
    registration of ``groups`` (0: one that sent no ``group_layouts``, which skips nothing)."""
    if value is None or value == []:
        return [set() for _ in range(max(1, groups))]
    if not groups:
        raise ProtocolError("skipped_chunks: expected [] (only a registration of several KV cache groups skips "
                            "chunks)")
    if type(value) is not list or len(value) != groups or not all(type(skips) is list for skips in value):
        raise ProtocolError(f"skipped_chunks: expected one list of chunk positions per registered group ({groups})")
    for group, skips in enumerate(value):
        if not all(type(chunk) is int and 0 <= chunk < chunks for chunk in skips):
            raise ProtocolError(f"skipped_chunks[{group}]: expected chunk positions of the key (0..{chunks - 1})")
    return [set(skips) for skips in value]


def window_start(length: int, window: int) -> int:
    """The first chunk a group of ``window`` needs to serve a prefix of ``length`` chunks (LMCache's
    ``unfold_range``): 0 for full attention, else ``length - window`` (never below 0)."""
    return 0 if window <= 0 else max(0, length - window)


def hit_length(present: Sequence[Sequence[bool]], windows: Sequence[int]) -> int:
    """The longest prefix, in chunks, that every group can serve (LMCache's ``fold`` and its highest set bit):
    a prefix of ``L`` chunks needs the last ``min(window, L)`` chunks of each group present (``present[g][j]``:
    chunk ``j`` of group ``g``, all its KV ranks).  Not the longest run from the start: a sliding-window group
    can serve a longer prefix than a shorter one."""
    chunks = len(present[0]) if present else 0
    servable = [True] * chunks
    for row, window in zip(present, windows, strict=True):
        needed = chunks if window <= 0 else window
        run = 0
        for chunk in range(chunks):
            run = run + 1 if row[chunk] else 0
            if run < min(needed, chunk + 1):
                servable[chunk] = False
    return max((chunk + 1 for chunk in range(chunks) if servable[chunk]), default=0)
