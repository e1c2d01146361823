"""``python -m benchmarks.service SINK [start-cache flags]``: the service as a benchmark runs it, its cache
processes publishing into the rings (``ring``: the product, telemetry included; ``ring-unread``: no telemetry
process reads them), nowhere (``none``) or into LMCache's in-process bus (``inprocess``); the last two run no
telemetry process.  ``ring-callgrind`` and
``none-callgrind`` run the first two's cache process under callgrind (:mod:`benchmarks.callgrind_cache`).  The
supervisor gets the benchmark's cache process through its ``programs`` hook, so that the product names no
benchmark module.
"""

from __future__ import annotations

import os
import sys

import psutil

from benchmarks import callgrind_cache, null_cache, reference_cache
from mpcache.supervisor.children import Programs
from mpcache.supervisor.start import main as start_cache

SINKS = {
    "ring": Programs(),
    "ring-unread": Programs(telemetry=None),  # the records stay in the rings (benchmarks.checkpoint copies them)
    "none": Programs(cache=null_cache.__name__, telemetry=None),
    "inprocess": Programs(cache=reference_cache.__name__, telemetry=None),
    # under callgrind (benchmarks.isolation), the ring's or the null publisher's program as its env says
    "ring-callgrind": Programs(cache=callgrind_cache.__name__),
    "none-callgrind": Programs(cache=callgrind_cache.__name__, telemetry=None),
}
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def argv(sink: str, *flags: str) -> list[str]:
    """The command line that runs the service with ``sink`` (run it with :func:`env`)."""
    return [sys.executable, "-m", __name__, sink, *flags]


def env() -> dict[str, str]:
    """This environment, with this mpcache importable (installed or not)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, path) if p)}


def child_pids(service_pid: int) -> dict[str, list[int]]:
    """The running service's children by role: ``cache`` (every cache process, whichever program the sink
    runs) and ``telemetry`` (absent when the sink runs none)."""
    telemetry = Programs().telemetry
    roles: dict[str, list[int]] = {}
    for child in psutil.Process(service_pid).children():
        role = "telemetry" if telemetry in child.cmdline() else "cache"
        roles.setdefault(role, []).append(child.pid)
    return roles


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    if not args or args[0] not in SINKS:
        sys.stderr.write(f"benchmarks.service: error: the first argument is one of {', '.join(SINKS)}\n")
        return 2
    return start_cache(args[1:], programs=SINKS[args[0]])


if __name__ == "__main__":
    sys.exit(main())
