"""An L2 adapter with one file per chunk under a private directory: atomic renames, MAC'd records read
without following links, room made on a full device, and an index rebuilt at start-up, so the tier
survives restarts.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
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
    check_mac_key,
    check_record,
    encode_name,
    name_end,
    parse_header,
    record_header,
    record_size,
)
from mpcache.cache.l2.failures import FailureCounts
from mpcache.cache.l2.trust import ensure_private_dir
from mpcache.contract.keys import ChunkKey

_SUFFIX = ".chunk"
_TEMP_SUFFIX = ".tmp"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_CREATE_TRIES = 3  # a store's directory made again where evictions in other threads removed it meanwhile


def _open_regular(path: str) -> int:
    """A read descriptor for ``path`` if it is a regular file (never following a symlink); OSError otherwise."""
    fd = os.open(path, _READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


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
        mac_key: bytes,
        threads: int = 4,
        fsync: bool = False,
        stale_temp_s: float = 60.0,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.path = os.path.abspath(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.failures = FailureCounts()
        self._mac_key = check_mac_key(mac_key)
        ensure_private_dir(self.path, "--l2: fs path")
        self._index = self.listing = LruIndex(capacity_bytes)
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
        stored: list[ChunkKey] = []
        skipped: list[ChunkKey] = []
        failed: list[ChunkKey] = []
        evicted: list[ChunkKey] = []
        written = 0
        for key, data in items:
            try:
                path = self.file_path(key)
                header = record_header(key, data, self._mac_key)
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
            elif self._write_making_room(path, header, data, evicted):
                self._index.commit(key)
                stored.append(key)
                written += len(data)
            else:
                self._index.abort(key)
                failed.append(key)
        return StoreResult(stored, skipped, failed, written, evicted)

    def _write_making_room(self, path: str, header: bytes, data: memoryview, evicted: list[ChunkKey]) -> bool:
        """Write one record; on a full device evict least-recently-used chunks worth its size, retry once."""
        error = self._write(path, header, data)
        if error is not None and error.errno in _NO_SPACE:
            victims = self._index.evict_oldest(len(header) + len(data), on_evict=self._unlink_quietly)
            evicted.extend(victim for victim, _ in victims)
            if victims:
                error = self._write(path, header, data)
            if error is not None:
                self.failures.note("no_space", detail=f"{error.strerror} in {os.path.dirname(path)} "
                                   f"after evicting {len(victims)} chunk(s) to make room")
                return False
        if error is not None:
            self.failures.note("store_error", detail=f"{error.strerror} writing in {os.path.dirname(path)}")
            return False
        return True

    def _write(self, path: str, header: bytes, data: memoryview) -> OSError | None:
        """Write a record to ``path`` through a temp file; the OSError that stopped it, if any."""
        directory, filename = os.path.split(path)
        temp = os.path.join(directory, f".{filename[: -len(_SUFFIX)]}.{uuid.uuid4().hex}{_TEMP_SUFFIX}")
        try:
            fd = self._create(directory, temp)
            try:
                with open(fd, "wb", closefd=True) as handle:
                    handle.write(header)
                    handle.write(data)
                    handle.flush()
                    if self.fsync:
                        os.fsync(handle.fileno())
                os.replace(temp, path)
            except BaseException:
                self._unlink_path_quietly(temp)
                raise
            return None
        except OSError as error:  # unwritable directory, full disk (ENOSPC, EFBIG), ...
            return error

    @staticmethod
    def _create(directory: str, temp: str) -> int:
        """A new temp file in ``directory``, made if missing, and made again where an eviction removed it in
        between (it goes with its last chunk)."""
        tries = 1
        while True:
            os.makedirs(directory, exist_ok=True)
            try:
                return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                if tries == _CREATE_TRIES:
                    raise
                tries += 1

    def _lookup(self, keys: list[ChunkKey]) -> list[bool | None]:
        found: list[bool | None] = list(self._index.touch(keys))
        for key, hit in zip(keys, found):
            if hit:
                self._touch(self.file_path(key))
        return found

    def _load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> LoadResult:
        result = LoadResult()
        for key, destination in zip(keys, destinations):
            outcome = self._load_one(key, destination)
            (result.loaded if outcome == "loaded" else result.failed).append(key)
            if outcome == "rejected":
                result.rejected.append(key)
            elif outcome == "error":
                result.errors.append(key)
        return result

    def _load_one(self, key: ChunkKey, destination: memoryview) -> str:
        """"loaded", or why not: "missing", "rejected" (did not verify), "error" (I/O) or "unfit" (destination)."""
        if not self._index.touch([key])[0]:
            return "missing"
        path = self.file_path(key)
        try:
            target = byte_view(destination)
        except (TypeError, ValueError):  # not a flat byte buffer
            return "unfit"
        expected = record_size(key, len(target))
        try:
            fd = _open_regular(path)
            try:
                if os.fstat(fd).st_size > expected:  # not a record of this destination's size: never read it
                    return "unfit"
                data = _read_at_most(fd, expected)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._index.remove(key)
            return "missing"
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EINVAL):  # a symlink or not a regular file: not ours
                self._reject(key, f"{path} is not a regular file")
                return "rejected"
            self.failures.note("load_error", detail=f"{error.strerror} reading {path}")
            return "error"
        checked = check_record(data, self._mac_key)
        if checked.status != "ok" or checked.key != key or checked.payload is None:
            reason = {"bad_mac": "MAC mismatch", "malformed": "malformed record"}.get(checked.status,
                                                                                     "a record of another chunk")
            self._reject(key, f"{reason} in {path}")
            return "rejected"
        if len(target) != len(checked.payload):
            return "unfit"
        try:
            target[:] = checked.payload
        except (TypeError, ValueError):  # read-only destination
            return "unfit"
        self._touch(path)
        return "loaded"

    def _reject(self, key: ChunkKey, detail: str) -> None:
        """A file at ``key``'s path that is not a valid record of it: count it, drop it from index and disk."""
        self.failures.note("integrity", detail=detail)
        self._index.remove(key, on_remove=self._unlink_quietly)

    def _delete(self, keys: list[ChunkKey]) -> int:
        return sum(self._index.remove(key, on_remove=self._unlink_quietly) for key in keys)

    def _unlink_quietly(self, key: ChunkKey) -> None:
        path = self.file_path(key)
        try:
            os.unlink(path)
        except OSError:
            return  # already gone, or the directory is read-only: the index no longer lists it
        prefix = os.path.dirname(path)
        for directory in (prefix, os.path.dirname(prefix)):  # its hash prefix's, then its (model, salt)'s
            try:
                os.rmdir(directory)  # where that was its last chunk: a client may store under salt after salt
            except OSError:
                return  # not empty (the common case), or gone

    @staticmethod
    def _touch(path: str) -> None:
        try:
            os.utime(path, follow_symlinks=False)
        except OSError:
            pass  # LRU order after a restart is best effort

    # -- start-up ------------------------------------------------------------------------------

    def _scan(self, stale_temp_s: float) -> None:
        """Rebuild the index from the files under :attr:`path` (oldest mtime first)."""
        found: list[tuple[int, str, ChunkKey, int]] = []
        stale_before = time.time() - stale_temp_s
        for directory, _, filenames in os.walk(self.path, topdown=False):  # (a directory after what it holds)
            for filename in filenames:
                path = os.path.join(directory, filename)
                if filename.endswith(_TEMP_SUFFIX):
                    self._remove_stale_temp(path, stale_before)
                elif filename.endswith(_SUFFIX):
                    entry = self._read_entry(path)
                    if entry is not None:
                        found.append(entry)
            if directory != self.path:
                try:
                    os.rmdir(directory)  # an empty one (left by a crash between an eviction and its removal)
                except OSError:
                    pass  # holds chunks
        found.sort(key=lambda entry: (entry[0], entry[1]))
        for _, _, key, size in found:
            self._index.add(key, size)
        while self._index.usage().used_bytes > self.capacity_bytes:  # capacity shrank since last run
            self._index.remove(self._index.keys_lru()[0], on_remove=self._unlink_quietly)

    def _read_entry(self, path: str) -> tuple[int, str, ChunkKey, int] | None:
        """``(mtime_ns, path, key, payload size)`` of a plausible chunk file; removes implausible ones."""
        try:
            fd = _open_regular(path)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EINVAL):  # a symlink, a FIFO, ...: not a chunk file of ours
                self._unlink_path_quietly(path)
            return None
        try:
            info = os.fstat(fd)
            head = _read_at_most(fd, HEADER_BYTES)
            end = name_end(head)
            header = None if end is None else parse_header(head + _read_at_most(fd, end - HEADER_BYTES))
        except OSError:
            return None
        finally:
            os.close(fd)
        if (header is None or info.st_size != header.payload_offset + header.payload_len
                or self.file_path(header.key) != path):
            self._unlink_path_quietly(path)
            return None
        return info.st_mtime_ns, path, header.key, header.payload_len

    @staticmethod
    def _unlink_path_quietly(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    @staticmethod
    def _remove_stale_temp(path: str, stale_before: float) -> None:
        try:
            if os.stat(path).st_mtime < stale_before:
                os.unlink(path)
        except OSError:
            pass
