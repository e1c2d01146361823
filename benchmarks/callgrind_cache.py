"""``python -m benchmarks.callgrind_cache --config PATH --worker N``: a benchmark's cache process run under
valgrind's callgrind, instrumentation off until the benchmark turns it on (``callgrind_control -i on``), so that
its instructions and simulated cache misses are counted over the measured window only
(:mod:`benchmarks.isolation`).  ``$MPCBENCH_CALLGRIND_PROGRAM`` is the cache program's module and
``$MPCBENCH_CALLGRIND_DIR`` where callgrind writes ``callgrind.<pid>.<dump>``.
"""

from __future__ import annotations

import os
import sys

PROGRAM_ENV = "MPCBENCH_CALLGRIND_PROGRAM"
DIR_ENV = "MPCBENCH_CALLGRIND_DIR"
RING_PROGRAM, NULL_PROGRAM = "mpcache.cache", "benchmarks.null_cache"  # publishing into the ring, or nowhere
PROGRAMS = (RING_PROGRAM, NULL_PROGRAM)
HANG_TIMEOUT_S = 120  # --hang-timeout: instrumented, a loop pass takes tens of times longer


def valgrind_argv(program: str, out_dir: str, args: list[str], python: str = sys.executable) -> list[str]:
    """The command line that runs ``python -m program args`` under callgrind, not yet instrumented (every thread
    counted into one dump)."""
    return ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--instr-atstart=no", "--quiet",
            f"--callgrind-out-file={os.path.join(out_dir, 'callgrind.%p')}", python, "-m", program, *args]


def main() -> int:
    program, out_dir = os.environ.get(PROGRAM_ENV, ""), os.environ.get(DIR_ENV, "")
    if program not in PROGRAMS or not os.path.isdir(out_dir):
        sys.stderr.write(f"benchmarks.callgrind_cache: error: ${PROGRAM_ENV} must be one of {', '.join(PROGRAMS)} "
                         f"and ${DIR_ENV} a directory (got {program!r}, {out_dir!r})\n")
        return 2
    argv = valgrind_argv(program, out_dir, sys.argv[1:])
    os.execvp(argv[0], argv)  # the same pid: the supervisor watches, and stops, valgrind itself


if __name__ == "__main__":
    sys.exit(main())
