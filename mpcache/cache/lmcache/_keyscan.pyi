"""Type stub of the optional C extension ``mpcache.cache.lmcache._keyscan`` (``_keyscan.c``).

What its PyMethodDef table defines.  Keep it in step with the C file.
"""

from _typeshed import ReadableBuffer

def split_key(
    frame: ReadableBuffer, max_tokens: int, kept: tuple[tuple[bytes, bytes], ...], /
) -> tuple[bytes, int, None, None] | tuple[bytes, bytes, bytes, bytes] | None: ...  # METH_FASTCALL
