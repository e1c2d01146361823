"""``python -m mpcache.bench.reference_cache``: a cache process publishing through the in-process bus
(``python -m mpcache.bench.service inprocess``, the end-to-end benchmark's third way).
"""

import sys

from mpcache.bench.reference import start_inprocess_reference
from mpcache.cache.__main__ import main

if __name__ == "__main__":
    sys.exit(main(publisher_factory=start_inprocess_reference))
