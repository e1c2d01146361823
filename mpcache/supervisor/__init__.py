"""The supervisor process (``bin/start-cache``): the configuration, every shared-memory object, and the child
processes (telemetry, cache, demo), each kind its own failure domain; stopped in order, leaving nothing behind.

``start`` (main) → ``settings`` (flags, file, environment → Config) and ``checks``; ``runtime`` (its
directory, marker and sweep of stale runs) and ``provision`` (the shared memory); then ``watch.Supervisor``
over ``children`` (roles, programs, spawn and stop), ``restart`` (the policy), ``liveness`` (heartbeats),
``status`` (gauge-board words, status.json, systemd) and ``logforward`` (every child's lines, one writer).
"""

from mpcache.supervisor.start import main

__all__ = ["main"]
