"""Type stub of the optional C extension ``mpcache.eviction._sketch`` (``_sketch.c``).

What its type and module constants define.  Keep it in step with the C file.
"""

from collections.abc import Callable, Hashable
from typing import final

SATURATED: int
MIN_WIDTH: int
MAX_WIDTH: int
COUNTERS_PER_COUNT: int
ENDED: int
SAMPLED: int
MIX: int

@final
class FrequencySketch:
    @property
    def window(self) -> int: ...
    sample_bits: int
    @property
    def _rows(self) -> tuple[bytes, bytes]: ...
    def __new__(cls, window: int, code: Callable[[Hashable], int] = ...,
                *, item: int | None = ...) -> FrequencySketch: ...
    def add(self, key: Hashable, /) -> int: ...
    def estimate(self, key: Hashable, /) -> int: ...
    def resize(self, window: int, /) -> None: ...
