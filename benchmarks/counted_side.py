"""A counted side: ``python -m MODULE ARGS`` run under callgrind with instrumentation off until it says ``ready`` on
stdout (set up, it waits for a line), then counted until it says ``done`` (it waits for another line before it
exits), so that only what it does between the two is counted (:mod:`benchmarks.checkpoint_counted`,
:mod:`benchmarks.l1_counted`).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
from typing import IO

from benchmarks import service as bench_service
from benchmarks.isolation import callgrind_control, read_dump

READY_TIMEOUT_S = 300.0  # setting up, uninstrumented
END_TIMEOUT_S = 10.0  # for a counted side to end on SIGTERM
RUNNING: set[subprocess.Popen] = set()  # the counted sides started and not yet ended, from any thread


def expect(stream: IO[str], word: str, timeout_s: float) -> list[str]:
    """The words of a counted side's next line on ``stream``, which must begin with ``word`` within ``timeout_s``."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    line = stream.readline().strip() if ready else "(nothing)"
    if line.split(" ")[0] != word:
        raise RuntimeError(f"the counted side said {line!r} where {word!r} was due")
    return line.split(" ")


def count(module_args: list[str], directory: str, done_timeout_s: float,
          environment: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """The instructions (callgrind's Ir) ``python -m module_args`` executes between its ``ready`` and its ``done``,
    and the words of its ``done`` line; its callgrind dump goes to a new folder in ``directory``."""
    out_dir = tempfile.mkdtemp(prefix="callgrind-", dir=directory)
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--quiet",
            f"--callgrind-out-file={os.path.join(out_dir, 'callgrind.%p')}", sys.executable, "-m", *module_args]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**bench_service.env(), **(environment or {})})
    assert process.stdin is not None and process.stdout is not None
    RUNNING.add(process)
    try:
        expect(process.stdout, "ready", READY_TIMEOUT_S)
        callgrind_control(process.pid, "--instr=on")
        callgrind_control(process.pid, "--zero")
        process.stdin.write("go\n")
        process.stdin.flush()
        done = expect(process.stdout, "done", done_timeout_s)
        callgrind_control(process.pid, "--dump")
        instructions = read_dump(out_dir, process.pid, 1)["Ir"]
        process.stdin.write("exit\n")
        process.stdin.flush()
        process.wait(READY_TIMEOUT_S)
        return instructions, done
    finally:
        RUNNING.discard(process)
        _end(process)


def _end(process: subprocess.Popen) -> None:
    """SIGTERM, which valgrind passes on and exits by, removing its vgdb pipes; SIGKILL only if that did not do."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(END_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def end_running() -> None:
    """End every counted side still running (an interrupted benchmark's: their threads then see them end)."""
    for process in list(RUNNING):
        _end(process)
