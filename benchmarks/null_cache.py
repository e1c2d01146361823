"""``python -m benchmarks.null_cache``: a cache process that publishes nothing, the benchmarks'
telemetry-off baseline (started through the supervisor's programs hook: ``benchmarks.service none``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from mpcache.cache.__main__ import main
from mpcache.shm.publish import EventPublisher, NullPublisher


def null_publisher() -> tuple[EventPublisher, Callable[[], None]]:
    return NullPublisher(), lambda: None


if __name__ == "__main__":
    sys.exit(main(publisher_factory=null_publisher))
