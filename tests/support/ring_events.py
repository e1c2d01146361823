"""Reading back what an in-process cache server published to its ring (shared by tests/cache and tests/gpu)."""

from __future__ import annotations

import numpy as np

from mpcache.config import Config
from mpcache.shm.intern import NameTable
from mpcache.shm.ring_reader import RingReader
from mpcache.shm.segment import Segment
from mpcache.telemetry.batch import EventBatch


class EventLog:
    """Reads back what a cache process published to its ring."""

    def __init__(self, config: Config, worker: int = 0) -> None:
        self.segment = Segment.attach(config.ring_name(worker))
        self.reader = RingReader(self.segment)
        self.names = NameTable(self.segment.buf, self.reader.intern_capacity)

    def take(self) -> EventBatch:
        """Everything published since the previous take."""
        parts = [self.reader.read_batch()]
        while len(parts[-1]):
            parts.append(self.reader.read_batch())
        return EventBatch(0, np.concatenate(parts), self.names)

    def close(self) -> None:
        self.reader = self.names = None
        self.segment.close()  # views still alive keep the mapping until they go
