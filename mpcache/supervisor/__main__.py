"""``python -m mpcache.supervisor``: the same as ``bin/start-cache``."""

import sys

from mpcache.supervisor.start import main

sys.exit(main())
