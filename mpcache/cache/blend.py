"""Cache blending state of a cache process: the fingerprint table and the logic of the ``cb_*`` operations,
so the KV of a chunk that reappears at another position can be reused (``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from mpcache.cache.buffers import Buffer, Peer
from mpcache.cache.l1 import POOL_LOST, L1Manager
from mpcache.contract.blending import (
    FINGERPRINT_HIT,
    MISS,
    PREFIX_HIT,
    STALE,
    chunk_fingerprints,
)
from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey, chunk_hashes
from mpcache.errors import RequestError
from mpcache.shm.publish import EventPublisher

_CB_REQUEST_START = EventType.CB_REQUEST_START
_CB_REQUEST_END = EventType.CB_REQUEST_END
_CB_LOOKUP_START = EventType.CB_LOOKUP_START
_CB_LOOKUP_END = EventType.CB_LOOKUP_END
_CB_RETRIEVE_START = EventType.CB_RETRIEVE_START
_CB_RETRIEVE_END = EventType.CB_RETRIEVE_END
_CB_STORE_PRE_COMPUTED_START = EventType.CB_STORE_PRE_COMPUTED_START
_CB_STORE_PRE_COMPUTED_END = EventType.CB_STORE_PRE_COMPUTED_END
_CB_STORE_FINAL_START = EventType.CB_STORE_FINAL_START
_CB_STORE_FINAL_END = EventType.CB_STORE_FINAL_END
_CB_FINGERPRINTS_REGISTERED = EventType.CB_FINGERPRINTS_REGISTERED
_CB_CHUNKS_EVICTED = EventType.CB_CHUNKS_EVICTED
_SM_WRITE_FINISHED = EventType.SM_WRITE_FINISHED
_SM_READ_PREFETCHED_FINISHED = EventType.SM_READ_PREFETCHED_FINISHED

DEFAULT_MAX_SESSIONS = 65536
DEFAULT_MAX_LOOKUPS_PER_SESSION = 16
MAX_HITS_KEPT = 1 << 18  # lookups' hits kept for their retrieves, over all sessions: the newest lookups' (1,024 of
# a whole 64 Ki-token prompt of 256-token chunks)


class FingerprintTable:
    """Bounded LRU map: fingerprint key ``ChunkKey(model, salt, fingerprint)`` → the object's ChunkKey.

    At capacity the least recently used entry gives way (counted in
    :attr:`dropped`, not an eviction of a stale entry).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.dropped = 0
        self._entries: OrderedDict[ChunkKey, ChunkKey] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, fkey: ChunkKey) -> bool:
        return fkey in self._entries

    def get(self, fkey: ChunkKey) -> ChunkKey | None:
        """The object key of a fingerprint (now the most recently used), or None."""
        target = self._entries.get(fkey)
        if target is not None:
            self._entries.move_to_end(fkey)
        return target

    def remove(self, fkey: ChunkKey) -> bool:
        return self._entries.pop(fkey, None) is not None

    def register(self, fkey: ChunkKey, target: ChunkKey, present: Callable[[ChunkKey], bool]) -> tuple[bool, bool]:
        """Index ``fkey`` → ``target``; returns (newly indexed, a stale entry was replaced).

        An entry that already points at ``target``, or at another object that
        is still ``present``, is kept (and touched): not newly indexed.  An
        entry whose object is gone is stale and is replaced.
        """
        entries = self._entries
        existing = entries.get(fkey)
        if existing is not None and (existing == target or present(existing)):
            entries.move_to_end(fkey)
            return False, False
        entries[fkey] = target
        entries.move_to_end(fkey)
        if existing is None and len(entries) > self.capacity:
            entries.popitem(last=False)
            self.dropped += 1
        return True, existing is not None


class _Lookup:
    __slots__ = ("model", "salt", "hits")

    def __init__(self, model: str, salt: str, hits: dict[int, ChunkKey]) -> None:
        self.model = model
        self.salt = salt
        self.hits = hits  # chunk index -> the object holding that chunk's KV


class BlendState:
    """The cb_* operations of one cache process (single-threaded, like its loop)."""

    def __init__(self, l1: L1Manager, publisher: EventPublisher, chunk_tokens: int, *, table_capacity: int,
                 max_sessions: int = DEFAULT_MAX_SESSIONS,
                 max_lookups_per_session: int = DEFAULT_MAX_LOOKUPS_PER_SESSION) -> None:
        self._l1 = l1
        self._pub = publisher
        self._chunk_tokens = chunk_tokens
        self.table = FingerprintTable(table_capacity)
        self._max_sessions = max_sessions
        self._max_lookups = max_lookups_per_session
        self._sessions: OrderedDict[str, OrderedDict[int, _Lookup]] = OrderedDict()  # request id -> its lookups
        # every lookup kept, oldest first: its id → (its request id, its hits); their hits at most MAX_HITS_KEPT
        # (entries of lookups gone since, with their session, count until they reach the front)
        self._kept: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._hits_kept = 0
        self._next_lookup_id = 1

    # -- sessions ------------------------------------------------------------------------

    def _session(self, request_id: str) -> OrderedDict[int, _Lookup]:
        lookups = self._sessions.get(request_id)
        if lookups is None:
            lookups = self._sessions[request_id] = OrderedDict()
            self._pub.emit(_CB_REQUEST_START, session_id=request_id)
            if len(self._sessions) > self._max_sessions:  # abandoned sessions give way, oldest first
                self._sessions.popitem(last=False)
        return lookups

    def _keep(self, request_id: str, lookup_id: int, hits: int) -> None:
        """A lookup's ``hits`` are kept for its retrieves: the oldest lookups' give way past :data:`MAX_HITS_KEPT`
        (a client may look up and never end its requests)."""
        kept = self._kept
        kept[lookup_id] = (request_id, hits)
        self._hits_kept += hits
        while self._hits_kept > MAX_HITS_KEPT:
            oldest, (request, count) = kept.popitem(last=False)
            self._hits_kept -= count
            session = self._sessions.get(request)
            if session is not None:
                session.pop(oldest, None)

    def end_session(self, request_id: str) -> bool:
        """``end_session`` of a request: CB_REQUEST_END if it did any cb_* op; returns whether it did."""
        if self._sessions.pop(request_id, None) is None:
            return False
        self._pub.emit(_CB_REQUEST_END, session_id=request_id)
        return True

    def _present(self, key: ChunkKey) -> bool:
        return self._l1.contains(key)

    def _evicted(self, count: int) -> None:
        if count:
            self._pub.emit(_CB_CHUNKS_EVICTED, (count,))

    # -- stores --------------------------------------------------------------------------

    def store(self, peer: Peer, args: dict, final: bool) -> dict:
        """cb_store_final (``final``) or cb_store_pre_computed."""
        start, end = ((_CB_STORE_FINAL_START, _CB_STORE_FINAL_END) if final
                      else (_CB_STORE_PRE_COMPUTED_START, _CB_STORE_PRE_COMPUTED_END))
        request_id, model, salt, engine = args["request_id"], args["model_name"], args["cache_salt"], args["engine_id"]
        tokens, block_ids = args["tokens"], args["block_ids"]
        pub = self._pub
        self._session(request_id)
        num_tokens = len(tokens)
        pub.emit(start, (engine, num_tokens), session_id=request_id)
        stored = 0
        try:
            chunk = self._chunk_tokens
            fingerprints = chunk_fingerprints(tokens, chunk)
            if len(block_ids) != len(fingerprints):
                raise RequestError(f"block_ids: {len(block_ids)} entries for {len(fingerprints)} whole chunks of "
                                   f"{chunk} tokens")
            buffer = self._buffer(peer, args["buffer_id"], block_ids)
            hashes = chunk_hashes(tokens, chunk) if final else fingerprints
            stored, present, failed = self._copy_in(buffer, model, salt, hashes, block_ids)
        except BaseException:
            pub.emit(end, (engine, num_tokens, stored, False), session_id=request_id)
            raise
        registered = replaced = 0
        table = self.table
        l1 = self._l1
        for chunk_hash, fp in zip(hashes, fingerprints):
            target = ChunkKey(model, salt, chunk_hash)
            if not l1.contains(target):  # its allocation failed: nothing to index
                continue
            new, stale = table.register(ChunkKey(model, salt, fp), target, self._present)
            registered += new
            replaced += stale
        if registered:
            pub.emit(_CB_FINGERPRINTS_REGISTERED, (registered, registered * chunk))
        self._evicted(replaced)
        pub.emit(end, (engine, num_tokens, stored, failed == 0), session_id=request_id)
        return {"stored_count": stored, "skipped_count": present, "failed_count": failed,
                "registered_count": registered, "replaced_count": replaced}

    @staticmethod
    def _buffer(peer: Peer, buffer_id: int, block_ids: list[int]) -> Buffer:
        if not block_ids:  # nothing to copy, but the buffer must still be one of this connection's
            return peer.known_buffer(buffer_id)
        return peer.buffer(buffer_id, block_ids)

    def _copy_in(self, buffer: Buffer, model: str, salt: str, hashes: list[int],
                 block_ids: list[int]) -> tuple[int, int, int]:
        """Client blocks → L1 (as ``store`` does); returns (stored, already present, failed)."""
        l1 = self._l1
        generation = l1.generation()
        reservation = l1.reserve_write(model, salt, hashes, chained=False)  # fingerprints: no prefix
        committed = [hashes[p] for p in reservation.positions]
        nbytes = buffer.block_bytes
        try:
            buffer.transfer.to_l1(l1.pool, [(block_ids[p], offset) for p, offset in zip(reservation.positions,
                                                                                         reservation.offsets)], nbytes)
            _check_generation(l1, generation, len(committed))
        except BaseException:
            l1.abort_write(model, salt, committed)
            raise
        sampled = l1.commit_write(model, salt, committed, nbytes)
        stored = len(committed)
        self._pub.emit(_SM_WRITE_FINISHED, (reservation.failed,),
                                    salt_counts={(salt, model): stored} if stored else None, sampled=sampled)
        return stored, reservation.present, reservation.failed

    # -- lookup --------------------------------------------------------------------------

    def lookup(self, peer: Peer, args: dict) -> dict:
        request_id, model, salt, tokens = args["request_id"], args["model_name"], args["cache_salt"], args["tokens"]
        pub = self._pub
        lookups = self._session(request_id)
        num_tokens = len(tokens)
        pub.emit(_CB_LOOKUP_START, (num_tokens,), session_id=request_id)
        if not peer.buffers:  # no KV buffer registered: nothing could receive a blend
            pub.emit(_CB_LOOKUP_END, (num_tokens, 0, 0, 0, 0, 0, True), session_id=request_id)
            return {"lookup_id": None, "no_gpu_context": True, "chunks": [], "requested_tokens": 0,
                    "hit_tokens": 0, "prefix_hits": 0, "fingerprint_hits": 0, "storage_hits": 0, "stale_chunks": 0}
        chunk = self._chunk_tokens
        l1 = self._l1
        table = self.table
        statuses: list[int] = []
        hits: dict[int, ChunkKey] = {}
        prefix_hits = storage_hits = stale = 0
        for index, (chunk_hash, fp) in enumerate(zip(chunk_hashes(tokens, chunk), chunk_fingerprints(tokens, chunk))):
            key = ChunkKey(model, salt, chunk_hash)
            if l1.contains(key):
                statuses.append(PREFIX_HIT)
                hits[index] = key
                prefix_hits += 1
                continue
            fkey = ChunkKey(model, salt, fp)
            target = table.get(fkey)
            if target is None:
                statuses.append(MISS)
            elif l1.contains(target):
                statuses.append(FINGERPRINT_HIT)
                hits[index] = target
                storage_hits += 1
            else:
                table.remove(fkey)
                statuses.append(STALE)
                stale += 1
        self._evicted(stale)
        requested = len(statuses) * chunk
        hit_tokens = (prefix_hits + storage_hits) * chunk
        lookup_id = None
        if hits:
            lookup_id = self._next_lookup_id
            self._next_lookup_id += 1
            lookups[lookup_id] = _Lookup(model, salt, hits)
            while len(lookups) > self._max_lookups:
                lookups.popitem(last=False)
            self._keep(request_id, lookup_id, len(hits))
        pub.emit(_CB_LOOKUP_END, (num_tokens, requested, hit_tokens, storage_hits + stale, storage_hits, stale, False),
                 session_id=request_id)
        return {"lookup_id": lookup_id, "no_gpu_context": False, "chunks": statuses, "requested_tokens": requested,
                "hit_tokens": hit_tokens, "prefix_hits": prefix_hits, "fingerprint_hits": storage_hits + stale,
                "storage_hits": storage_hits, "stale_chunks": stale}

    # -- retrieve ------------------------------------------------------------------------

    def retrieve(self, peer: Peer, args: dict) -> dict:
        request_id, engine, worker = args["request_id"], args["engine_id"], args["worker_id"]
        indices, block_ids = args["chunk_indices"], args["block_ids"]
        pub = self._pub
        lookups = self._session(request_id)
        wanted = len(block_ids)
        pub.emit(_CB_RETRIEVE_START, (engine, wanted, worker), session_id=request_id)
        try:
            retrieved = self._copy_out(peer, args, lookups, indices, block_ids)
        except BaseException:
            pub.emit(_CB_RETRIEVE_END, (engine, wanted, False, worker), session_id=request_id)
            raise
        pub.emit(_CB_RETRIEVE_END, (engine, wanted, retrieved == wanted, worker), session_id=request_id)
        return {"retrieved_count": retrieved, "failed_count": wanted - retrieved}

    def _copy_out(self, peer: Peer, args: dict, lookups: OrderedDict[int, _Lookup], indices: list[int],
                  block_ids: list[int]) -> int:
        """L1 → client blocks for the named hit chunks of a lookup; returns chunks copied."""
        if len(indices) != len(block_ids):
            raise RequestError(f"block_ids: {len(block_ids)} entries for {len(indices)} chunk_indices")
        buffer = self._buffer(peer, args["buffer_id"], block_ids)
        lookup = lookups.get(args["lookup_id"])
        if lookup is None:
            raise RequestError(f"lookup_id: unknown lookup {args['lookup_id']} of request {args['request_id']}")
        keys = []
        for index in indices:
            key = lookup.hits.get(index)
            if key is None:
                raise RequestError(f"chunk_indices: chunk {index} was not a hit of lookup {args['lookup_id']}")
            keys.append(key)
        model, salt = lookup.model, lookup.salt
        l1 = self._l1
        hashes = [key.chunk_hash for key in keys]
        generation = l1.generation()
        # Read-lock what is still there, run by run (L1_READ_RESERVED); a chunk gone since the lookup breaks a run
        locked_at: list[int] = []
        missing: list[int] = []
        position = 0
        while position < len(hashes):
            found = l1.lock_prefix(model, salt, hashes[position:])
            locked_at.extend(range(position, position + found))
            position += found
            if position < len(hashes):
                missing.append(hashes[position])
                position += 1
        if missing:
            l1.read(model, salt, missing)  # nothing readable: L1_READ_FAILED (not_found / write_locked) for each
        read = [hashes[i] for i in locked_at]
        try:
            objects = l1.read(model, salt, read)
            nbytes = buffer.block_bytes
            for _, size in objects:
                if size != nbytes:
                    raise RequestError(f"chunks were stored from {size}-byte blocks; this buffer has {nbytes}-byte "
                                       "blocks")
            if read:
                buffer.transfer.from_l1(l1.pool, [(block_ids[i], offset) for i, (offset, _) in zip(locked_at, objects)],
                                        nbytes)
                _check_generation(l1, generation, len(read))
        except BaseException:
            l1.release_read(model, salt, read)
            raise
        sampled = l1.finish_read(model, salt, read)  # unlocked: now the most recently used
        retrieved = len(read)
        self._pub.emit(_SM_READ_PREFETCHED_FINISHED, (len(keys) - retrieved,),
                                    salt_counts={(salt, model): retrieved} if retrieved else None, sampled=sampled)
        return retrieved


def _check_generation(l1: L1Manager, generation: int, objects: int) -> None:
    """RequestError (the ``objects`` counted as lost copies) if L1's pool was lost since ``generation``."""
    if l1.lost_since(generation, objects):
        raise RequestError(POOL_LOST)
