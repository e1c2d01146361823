"""POSIX shared-memory segments: the supervisor creates (0600) and unlinks them; everyone else attaches
and closes.
"""

from __future__ import annotations

import errno
import mmap
import os

import posix_ipc

from mpcache.errors import LayoutMismatchError, SharedMemoryFullError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "mpcache."


class Segment:
    """One mapped shared-memory object.  ``buf`` is a writable memoryview of it."""

    def __init__(self, name: str, mapping: mmap.mmap, fd: int = -1) -> None:
        self.name = name
        self._mmap = mapping
        self.buf = memoryview(mapping)
        self.size = len(mapping)
        self.fd = fd  # a descriptor of the object, kept only when asked for (attach's keep_fd); -1 otherwise

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create a zero-filled segment private to this user; fail if it exists.

        Its pages are allocated now (``posix_fallocate``): a /dev/shm too small for it is a
        :class:`~mpcache.errors.SharedMemoryFullError` here, never a SIGBUS later in whichever
        process first writes a page that does not fit."""
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            os.fchmod(shm.fd, 0o600)  # the umask may have narrowed it further; never widen
            _reserve(shm.fd, name, size)
            mapping = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        return cls(name, mapping)

    @classmethod
    def attach(cls, name: str, min_size: int = 1, keep_fd: bool = False) -> Segment:
        """Map an existing segment; raise LayoutMismatchError if it is too small.  ``keep_fd``: keep a
        descriptor of it (``fd``, closed by :meth:`close`), to restore its size should a peer shrink it."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise LayoutMismatchError(f"shared memory {name!r} does not exist") from exc
        try:
            if shm.size < min_size:
                raise LayoutMismatchError(
                    f"shared memory {name!r} is {shm.size} bytes, expected at least {min_size}"
                )
            mapping = mmap.mmap(shm.fd, shm.size)
            fd = os.dup(shm.fd) if keep_fd else -1
        finally:
            shm.close_fd()
        return cls(name, mapping, fd)

    def close(self) -> None:
        """Drop this process's mapping (the segment itself stays).

        Views derived from ``buf`` (numpy arrays, casts) keep the mapping alive;
        then it is unmapped when the last of them is garbage-collected instead.
        """
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass

    @staticmethod
    def unlink(name: str) -> bool:
        """Remove the segment's name; True if it existed."""
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            return False
        return True


def _reserve(fd: int, name: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a file system without fallocate: the pages come on first touch, as before
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = shm_free_bytes()
        raise SharedMemoryFullError(
            f"{SHM_DIR} has no room for {name} ({size / 2**20:.1f} MiB; {free / 2**20:.1f} MiB free): "
            f"{os.strerror(exc.errno)}; give the machine or container more shared memory "
            f"(Docker: --shm-size) or ask for less") from None


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def shm_name(owner_pid: int, instance_id: str, what: str) -> str:
    """Segment name: owner pid first, so leftovers of a dead owner can be found."""
    return f"/{NAME_PREFIX}{owner_pid}.{instance_id[:8]}.{what}"
