"""``python -m benchmarks.null_cache``: a cache process that publishes nothing, the benchmarks'
telemetry-off baseline (started through the supervisor's programs hook: ``benchmarks.service none``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from mpcache.cache.__main__ import main
from mpcache.contract.events import EventType
from mpcache.shm.publish import EventPublisher


class NullPublisher:
    """Publishes nothing: the telemetry-off baseline (also what an L1 replay outside a cache process needs)."""

    def emit(self, etype: EventType, fields: tuple[Any, ...] = (), **_options: object) -> bool:
        return True

    def emit_salted(self, etype: EventType, cache_salt: str, model_name: str, count: int) -> bool:
        return True

    def fields_emitter(self, etype: EventType) -> Callable[[tuple[Any, ...], str], bool]:
        return lambda fields, session_id: True


def null_publisher() -> tuple[EventPublisher, Callable[[], None]]:
    return NullPublisher(), lambda: None


if __name__ == "__main__":
    sys.exit(main(publisher_factory=null_publisher))
