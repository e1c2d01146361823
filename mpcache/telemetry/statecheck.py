"""Checks on the state a checkpoint decoded into (msgpack's lists, dicts, ints, floats, str and bytes): what a
subscriber's ``load_state`` asks of it before adopting any of it.  Each returns the value in the shape asked
for, or raises ValueError naming what did not fit.
"""

from __future__ import annotations

from typing import Any

import msgpack

_KINDS: dict[str, tuple[type, ...]] = {"i": (int,), "s": (str,), "b": (bytes,), "f": (int, float), "l": (list,),
                                       "d": (dict,)}


def fits(value: object, kind: str) -> bool:
    """``kind``: ``i`` int, ``s`` str, ``b`` bytes, ``f`` a number, ``n`` int or None, ``l`` a list, ``S`` a list
    of str, ``d`` a dict."""
    if kind == "n":
        return value is None or type(value) is int
    if kind == "S":
        return type(value) is list and all(type(item) is str for item in value)
    return type(value) in _KINDS[kind]


def rows(value: object, kinds: str) -> list[tuple[Any, ...]]:
    """``value`` as a list of tuples, each of ``len(kinds)`` items of those kinds (see :func:`fits`)."""
    if type(value) is not list:
        raise ValueError(f"expected a list of rows, got {type(value).__name__}")
    out = []
    for row in value:
        if type(row) is not list or len(row) != len(kinds) or not all(map(fits, row, kinds)):
            raise ValueError(f"expected a row of {kinds!r}, got {row!r:.80}")
        out.append(tuple(row))
    return out


def items(value: object, kind: str, limit: int | None = None) -> list[Any]:
    """``value`` as a list of items of ``kind``, at most ``limit`` of them."""
    if type(value) is not list or not all(fits(item, kind) for item in value):
        raise ValueError(f"expected a list of {kind!r}")
    if limit is not None and len(value) > limit:
        raise ValueError(f"{len(value)} items, at most {limit} allowed")
    return value


def fields(value: object, **kinds: str) -> dict[str, Any]:
    """``value`` as a dict with exactly these keys, each of its kind (see :func:`fits`)."""
    if type(value) is not dict or set(value) != set(kinds):
        raise ValueError(f"expected the fields {sorted(kinds)}, got {value!r:.80}")
    for name, kind in kinds.items():
        if not fits(value[name], kind):
            raise ValueError(f"field {name}: expected {kind!r}, got {value[name]!r:.80}")
    return value


def entries(value: object, key_kinds: str, value_kinds: str) -> list[tuple[tuple[Any, ...], Any]]:
    """``value`` as the (key, value) pairs ``list(d.items())`` of a dict keyed by tuples of ``key_kinds`` packs
    into (a value of one kind as it is, of several as a tuple)."""
    if type(value) is not list:
        raise ValueError(f"expected a list of entries, got {type(value).__name__}")
    single = len(value_kinds) == 1
    out = []
    for item in value:
        if type(item) is not list or len(item) != 2:
            raise ValueError(f"expected a [key, value] entry, got {item!r:.80}")
        key, found = item
        if type(key) is not list or len(key) != len(key_kinds) or not all(map(fits, key, key_kinds)):
            raise ValueError(f"expected a key of {key_kinds!r}, got {key!r:.80}")
        if single and not fits(found, value_kinds) or not single and (
                type(found) is not list or len(found) != len(value_kinds) or not all(map(fits, found, value_kinds))):
            raise ValueError(f"expected a value of {value_kinds!r}, got {found!r:.80}")
        out.append((tuple(key), found if single else tuple(found)))
    return out


def unpack(data: bytes) -> Any:
    """msgpack's decoding of a checkpoint's ``data``, bounded by its own length (msgpack's default limits), with
    no extension types."""
    def no_extensions(code: int, _data: bytes) -> Any:
        raise ValueError(f"msgpack extension type {code} in a checkpoint")

    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=no_extensions)
