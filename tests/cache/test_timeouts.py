"""MpcacheTimeoutError reports itself on construction; Deadline raises it."""

from __future__ import annotations

import pytest

from mpcache.events import EventType as E
from mpcache.publish import Publisher
from mpcache.shm.intern import Interner
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.segment import Segment
from mpcache.timeouts import Deadline, MpcacheTimeoutError, register_publisher, registered_publisher

from ring_events import EventLog


@pytest.fixture
def no_publisher():
    """Leave the process-wide registration as it was found."""
    before = registered_publisher()
    register_publisher(None)
    yield
    register_publisher(before)


def _raise_timeout(session_id: str = "") -> MpcacheTimeoutError:
    return MpcacheTimeoutError("copy: too slow", session_id=session_id)


def test_construction_publishes_timeout_raised(provisioned, no_publisher):
    """Constructing the error publishes one TIMEOUT_RAISED with its class name, message, session id
    and the construction stack (the caller's frame, not the constructor's)."""
    config = provisioned()
    ring = Segment.attach(config.ring_name(0))
    register_publisher(Publisher(RingWriter(ring), Interner(ring.buf, read_geometry(ring).intern_capacity)))
    log = EventLog(config)
    try:
        error = _raise_timeout("req-9")
        events = log.take().events([E.TIMEOUT_RAISED])
        assert [("MpcacheTimeoutError", "copy: too slow", "req-9")] == [
            (e.fields["exception_type"], e.texts["message"], e.session_id) for e in events]
        assert "_raise_timeout" in events[0].texts["stacktrace"]
        assert "__init__" not in events[0].texts["stacktrace"]
        assert isinstance(error, TimeoutError)
    finally:
        register_publisher(None)
        log.close()
        ring.close()


def test_construction_without_publisher_or_with_a_failing_one_never_raises(no_publisher):
    """With no publisher registered, or one whose emit raises, the error is still just constructed."""
    assert "copy: too slow" == str(_raise_timeout())

    class Broken:
        def emit(self, *args, **kwargs):
            raise RuntimeError("ring gone")

    register_publisher(Broken())
    assert "copy: too slow" == str(_raise_timeout())


def test_deadline_raises_once_passed(no_publisher):
    """A deadline checks against its clock: not expired before, MpcacheTimeoutError naming the
    operation at and after; None never expires."""
    now = [10.0]
    deadline = Deadline(2.0, clock=lambda: now[0])
    deadline.check("copy")
    now[0] = 12.0
    with pytest.raises(MpcacheTimeoutError, match="copy: deadline of 2 s passed"):
        deadline.check("copy")
    assert (True, False) == (deadline.expired(), Deadline(None, clock=lambda: 1e18).expired())
