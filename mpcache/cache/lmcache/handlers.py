"""Every LMCache operation, declared once (:mod:`.operations`): the ones mpcache serves as one method each
(:func:`~.operations.served`), the others as rows (:func:`~.operations.refused`).  Every handler takes the
request's decoded arguments (a keyed operation's first one still a frame) and the peer's uid, and returns
the result to send (None: a reply with no result frame; a :class:`Wait`: answered later).

Request state belongs to the uid that created it: with several possible owners, request ids are kept per uid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpcache.cache.client_errors import RateLimit
from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache import wire
from mpcache.cache.lmcache.engine import EngineDriven
from mpcache.cache.lmcache.kvevents import ALL_MODELS, CAPABILITY, MAX_EVENTS, KVEventStreams
from mpcache.cache.lmcache.operations import OPERATIONS, refused, served
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError

__all__ = ["OPERATIONS", "LMCacheHandlers", "Subscribe", "Wait"]

WarnOnce = Callable[[bytes, str, str, str], None]  # (client, operation, event, fix)
Widen = Callable[[bytes], None]  # a client whose connection may carry KV objects inline
MAX_TIMEOUT_S = 86400
MAX_ALIGNMENT = 1 << 20

_ENGINE_DRIVEN = '"lmcache.mp.mp_transfer_mode": "engine_driven"'
_NO_LMCACHE_DRIVEN = f"lmcache_driven transfer (CUDA IPC handles) is not supported; set {_ENGINE_DRIVEN}"
_NO_Q_CACHES = "query caches are not supported"
_NO_BLENDING = "cache blending over the LMCache protocol is not supported (use mpcache's cb_* ops)"
_NO_P2P = "peer-to-peer transfer is not supported"
_NO_SERVER_MODULES = "server modules are not supported"
_FAILED_TRANSFER = [b"", False]

refused("register_kv_cache", 1, _NO_LMCACHE_DRIVEN)
refused("unregister_kv_cache", 2, _NO_LMCACHE_DRIVEN)
refused("register_q_cache", 3, _NO_Q_CACHES)
refused("unregister_q_cache", 4, _NO_Q_CACHES)
refused("store_q", 5, _NO_Q_CACHES, _FAILED_TRANSFER)
refused("store", 6, _NO_LMCACHE_DRIVEN, _FAILED_TRANSFER)
refused("retrieve", 7, _NO_LMCACHE_DRIVEN, _FAILED_TRANSFER)
refused("cb_register_rope", 25, _NO_BLENDING)
refused("cb_unregister_rope", 26, _NO_BLENDING)
refused("cb_retrieve_pre_computed", 27, _NO_BLENDING, _FAILED_TRANSFER)
refused("cb_unified_lookup", 28, _NO_BLENDING)
refused("p2p_lookup_and_lock", 29, _NO_P2P)
refused("p2p_query_lookup_results", 30, _NO_P2P)
refused("p2p_unlock_objects", 31, _NO_P2P)
refused("cb_protocol_handshake", 33, _NO_BLENDING, [0, False])
refused("cb_reorder_plan", None, _NO_BLENDING, [])
refused("server_module_call", None, _NO_SERVER_MODULES)
refused("server_module_affinity_call", None, _NO_SERVER_MODULES)


@dataclass(frozen=True, slots=True)
class Wait:
    """wait_prefetch_status on a prefetch still running: answer when it finishes or ``timeout`` s pass."""

    request_id: str
    timeout: float


@dataclass(frozen=True, slots=True)
class Subscribe:
    """subscribe_kv_events: a stream to open (its batches follow as credits allow)."""

    instance_id: int
    model_name: str
    cursor: int
    max_events: int


class LMCacheHandlers:
    """Serves LMCache's operations against ``ctx`` through ``engine``; ``client`` is the identity of the
    connection whose request is in hand (for one-per-client warnings, and ``widen`` once it registers or
    prepares a transfer: its worker's transfers may carry KV objects inline, LMCache 0.5.7's way where the pool
    cannot be mapped; a worker that reconnects prepares each transfer before it commits one)."""

    def __init__(self, ctx: CacheContext, engine: EngineDriven, streams: KVEventStreams, *, one_owner: bool,
                 warn_once: WarnOnce, widen: Widen) -> None:
        self._ctx = ctx
        self._streams = streams
        self._log = ctx.log
        self.engine = engine
        self._one_owner = one_owner
        self._warn_once = warn_once
        self._widen = widen
        self._unknown_log = RateLimit()
        self._decode = wire.Decoder(ctx.config.lmcache_max_tokens)
        self.client: bytes | None = None

    def decode(self, frame: bytes) -> Any:
        return self._decode(frame)

    # -- the process ------------------------------------------------------------------------

    @served("get_chunk_size", 21, (0, 0))
    def get_chunk_size(self, args: list[Any], owner: int) -> int:
        return self.engine.registrations.bind_chunk_size()

    @served("negotiate_chunk_size", None, (1, 1))
    def negotiate_chunk_size(self, args: list[Any], owner: int) -> int:
        """LMCache 0.5.7's first request: the chunk size, a multiple of the client's alignment.  A size that cannot
        be one is answered with the bound size, which the client's own check refuses, naming both numbers."""
        alignment = protocol.int_range(1, MAX_ALIGNMENT)(args[0], "required_chunk_alignment")
        try:
            return self.engine.negotiate_chunk_size(alignment)
        except RequestError as exc:
            self._warn_once(self.client or b"", "negotiate_chunk_size", "lmcache.chunk_size_refused", str(exc))
            return self.engine.chunk_tokens

    @served("get_experimental", 32, (0, 0), failure=[])
    def get_experimental(self, args: list[Any], owner: int) -> list[str]:
        """The KV event stream where it is on (LMCache 0.5.6's worker subscribes only then)."""
        return [CAPABILITY] if self._streams.enabled else []

    @served("subscribe_kv_events", None, (4, 4), stream=True)
    def subscribe_kv_events(self, args: list[Any], owner: int) -> Subscribe:
        """``(instance_id, model_name, cursor, max_events)``: a stream of L1's changes (:mod:`.kvevents`)."""
        model = ALL_MODELS if args[1] == ALL_MODELS else protocol.MODEL(args[1], "model_name")
        return Subscribe(wire.instance_id(args[0]), model,
                         protocol.int_range(0, (1 << 63) - 1)(args[2], "cursor"),
                         protocol.int_range(1, MAX_EVENTS)(args[3], "max_events"))

    @served("noop", 24, (0, 0), failure="OK")
    def noop(self, args: list[Any], owner: int) -> str:
        return "OK"

    @served("ping", 22, (0, 1), failure=False)
    def ping(self, args: list[Any], owner: int) -> bool:
        """True, except once for an instance this process does not know (see :meth:`.Registrations.ping`)."""
        instance = None if not args or args[0] is None else wire.instance_id(args[0])
        known = self.engine.registrations.ping(instance, owner)
        if not known:
            extra = self._unknown_log.allow(self.client, "ping")
            if extra is not None:
                self._log.info("lmcache.unknown_instance", instance_id=instance,
                               action="answered one ping False so that the worker registers again", **extra)
        return known

    @served("clear", 20, (0, 1))
    def clear(self, args: list[Any], owner: int) -> None:
        if not self._ctx.config.lmcache_allow_clear:
            self._warn_once(self.client or b"", "clear", "lmcache.clear_refused",
                            "clear empties L1 for every engine: an operator action; start the cache with "
                            "--lmcache-allow-clear to let LMCache clients do it")
            return
        evicted = self._ctx.l1.clear()
        self._log.info("lmcache.clear", evicted=evicted, uid=owner)

    # -- registration -----------------------------------------------------------------------

    @served("register_kv_cache_engine_driven_context", 14, (1, 1), failure={"shm_name": "", "pool_size": 0})
    def register_kv_cache_engine_driven_context(self, args: list[Any], owner: int) -> dict:
        reply = self.engine.register(args[0], owner)
        self._widen(self.client or b"")
        return reply

    @served("unregister_kv_cache_engine_driven_context", 15, (1, 1))
    def unregister_kv_cache_engine_driven_context(self, args: list[Any], owner: int) -> None:
        self.engine.unregister(wire.instance_id(args[0]), owner)

    @served("report_block_allocation", 23, (3, 3))
    def report_block_allocation(self, args: list[Any], owner: int) -> None:
        records = wire.parse_block_records(args[2])
        if not self._one_owner:  # its request ids as end_session names them
            records = [(self._scoped(request_id, owner), blocks, tokens) for request_id, blocks, tokens in records]
        self._ctx.l0.report(wire.instance_id(args[0]), protocol.MODEL(args[1], "model_name"), records)

    # -- lookups ----------------------------------------------------------------------------

    @served("lookup", 8, (2, 2), keyed=True)
    def lookup(self, args: list[Any], owner: int) -> None:
        self.engine.lookup(self._key(args[0], owner))

    @served("query_prefetch_status", 9, (1, 1), failure=0)
    def query_prefetch_status(self, args: list[Any], owner: int) -> int | None:
        return self.engine.prefetch_status(self._request_id(args[0], owner))

    @served("wait_prefetch_status", 10, (2, 2), failure=0)
    def wait_prefetch_status(self, args: list[Any], owner: int) -> int | None | Wait:
        request_id = self._request_id(args[0], owner)
        timeout = args[1]
        if type(timeout) not in (int, float) or not 0 <= timeout <= MAX_TIMEOUT_S:
            raise ProtocolError(f"timeout: expected seconds in 0..{MAX_TIMEOUT_S}")
        if self.engine.is_pending(request_id):
            return Wait(request_id, timeout)
        return self.engine.prefetch_status(request_id)

    @served("free_lookup_locks", 12, (2, 3), keyed=True)
    def free_lookup_locks(self, args: list[Any], owner: int) -> None:
        """``(key, tp_size[, extra_ranges])``: 0.5.7 adds the ranges of abandoned lookups."""
        extra = [] if len(args) < 3 else _ranges(args[2], "extra_ranges")
        self.engine.free_lookup_locks(self._key(args[0], owner), extra)

    @served("end_session", 13, (1, 1))
    def end_session(self, args: list[Any], owner: int) -> None:
        self.engine.end_session(self._request_id(args[0], owner))

    # -- transfers --------------------------------------------------------------------------

    @served("prepare_store", 16, (2, 3), keyed=True, failure={"context": {}})
    def prepare_store(self, args: list[Any], owner: int) -> dict:
        """``(key, instance_id[, skipped_chunks])``: 0.5.7 adds the chunks each KV cache group skips (empty, or one
        list per group of a hybrid model's registration)."""
        reply = self.engine.prepare_store(self._key(args[0], owner), wire.instance_id(args[1]), owner,
                                          args[2] if len(args) > 2 else None, self.client or b"")
        self._widen(self.client or b"")
        return reply

    @served("commit_store", 17, (3, 3), keyed=True, failure=False)
    def commit_store(self, args: list[Any], owner: int) -> bool:
        return self.engine.commit_store(self._key(args[0], owner), wire.instance_id(args[1]), args[2], owner)

    @served("prepare_retrieve", 18, (2, 2), keyed=True, failure={"success": False, "data": b"", "context": {}})
    def prepare_retrieve(self, args: list[Any], owner: int) -> dict:
        reply = self.engine.prepare_retrieve(self._key(args[0], owner), wire.instance_id(args[1]), owner)
        self._widen(self.client or b"")  # before the reply is sent: it may carry the objects
        return reply

    @served("commit_retrieve", 19, (2, 2), keyed=True, failure=False)
    def commit_retrieve(self, args: list[Any], owner: int) -> bool:
        return self.engine.commit_retrieve(self._key(args[0], owner), wire.instance_id(args[1]), owner)

    # -- arguments --------------------------------------------------------------------------

    def _scoped(self, request_id: str, owner: int) -> str:
        return request_id if self._one_owner else f"{owner}/{request_id}"

    def _request_id(self, value: Any, owner: int) -> str:
        return self._scoped(protocol.REQUEST_ID(value, "request_id"), owner)

    def _key(self, frame: bytes, owner: int) -> wire.Key:
        return self.engine.keys.key(frame, "" if self._one_owner else f"{owner}/")


def _ranges(value: Any, name: str) -> list[tuple[int, int]]:
    """``[[start, end], …]`` token ranges."""
    if type(value) is not list or not all(type(pair) is list and len(pair) == 2 for pair in value):
        raise ProtocolError(f"{name}: expected a list of [start, end] pairs")
    position = protocol.int_range(0, (1 << 62) - 1)
    return [(position(start, f"{name}.start"), position(end, f"{name}.end")) for start, end in value]
