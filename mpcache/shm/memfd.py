"""Client KV buffers as sealed memfds: anonymous (nothing in /dev/shm, gone with the last descriptor or
mapping), allocated up front and sealed against shrinking, so a process that maps one can never fault on it.
The client passes the descriptor to the cache process over its socket (SCM_RIGHTS).
"""

from __future__ import annotations

import errno
import fcntl
import os

from mpcache.errors import SharedMemoryFullError

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL  # growing stays possible and is harmless


def create_sealed(name: str, size: int) -> int:
    """A close-on-exec memfd of ``size`` bytes, mode 0600 like every segment (it has no name, but
    ``/proc/<pid>/fd`` reaches it), its pages allocated now and sealed with :data:`SEALS`.

    Memory that is not there is a :class:`~mpcache.errors.SharedMemoryFullError` here, never a SIGBUS
    later in whichever process first writes a page that does not fit."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise SharedMemoryFullError(
                f"no memory for KV buffer {name} ({size / 2**20:.1f} MiB): {os.strerror(exc.errno)}; "
                "ask for a smaller buffer or give the machine or container more memory") from None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
