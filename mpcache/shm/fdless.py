"""Shared mappings that keep no descriptor.  Python's ``mmap`` duplicates the descriptor it maps (to size or
resize the mapping later; ``trackfd=False`` only from Python 3.13), so a cache process that mapped every client
buffer it was sent held a descriptor for each, and one client registering many sparse buffers drove it to its
descriptor limit.  Here libc's ``mmap`` maps the file and the mapping is unmapped when the last view of it is
gone (CPython frees it as its last reference drops), never while one is still in use.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int) -> np.ndarray:
    """A writable uint8 array over the first ``size`` bytes of ``fd``, shared with every other mapping of it
    (``MAP_SHARED``); ``fd`` may be closed at once.  OSError when it cannot be mapped."""
    if size <= 0:
        raise OSError(22, "cannot map 0 bytes")
    address = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    memory = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(memory, _munmap, address, size)  # once no array or view refers to it any more
    return np.frombuffer(memoryview(memory).cast("B"), dtype=np.uint8)
