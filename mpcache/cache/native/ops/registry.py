"""The operation table of the cache's own protocol: one decorated function per operation.

:func:`operation` declares an operation's request fields (validators from
:mod:`mpcache.contract.protocol`), whether a file descriptor comes with it, its reply fields and the
request-flow events it publishes.  The
dispatcher, the client's typed calls (a test) and ``docs/PROTOCOL.md`` (:mod:`mpcache.cache.native.ops.doc`)
all follow this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpcache.contract.events import EventType
from mpcache.contract.protocol import Field

if TYPE_CHECKING:
    from mpcache.cache.buffers import Peer
    from mpcache.cache.context import CacheContext

Args = dict[str, Any]
Reply = dict[str, Any]
Handler = Callable[["CacheContext", "Peer", Args], Reply]


@dataclass(frozen=True)
class Operation:
    """One operation: its request fields (name, validator, default or REQUIRED), reply fields, the
    request-flow events it may publish (not counting the L1/L2 events of the chunks it touches)
    and its handler.  ``descriptor``: the request comes with exactly one file descriptor (SCM_RIGHTS),
    which the handler finds as ``args["fd"]`` and may use, but not keep: it is closed after the request."""

    name: str
    fields: tuple[Field, ...]
    replies: tuple[str, ...]
    handler: Handler
    events: tuple[EventType, ...] = ()
    descriptor: bool = False

    @property
    def summary(self) -> str:
        return (self.handler.__doc__ or "").strip().split("\n")[0]


OPERATIONS: dict[str, Operation] = {}


def operation(name: str, *fields: Field, replies: tuple[str, ...] = (), events: tuple[EventType, ...] = (),
              descriptor: bool = False) -> Callable[[Handler], Handler]:
    """Register ``handler`` as operation ``name`` with these request fields, reply fields and events (and
    a file descriptor with each request, if ``descriptor``)."""

    def register(handler: Handler) -> Handler:
        if name in OPERATIONS:
            raise ValueError(f"operation {name!r} is declared twice")
        OPERATIONS[name] = Operation(name, fields, replies, handler, events, descriptor)
        return handler

    return register
