"""``python -m mpcache.supervisor.runbook deploy/OPERATIONS.md``: the runbook to package, on stdout."""

import sys

from mpcache.supervisor.runbook import extract

with open(sys.argv[1], encoding="utf-8") as handle:
    sys.stdout.write(extract(handle.read()))
