"""Type stub of the optional C extension ``mpcache.telemetry.mrc._fenwick`` (``_fenwick.c``).

What its PyMethodDef table defines.  Keep it in step with the C file.
"""

from array import array

def add(tree: array[int], slot: int, delta: int, /) -> None: ...  # METH_FASTCALL
def prefix(tree: array[int], slot: int, /) -> int: ...  # METH_FASTCALL
