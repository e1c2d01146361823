"""``python -m mpcache.bench.null_cache``: a cache process that publishes nothing (the end-to-end benchmarks'
telemetry-off baseline, started by :mod:`mpcache.bench.service` with ``none``).
"""

import sys

from mpcache.cache.__main__ import main
from mpcache.shm.publish import NullPublisher

if __name__ == "__main__":
    sys.exit(main(publisher_factory=lambda: (NullPublisher(), lambda: None)))
