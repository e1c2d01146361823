"""Run a test's function with a /dev/shm of its own, which no other process on the machine sees.

``in_private_shm(function, *args)`` calls ``function(*args)`` in a child process in a mount namespace of its own
with a fresh tmpfs on /dev/shm (:func:`mount_shm`), as ``tests/e2e/pidns_driver.py`` runs its scenarios
(:func:`in_mount_namespace`, which ``support.namespaces.run_driver`` starts it with; skip the test with
``support.namespaces.needs_namespaces`` where ``unshare`` may not create one).  No ``start-cache`` elsewhere can
sweep a segment the function creates, and the function's own sweeps can remove nobody else's.  ``function`` is a
top-level function of a module, loaded again from that module's file in the child; its arguments and its result
travel as JSON.  The tmpfs, and every segment on it, goes when the child exits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def in_mount_namespace(argv: list[str], timeout_s: float) -> Any:
    """``argv`` run in a mount namespace of its own (from the repository's root): its last stdout line, as JSON
    (it must exit 0 within ``timeout_s``)."""
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", *argv], capture_output=True, text=True,
                            timeout=timeout_s, cwd=REPO)
    assert 0 == result.returncode, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def mount_shm(size: str) -> None:
    """A fresh tmpfs of ``size`` on /dev/shm (in a mount namespace of this process's own, or it is the machine's)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", "/dev/shm"], check=True)


def in_private_shm(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``'s result, computed in a child process with a /dev/shm of its own."""
    source = sys.modules[function.__module__].__file__
    assert source is not None and function.__qualname__ == function.__name__, "a module's top-level function"
    return in_mount_namespace([sys.executable, os.path.abspath(__file__), source, function.__name__,
                               json.dumps(args)], 60)


def _child(source: str, name: str, args: str) -> None:
    mount_shm("16m")
    sys.path[:1] = [REPO, os.path.join(REPO, "tests")]  # not this file's folder: its modules would shadow others
    spec = importlib.util.spec_from_file_location("private_shm_caller", source)
    assert spec is not None and spec.loader is not None, source
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print(json.dumps(getattr(module, name)(*json.loads(args))))


if __name__ == "__main__":
    _child(*sys.argv[1:])
