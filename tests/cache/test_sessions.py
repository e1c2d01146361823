"""The session registry's own bound: which sessions give way when too many are open."""

from __future__ import annotations

from benchmarks.null_cache import NullPublisher
from mpcache.cache.sessions import SessionRegistry


def test_past_the_bound_the_session_used_least_recently_gives_way():
    """A session a request keeps using stays open while a flood of new request ids pushes sessions out: the one
    used least recently gives way, not the one opened first (which, still in use, lost its locks)."""
    registry = SessionRegistry(None, NullPublisher(), max_sessions=2)  # type: ignore[arg-type]  # no job: no L1
    for request_id in ("active", "idle", "active", "new"):
        registry.open(request_id)
    assert [True, False, True] == [registry.end(request_id) for request_id in ("active", "idle", "new")]
