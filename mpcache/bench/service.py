"""``python -m mpcache.bench.service SINK [start-cache flags]``: the service as a benchmark compares it, its
cache processes publishing to SINK: ``ring`` (the product, exactly ``start-cache``), ``none`` (nothing
published, no telemetry process: the telemetry-off baseline) or ``inprocess`` (LMCache's design: an
in-process bus and OpenTelemetry calls in each cache process, :mod:`mpcache.bench.reference`).

The choice goes through the supervisor's ``programs`` hook, so the product has no benchmark flag.
"""

from __future__ import annotations

import sys

from mpcache.supervisor.children import Programs
from mpcache.supervisor.start import main

SINKS = {
    "ring": Programs(),
    "none": Programs(cache="mpcache.bench.null_cache", telemetry=None),
    "inprocess": Programs(cache="mpcache.bench.reference_cache", telemetry=None),
}


def command(sink: str, *flags: str) -> list[str]:
    """The command line that runs the service with cache processes publishing to ``sink``."""
    if sink not in SINKS:
        raise ValueError(f"sink: expected one of {', '.join(SINKS)}, got {sink!r}")
    return [sys.executable, "-m", "mpcache.bench.service", sink, *flags]


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SINKS:
        sys.stderr.write(f"mpcache.bench.service: error: expected a sink ({', '.join(SINKS)}), then "
                         "start-cache's flags\n")
        sys.exit(2)
    sys.exit(main(sys.argv[2:], SINKS[sys.argv[1]]))
