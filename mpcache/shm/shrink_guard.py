"""Survive a same-uid peer's truncate of a segment this process maps: a copy that reaches past the new end is
not a SIGBUS (the handler in ``_busguard.c`` gives the segment its size back and counts the fault); the owner
polls :attr:`ShrinkGuard.faults` and treats the segment's contents as lost.  Without the compiled extension
(no C compiler at install) nothing is guarded and such a fault still kills the process, as before."""

from __future__ import annotations

import os

import numpy as np

from mpcache.shm.segment import Segment

try:
    from mpcache.shm import _busguard
except ImportError:  # built without a C compiler
    _busguard = None  # type: ignore[assignment]


class ShrinkGuard:
    """One guarded segment (``view``: a numpy array from the start of its mapping).  The guard keeps its own
    descriptor of the segment until :meth:`close` (before the segment is unmapped): the handler restores the
    size through it."""

    def __init__(self, segment: Segment, view: np.ndarray) -> None:
        self.name = segment.name
        self.size = segment.size
        self.active = _busguard is not None and segment.fd >= 0
        self._slot = -1
        self._fd = -1
        if self.active:
            self._fd = os.dup(segment.fd)
            self._slot = _busguard.guard(view.__array_interface__["data"][0], segment.size, self._fd)
        self.seen = 0  # faults already dealt with by the owner

    @property
    def faults(self) -> int:
        """Faults survived in the segment so far."""
        return _busguard.faults(self._slot) if self.active else 0

    def shrunk(self) -> bool:
        """Whether the segment is shorter than its mapping now (truncated with no copy faulting yet): then its
        size is given back here, as the handler would."""
        if not self.active or os.fstat(self._fd).st_size >= self.size:
            return False
        os.ftruncate(self._fd, self.size)
        return True

    def close(self) -> None:
        """Stop guarding (idempotent): the slot is free again and the descriptor closed."""
        if self.active:
            self.active = False
            _busguard.unguard(self._slot)
            os.close(self._fd)
