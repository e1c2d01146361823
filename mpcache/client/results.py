"""What the client's typed calls return: one small frozen type per kind of reply.

Each field reads one key of its operation's reply (the key is the field's name unless it says
otherwise), and a test holds every type to the reply fields its operation declares in
:data:`mpcache.cache.native.ops.OPERATIONS`, so the client cannot drift from the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from mpcache.contract.blending import HITS
from mpcache.errors import ProtocolError

R = TypeVar("R")
_KEYS: dict[type, tuple[str, ...]] = {}


def _key(reply_key: str) -> Any:
    """A field that reads ``reply_key`` of the reply (not its own name)."""
    return field(metadata={"reply": reply_key})


def reply_keys(result_type: type) -> tuple[str, ...]:
    """The reply keys ``result_type`` reads, in field order."""
    keys = _KEYS.get(result_type)
    if keys is None:
        keys = _KEYS[result_type] = tuple(f.metadata.get("reply", f.name) for f in fields(result_type))
    return keys


def from_reply(result_type: type[R], reply: Mapping[str, Any]) -> R:
    """``result_type`` built from a reply map; ProtocolError if a key it reads is missing."""
    try:
        return result_type(*[reply[key] for key in reply_keys(result_type)])
    except KeyError as exc:
        raise ProtocolError(f"{result_type.__name__}: the reply has no {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """``ping``: which cache process answered."""

    pid: int
    worker: int


@dataclass(frozen=True, slots=True)
class StoreResult:
    """``store``: chunks newly copied into L1, already cached (skipped), and without room (failed)."""

    stored: int = _key("stored_count")
    skipped: int = _key("skipped_count")
    failed: int = _key("failed_count")


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    """``query_prefetch_status``: a prefetch job's progress (``found_count`` chunks are ready to retrieve
    once ``done``; the hit split by tier, in tokens; ``expired`` jobs released their read locks)."""

    done: bool
    found_count: int
    requested_count: int
    hit_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int
    l2_loaded_count: int
    expired: bool


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    """``retrieve`` and ``cb_retrieve``: chunks copied into the buffer, and those no longer in L1."""

    retrieved: int = _key("retrieved_count")
    failed: int = _key("failed_count")


@dataclass(frozen=True, slots=True)
class BlockReport:
    """``report_block_allocations``: records and blocks reported, blocks sampled, events published."""

    records: int = _key("record_count")
    blocks: int = _key("block_count")
    sampled: int = _key("sampled_count")
    events: int = _key("event_count")


@dataclass(frozen=True, slots=True)
class BlendStoreResult:
    """``cb_store_pre_computed`` and ``cb_store_final``: as :class:`StoreResult`, plus fingerprints newly
    indexed (registered) and stale entries the new objects took over (replaced)."""

    stored: int = _key("stored_count")
    skipped: int = _key("skipped_count")
    failed: int = _key("failed_count")
    registered: int = _key("registered_count")
    replaced: int = _key("replaced_count")


@dataclass(frozen=True, slots=True)
class BlendLookup:
    """``cb_lookup``: a status per whole chunk (:mod:`mpcache.contract.blending`: MISS, PREFIX_HIT,
    FINGERPRINT_HIT, STALE), the id to retrieve hits with (None without hits) and the counts."""

    lookup_id: int | None
    no_gpu_context: bool
    chunks: tuple[int, ...]
    requested_tokens: int
    hit_tokens: int
    prefix_hits: int
    fingerprint_hits: int
    storage_hits: int
    stale_chunks: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))

    @property
    def hits(self) -> list[int]:
        """Indices of the chunks a ``cb_retrieve`` can copy (prefix or fingerprint hits)."""
        return [index for index, status in enumerate(self.chunks) if status in HITS]
