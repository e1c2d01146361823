"""``python -m benchmarks.reference_cache``: a cache process publishing through the in-process bus
(``python -m benchmarks.service inprocess``, the end-to-end benchmark's third way).
"""

import sys

from benchmarks.reference import start_inprocess_reference
from mpcache.cache.__main__ import main

if __name__ == "__main__":
    sys.exit(main(publisher_factory=start_inprocess_reference))
