"""A per-metric cap on distinct ``cache_salt`` values: later ones are reported as ``__overflow__``, so a
runaway tenant population costs at most ``cap + 1`` series per metric.
"""

from __future__ import annotations

OVERFLOW_SALT = "__overflow__"


class SaltCap:
    """The admitted salts of one metric."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"cache_salt cap must be >= 1, got {cap}")
        self._cap = cap
        self._admitted: set[str] = set()

    def __call__(self, salt: str) -> str:
        """``salt`` if this metric has admitted it (or has room for it), else ``__overflow__``."""
        if salt in self._admitted:
            return salt
        if len(self._admitted) < self._cap:
            self._admitted.add(salt)
            return salt
        return OVERFLOW_SALT
