"""LMCache's MP-mode operations, one declaration each: its name, LMCache's frozen wire id (None for an
operation sent by name only, as every operation from 0.5.7 on), how many argument frames it takes,
whether its first argument is a key (:meth:`.keycache.KeyCache.key`), the value a refused request is
answered with (LMCache's failure value of its reply type; None: a reply with no result frame), and either
its handler or the reason it is not served.  A stream (``subscribe_kv_events``) is answered by a reply per credit
the client grants, then one with no result frame that ends it; its failure value is that end.

Every operation is declared in :mod:`.handlers`: a served one on its handler (:func:`served`), one mpcache
does not serve as a row (:func:`refused`).  The front end dispatches by this table alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from mpcache.errors import ProtocolError

Handler = Callable[[Any, list[Any], int], Any]  # (handlers, decoded arguments, the peer's uid) → the result


@dataclass(frozen=True, slots=True)
class Operation:
    """One LMCache operation (see the module's docstring); ``arguments``: the fewest and most argument frames
    a served operation takes (an older client may leave trailing ones out)."""

    name: str
    wire_id: int | None
    arguments: tuple[int, int]
    keyed: bool
    failure: Any
    handler: Handler | None = None
    unsupported: str | None = None
    stream: bool = False


OPERATIONS: dict[str, Operation] = {}


def _declare(operation: Operation) -> None:
    if operation.name in OPERATIONS:
        raise ValueError(f"LMCache operation {operation.name!r} is declared twice")
    if operation.wire_id is not None and any(op.wire_id == operation.wire_id for op in OPERATIONS.values()):
        raise ValueError(f"LMCache wire id {operation.wire_id} is declared twice")
    OPERATIONS[operation.name] = operation


def served(name: str, wire_id: int | None, arguments: tuple[int, int], *, keyed: bool = False,
           failure: Any = None, stream: bool = False) -> Callable[[Handler], Handler]:
    """Declare the decorated method as the handler of operation ``name`` (``stream``: it opens a stream)."""

    def register(handler: Handler) -> Handler:
        _declare(Operation(name, wire_id, arguments, keyed, failure, handler=handler, stream=stream))
        return handler

    return register


def refused(name: str, wire_id: int | None, reason: str, failure: Any = None) -> None:
    """Declare an operation that is answered with ``failure`` and one warning per client naming ``reason``."""
    _declare(Operation(name, wire_id, (0, 0), False, failure, unsupported=reason))


# LMCache's frozen table (lmcache/v1/multiprocess/transport/zmq_impl/wire.py): id 11 is retired, and no
# operation added after 0.5.6 has an id.
FROZEN_WIRE_IDS = frozenset(range(1, 34)) - {11}


class OperationFrames:
    """The operation a request's op frame names, by wire id or by name; ProtocolError if none.  Built once the
    table is complete (after :mod:`.handlers` declared the served operations): the usual frames (a wire id as
    a positive fixint, a name as a msgpack str) are found by their bytes, any other encoding by its value."""

    def __init__(self) -> None:
        by_value: dict[int | str, Operation] = {op.name: op for op in OPERATIONS.values()}
        by_value.update({op.wire_id: op for op in OPERATIONS.values() if op.wire_id is not None})
        self._by_value = by_value
        self._frames = {msgpack.packb(value): op for value, op in by_value.items()}

    def __call__(self, frame: bytes) -> Operation:
        operation = self._frames.get(frame)
        if operation is not None:
            return operation
        try:
            value = msgpack.unpackb(frame, raw=False, max_str_len=64, max_bin_len=64, max_array_len=0,
                                    max_map_len=0, max_ext_len=0)
        except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
            raise ProtocolError(f"op: not an operation id or name (frame {frame[:32].hex()})") from None
        operation = self._by_value.get(value) if type(value) in (int, str) else None
        if operation is None:
            raise ProtocolError(f"op: unknown operation {str(value)[:64]!r}")
        return operation
