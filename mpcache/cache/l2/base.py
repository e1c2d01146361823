"""What every L2 adapter offers (non-blocking operations returning futures; failures reported and counted,
never raised), the chunk record fs and redis share (MAC'd with the deployment's L2 key), and an LRU index.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from mpcache.cache.l2.failures import FailureCounts
from mpcache.contract.keys import ChunkKey

RECORD_MAGIC = b"MPL2"
RECORD_VERSION = 2  # 2: the checksum is a MAC keyed with the deployment's L2 key (1 was unkeyed)
_FIXED = struct.Struct("<4sHHHxxQQ")  # magic, version, model_len, salt_len, pad, chunk_hash, payload_len
_CHECKSUM_BYTES = 16
HEADER_BYTES = _FIXED.size + _CHECKSUM_BYTES  # 44
_MAX_NAME = 0xFFFF
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 64  # what blake2b accepts as a key (and at least 128 bits)


class L2LookupError(Exception):
    """A lookup's storage could not be asked (connection error, timeout, server marked down)."""


def check_mac_key(mac_key: bytes) -> bytes:
    """``mac_key`` if an adapter can key records with it; ValueError otherwise."""
    if not isinstance(mac_key, bytes) or not MIN_KEY_BYTES <= len(mac_key) <= MAX_KEY_BYTES:
        raise ValueError(f"mac_key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
    return mac_key


@dataclass(frozen=True)
class StoreResult:
    """Outcome of one store task.  Every submitted key is in exactly one of stored/skipped/failed."""

    stored: list[ChunkKey] = field(default_factory=list)  # written by this task
    skipped: list[ChunkKey] = field(default_factory=list)  # already present (or being written): not rewritten
    failed: list[ChunkKey] = field(default_factory=list)  # could not be written (I/O error, injected, too big)
    bytes_written: int = 0  # payload bytes of ``stored``; skipped and failed keys excluded
    evicted: list[ChunkKey] = field(default_factory=list)  # removed by LRU eviction to make room


@dataclass(frozen=True)
class LoadResult:
    """Outcome of one load task.  Every requested key is in exactly one of loaded/failed."""

    loaded: list[ChunkKey] = field(default_factory=list)  # copied into its destination
    failed: list[ChunkKey] = field(default_factory=list)  # missing, corrupt, wrong size or injected failure
    # subsets of ``failed``: records that did not verify (corrupt or forged), and storage errors (I/O, timeouts)
    rejected: list[ChunkKey] = field(default_factory=list)
    errors: list[ChunkKey] = field(default_factory=list)
    # subset of ``loaded``: chunks another service instance stored (a shared tier that knows its writers)
    peer: list[ChunkKey] = field(default_factory=list)


class Usage(NamedTuple):
    """How full an adapter is (payload bytes)."""

    used_bytes: int
    capacity_bytes: int
    key_count: int


class L2Adapter(ABC):
    """One L2 storage tier.  Thread-safe; operations complete on the adapter's own threads."""

    name: str  # the type name: "fs", "mock", "redis"
    capacity_bytes: int
    failures: FailureCounts  # what went wrong, by kind (read and logged by the storage manager)
    # the tier's own index of what it holds, where this process keeps one (fs, mock): the KV event feed lists it
    # in a resync and checks each store task's changes against it; None where it cannot (a shared redis)
    listing: LruIndex | None = None

    @abstractmethod
    def submit_store(self, items: list[tuple[ChunkKey, bytes | memoryview]]) -> Future[StoreResult]:
        """Write chunks not already present, evicting least-recently-used ones to make room.

        The caller must keep each buffer unchanged until the future completes.
        """

    @abstractmethod
    def lookup(self, keys: list[ChunkKey]) -> Future[list[bool | None]]:
        """Which of ``keys`` are held; each hit counts as an access for LRU.  ``None`` for a key whose part of
        the tier could not be asked (a sharded tier with a shard down): a miss, counted as a lookup error."""

    @abstractmethod
    def submit_load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> Future[LoadResult]:
        """Copy each present, valid chunk into its destination.

        A chunk is copied only when its payload is exactly ``len`` of its
        destination (bytes); nothing is ever written outside a destination, and
        a failed key's destination is left untouched.  A load counts as an access.
        """

    @abstractmethod
    def delete(self, keys: list[ChunkKey]) -> Future[int]:
        """Remove ``keys``; the future gives how many were present."""

    @abstractmethod
    def get_usage(self) -> Usage:
        """Current usage; cheap, never blocks on storage, callable from any thread."""

    @abstractmethod
    def close(self) -> None:
        """Wait for in-flight tasks, then release threads and connections.  Idempotent."""


# -- chunk records -----------------------------------------------------------------------------


class PooledAdapter(L2Adapter):
    """An adapter whose operations run on its own thread pool (``self._pool``): subclasses
    implement the blocking ``_store``, ``_lookup``, ``_load`` and ``_delete``."""

    _pool: ThreadPoolExecutor

    def submit_store(self, items: list[tuple[ChunkKey, bytes | memoryview]]) -> Future[StoreResult]:
        return self._pool.submit(self._store, [(key, byte_view(data)) for key, data in items])

    def lookup(self, keys: list[ChunkKey]) -> Future[list[bool | None]]:
        return self._pool.submit(self._lookup, list(keys))

    def submit_load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> Future[LoadResult]:
        check_load_args(keys, destinations)
        return self._pool.submit(self._load, list(keys), list(destinations))

    def delete(self, keys: list[ChunkKey]) -> Future[int]:
        return self._pool.submit(self._delete, list(keys))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @abstractmethod
    def _store(self, items: list[tuple[ChunkKey, memoryview]]) -> StoreResult: ...

    @abstractmethod
    def _lookup(self, keys: list[ChunkKey]) -> list[bool | None]: ...

    @abstractmethod
    def _load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> LoadResult: ...

    @abstractmethod
    def _delete(self, keys: list[ChunkKey]) -> int: ...


def encode_name(key: ChunkKey) -> bytes:
    """``key`` as bytes that identify it exactly (fixed fields of a record, minus lengths)."""
    model = key.model_name.encode("utf-8")
    salt = key.cache_salt.encode("utf-8")
    return struct.pack("<HHQ", len(model), len(salt), key.chunk_hash) + model + salt


def decode_name(data: bytes) -> ChunkKey:
    """Inverse of :func:`encode_name`."""
    model_len, salt_len, chunk_hash = struct.unpack_from("<HHQ", data)
    model = data[12 : 12 + model_len].decode("utf-8")
    salt = data[12 + model_len : 12 + model_len + salt_len].decode("utf-8")
    return ChunkKey(model, salt, chunk_hash)


def key_digest(key: ChunkKey) -> str:
    """Stable 128-bit hex digest of ``key``: what paths and server-side names are built from."""
    return hashlib.blake2b(encode_name(key), digest_size=16).hexdigest()


def record_header(key: ChunkKey, payload: bytes | memoryview, mac_key: bytes) -> bytes:
    """Header + name bytes of ``key``'s record, MAC'd with ``mac_key``; the payload follows it."""
    model = key.model_name.encode("utf-8")
    salt = key.cache_salt.encode("utf-8")
    if len(model) > _MAX_NAME or len(salt) > _MAX_NAME:
        raise ValueError("model_name or cache_salt longer than 65535 UTF-8 bytes")
    fixed = _FIXED.pack(RECORD_MAGIC, RECORD_VERSION, len(model), len(salt), key.chunk_hash, len(payload))
    digest = hashlib.blake2b(fixed, digest_size=_CHECKSUM_BYTES, key=mac_key)
    digest.update(model)
    digest.update(salt)
    digest.update(payload)
    return fixed + digest.digest() + model + salt


def encode_record(key: ChunkKey, payload: bytes | memoryview, mac_key: bytes) -> bytes:
    """The whole record of ``key`` holding ``payload``, MAC'd with ``mac_key``."""
    return record_header(key, payload, mac_key) + payload


def record_size(key: ChunkKey, payload_len: int) -> int:
    """Bytes of ``key``'s record holding ``payload_len`` bytes."""
    return HEADER_BYTES + len(key.model_name.encode("utf-8")) + len(key.cache_salt.encode("utf-8")) + payload_len


class RecordHeader(NamedTuple):
    key: ChunkKey
    payload_offset: int
    payload_len: int


def name_end(data: bytes | memoryview) -> int | None:
    """Where a record's name bytes end (its payload starts), from its first :data:`HEADER_BYTES`."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, model_len, salt_len, _, _ = _FIXED.unpack_from(data)
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        return None
    return HEADER_BYTES + model_len + salt_len


def parse_header(data: bytes | memoryview) -> RecordHeader | None:
    """The key and payload extent a record declares, or ``None`` when the header is not ours.

    Reads only the header and name bytes (enough for an fs index scan); the
    MAC is checked by :func:`check_record`.
    """
    offset = name_end(data)
    if offset is None or len(data) < offset:
        return None
    _, _, model_len, _, chunk_hash, payload_len = _FIXED.unpack_from(data)
    try:
        model = bytes(data[HEADER_BYTES : HEADER_BYTES + model_len]).decode("utf-8")
        salt = bytes(data[HEADER_BYTES + model_len : offset]).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return RecordHeader(ChunkKey(model, salt, chunk_hash), offset, payload_len)


class RecordCheck(NamedTuple):
    """What :func:`check_record` found."""

    status: str  # "ok"; "malformed" (not a complete record of this format); "bad_mac" (corrupt or forged)
    key: ChunkKey | None = None  # the key the record declares (when it parses)
    payload: memoryview | None = None  # only when ``status`` is "ok"


def check_record(data: bytes | memoryview, mac_key: bytes) -> RecordCheck:
    """Parse ``data`` as a whole record and verify its MAC with ``mac_key`` (in constant time)."""
    header = parse_header(data)
    if header is None or len(data) != header.payload_offset + header.payload_len:
        return RecordCheck("malformed", header.key if header is not None else None)
    view = memoryview(data)
    digest = hashlib.blake2b(view[: _FIXED.size], digest_size=_CHECKSUM_BYTES, key=mac_key)
    digest.update(view[HEADER_BYTES:])
    if not hmac.compare_digest(digest.digest(), bytes(view[_FIXED.size : HEADER_BYTES])):
        return RecordCheck("bad_mac", header.key)
    return RecordCheck("ok", header.key, view[header.payload_offset :])


def decode_record(data: bytes | memoryview, mac_key: bytes) -> tuple[ChunkKey, memoryview] | None:
    """``(key, payload)`` of a complete record whose MAC verifies with ``mac_key``; ``None`` for anything else."""
    checked = check_record(data, mac_key)
    if checked.status != "ok" or checked.key is None or checked.payload is None:
        return None
    return checked.key, checked.payload


# -- an in-process LRU index (fs and mock) --------------------------------------------------------


class Reservation(NamedTuple):
    """What :meth:`LruIndex.reserve` decided for one key."""

    outcome: str  # "reserved", "present" or "no_room" (bigger than the room not held by writes in flight)
    evicted: list[tuple[ChunkKey, int]]  # (key, size) removed to make room


class LruIndex:
    """Keys and sizes in LRU order (oldest first), with room reserved for writes in flight.

    A write first :meth:`reserve`\\ s its bytes (evicting as needed), then either
    :meth:`commit`\\ s the key (it becomes the most recently used) or
    :meth:`abort`\\ s (the bytes are released).  A key being written counts as
    present for other writers, so two tasks never write the same chunk at once.
    Each method takes the lock once; callers that must act on storage inside
    the same critical section (fs deletes evicted files) pass ``on_evict``.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.lock = threading.Lock()
        self._entries: OrderedDict[ChunkKey, int] = OrderedDict()
        self._pending: dict[ChunkKey, int] = {}
        self._used = 0  # committed + reserved
        self._pending_bytes = 0  # reserved only

    def usage(self) -> Usage:
        """Bytes committed or reserved by writes in flight; keys committed."""
        with self.lock:
            return Usage(self._used, self.capacity_bytes, len(self._entries))

    def reserve(self, key: ChunkKey, size: int, on_evict=None) -> Reservation:
        with self.lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return Reservation("present", [])
            if key in self._pending:
                return Reservation("present", [])
            if self._pending_bytes + size > self.capacity_bytes:  # too big, or room held by writes in flight
                return Reservation("no_room", [])
            evicted = []
            while self._used + size > self.capacity_bytes:
                victim, victim_size = self._entries.popitem(last=False)
                self._used -= victim_size
                evicted.append((victim, victim_size))
                if on_evict is not None:
                    on_evict(victim)
            self._pending[key] = size
            self._pending_bytes += size
            self._used += size
            return Reservation("reserved", evicted)

    def evict_oldest(self, nbytes: int, on_evict: Callable[[ChunkKey], object] | None = None
                     ) -> list[tuple[ChunkKey, int]]:
        """Remove least-recently-used committed entries until ``nbytes`` are freed (or none is left);
        ``on_evict(key)`` runs under the lock for each.  For storage that ran out of room before capacity."""
        evicted = []
        with self.lock:
            freed = 0
            while freed < nbytes and self._entries:
                victim, victim_size = self._entries.popitem(last=False)
                self._used -= victim_size
                freed += victim_size
                evicted.append((victim, victim_size))
                if on_evict is not None:
                    on_evict(victim)
        return evicted

    def commit(self, key: ChunkKey) -> None:
        with self.lock:
            size = self._pending.pop(key)
            self._pending_bytes -= size
            self._entries[key] = size

    def abort(self, key: ChunkKey) -> None:
        with self.lock:
            size = self._pending.pop(key)
            self._pending_bytes -= size
            self._used -= size

    def add(self, key: ChunkKey, size: int) -> None:
        """Insert an existing entry as the most recently used (index rebuilds)."""
        with self.lock:
            if key in self._entries:
                self._used -= self._entries.pop(key)
            self._entries[key] = size
            self._used += size

    def touch(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Mark present ``keys`` as most recently used; which were present."""
        found = []
        with self.lock:
            for key in keys:
                hit = key in self._entries
                if hit:
                    self._entries.move_to_end(key)
                found.append(hit)
        return found

    def contains(self, key: ChunkKey) -> bool:
        with self.lock:
            return key in self._entries

    def remove(self, key: ChunkKey, on_remove=None) -> bool:
        """Drop ``key``; ``on_remove(key)`` runs under the lock when it was present."""
        with self.lock:
            size = self._entries.pop(key, None)
            if size is None:
                return False
            self._used -= size
            if on_remove is not None:
                on_remove(key)
            return True

    def keys_lru(self) -> list[ChunkKey]:
        """Present keys, least recently used first."""
        with self.lock:
            return list(self._entries)

    def present(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which of ``keys`` are committed now (no access counted), under one lock."""
        with self.lock:
            entries = self._entries
            return [key in entries for key in keys]


def check_load_args(keys: Sequence[ChunkKey], destinations: Sequence[memoryview]) -> None:
    if len(keys) != len(destinations):
        raise ValueError(f"submit_load: {len(keys)} keys but {len(destinations)} destinations")


def byte_view(buffer: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``buffer`` (``len`` of it is its size in bytes)."""
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
