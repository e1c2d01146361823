"""An L2 adapter that keeps one file per chunk under a directory.

Layout: ``<path>/<ns>/<hh>/<chunk>.chunk`` where ``ns`` is 16 hex digits of a
blake2b hash of (model_name, cache_salt), ``chunk`` the 16 hex digits of the
chunk hash and ``hh`` its first two, so no user string ever reaches a path.
Each file is one chunk record (header, name, payload: see
:mod:`mpcache.cache.l2.base`).

Writes go to ``.<chunk>.<unique>.tmp`` in the final directory and are renamed
into place with ``os.replace``, so a crash leaves either the old state or a
complete file, plus perhaps a stray temp file that nothing reads (start-up
removes those older than ``stale_temp_s``).  Loads check the record's checksum
and its key: a file cut short or corrupted is removed and reported as failed,
never loaded.

Start-up scans the directory and rebuilds the index from record headers (the
checksum is checked on load, not during the scan), in LRU order by mtime; loads
and lookup hits refresh a file's mtime, so LRU order survives restarts.  If the
files found exceed the capacity, the oldest are removed.

One directory belongs to one adapter instance (one cache process): the index
and the capacity are in memory, not shared.  Use redis for a shared tier.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from mpcache.cache.l2.base import (
    HEADER_BYTES,
    LoadResult,
    LruIndex,
    PooledAdapter,
    StoreResult,
    Usage,
    byte_view,
    decode_record,
    encode_name,
    name_end,
    parse_header,
    record_header,
)
from mpcache.contract.keys import ChunkKey

_SUFFIX = ".chunk"
_TEMP_SUFFIX = ".tmp"


def _namespace(key: ChunkKey) -> str:
    name = encode_name(ChunkKey(key.model_name, key.cache_salt, 0))
    return hashlib.blake2b(name, digest_size=8).hexdigest()


class FsL2Adapter(PooledAdapter):
    """Chunk files under ``path``, LRU-evicted at ``capacity_bytes`` of payload."""

    name = "fs"

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        *,
        threads: int = 4,
        fsync: bool = False,
        stale_temp_s: float = 60.0,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.path = os.path.abspath(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._index = LruIndex(capacity_bytes)
        self._scan(stale_temp_s)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-fs")

    def file_path(self, key: ChunkKey) -> str:
        """Where ``key``'s chunk file lives (whether or not it exists)."""
        chunk = f"{key.chunk_hash:016x}"
        return os.path.join(self.path, _namespace(key), chunk[:2], chunk + _SUFFIX)

    # -- the interface -------------------------------------------------------------------------

    def get_usage(self) -> Usage:
        return self._index.usage()


    # -- worker side ---------------------------------------------------------------------------

    def _store(self, items: list[tuple[ChunkKey, memoryview]]) -> StoreResult:
        evicted: list[ChunkKey]
        stored, skipped, failed, evicted = [], [], [], []
        written = 0
        for key, data in items:
            try:
                path = self.file_path(key)
                header = record_header(key, data)
            except (ValueError, OverflowError, struct.error):  # a name or hash a record cannot hold
                failed.append(key)
                continue
            reservation = self._index.reserve(key, len(data), on_evict=self._unlink_quietly)
            evicted.extend(victim for victim, _ in reservation.evicted)
            if reservation.outcome == "present":
                skipped.append(key)
                self._touch(path)
            elif reservation.outcome == "no_room":
                failed.append(key)
            elif self._write(path, header, data):
                self._index.commit(key)
                stored.append(key)
                written += len(data)
            else:
                self._index.abort(key)
                failed.append(key)
        return StoreResult(stored, skipped, failed, written, evicted)

    def _write(self, path: str, header: bytes, data: memoryview) -> bool:
        directory, filename = os.path.split(path)
        temp = os.path.join(directory, f".{filename[: -len(_SUFFIX)]}.{uuid.uuid4().hex}{_TEMP_SUFFIX}")
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with open(fd, "wb", closefd=True) as handle:
                    handle.write(header)
                    handle.write(data)
                    handle.flush()
                    if self.fsync:
                        os.fsync(handle.fileno())
            except BaseException:
                os.unlink(temp)
                raise
            os.replace(temp, path)
            return True
        except OSError:  # unwritable directory, full disk (ENOSPC, EFBIG), ...
            return False

    def _lookup(self, keys: list[ChunkKey]) -> list[bool]:
        found = self._index.touch(keys)
        for key, hit in zip(keys, found):
            if hit:
                self._touch(self.file_path(key))
        return found

    def _load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> LoadResult:
        result = LoadResult()
        for key, destination in zip(keys, destinations):
            (result.loaded if self._load_one(key, destination) else result.failed).append(key)
        return result

    def _load_one(self, key: ChunkKey, destination: memoryview) -> bool:
        if not self._index.touch([key])[0]:
            return False
        path = self.file_path(key)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            self._index.remove(key)
            return False
        except OSError:
            return False
        decoded = decode_record(data)
        if decoded is None or decoded[0] != key:  # cut short, corrupted, or not this chunk's file
            self._index.remove(key, on_remove=self._unlink_quietly)
            return False
        payload = decoded[1]
        try:
            target = byte_view(destination)
            if len(target) != len(payload):
                return False
            target[:] = payload
        except (TypeError, ValueError):  # read-only or non-contiguous destination
            return False
        self._touch(path)
        return True

    def _delete(self, keys: list[ChunkKey]) -> int:
        return sum(self._index.remove(key, on_remove=self._unlink_quietly) for key in keys)

    def _unlink_quietly(self, key: ChunkKey) -> None:
        try:
            os.unlink(self.file_path(key))
        except OSError:
            pass  # already gone, or the directory is read-only: the index no longer lists it

    @staticmethod
    def _touch(path: str) -> None:
        try:
            os.utime(path)
        except OSError:
            pass  # LRU order after a restart is best effort

    # -- start-up ------------------------------------------------------------------------------

    def _scan(self, stale_temp_s: float) -> None:
        """Rebuild the index from the files under :attr:`path` (oldest mtime first)."""
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError:
            pass  # stores will fail; loads find nothing
        found: list[tuple[int, str, ChunkKey, int]] = []
        stale_before = time.time() - stale_temp_s
        for directory, _, filenames in os.walk(self.path):
            for filename in filenames:
                path = os.path.join(directory, filename)
                if filename.endswith(_TEMP_SUFFIX):
                    self._remove_stale_temp(path, stale_before)
                elif filename.endswith(_SUFFIX):
                    entry = self._read_entry(path)
                    if entry is not None:
                        found.append(entry)
        found.sort(key=lambda entry: (entry[0], entry[1]))
        for _, _, key, size in found:
            self._index.add(key, size)
        while self._index.usage().used_bytes > self.capacity_bytes:  # capacity shrank since last run
            self._index.remove(self._index.keys_lru()[0], on_remove=self._unlink_quietly)

    def _read_entry(self, path: str) -> tuple[int, str, ChunkKey, int] | None:
        """``(mtime_ns, path, key, payload size)`` of a plausible chunk file; removes implausible ones."""
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                head = handle.read(HEADER_BYTES)
                end = name_end(head)
                header = None if end is None else parse_header(head + handle.read(end - HEADER_BYTES))
        except OSError:
            return None
        if (header is None or stat.st_size != header.payload_offset + header.payload_len
                or self.file_path(header.key) != path):
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        return stat.st_mtime_ns, path, header.key, header.payload_len

    @staticmethod
    def _remove_stale_temp(path: str, stale_before: float) -> None:
        try:
            if os.stat(path).st_mtime < stale_before:
                os.unlink(path)
        except OSError:
            pass
