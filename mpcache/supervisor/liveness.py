"""Liveness of the cache processes: how long one may stay silent before it is killed and restarted."""

from __future__ import annotations

# A cache process whose heartbeat word (written every 0.5 s by its loop) stops advancing for
# HANG_TIMEOUT_S is killed and restarted; one whose loop never starts within START_TIMEOUT_S too.
HANG_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0
