"""The operation table of the cache's own protocol: one declaration per operation (name, fields, handler).

An operation is a function ``handler(ctx, peer, args) -> reply`` decorated with :func:`operation`,
which declares its request fields (validators from :mod:`mpcache.contract.protocol`) and the fields
of its reply.  The dispatcher, the protocol reference (``docs/PROTOCOL.md``) and the client's
generic :meth:`~mpcache.client.CacheClient.call` all follow this table: adding an operation is one
decorated function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpcache.contract.protocol import Field

if TYPE_CHECKING:
    from mpcache.cache.buffers import Peer
    from mpcache.cache.context import CacheContext

Args = dict[str, Any]
Reply = dict[str, Any]
Handler = Callable[["CacheContext", "Peer", Args], Reply]


@dataclass(frozen=True)
class Operation:
    name: str
    fields: tuple[Field, ...]
    replies: tuple[str, ...]
    handler: Handler

    @property
    def summary(self) -> str:
        return (self.handler.__doc__ or "").strip().split("\n")[0]


OPERATIONS: dict[str, Operation] = {}


def operation(name: str, *fields: Field, replies: tuple[str, ...] = ()) -> Callable[[Handler], Handler]:
    """Register ``handler`` as operation ``name`` with these request fields and reply fields."""

    def register(handler: Handler) -> Handler:
        if name in OPERATIONS:
            raise ValueError(f"operation {name!r} is declared twice")
        OPERATIONS[name] = Operation(name, fields, replies, handler)
        return handler

    return register
