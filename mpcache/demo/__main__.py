"""``python -m mpcache.demo --config PATH``: the demo child the supervisor starts."""

import sys

from mpcache.demo.run import main

sys.exit(main())
