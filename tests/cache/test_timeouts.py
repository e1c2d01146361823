"""Deadline raises MpcacheTimeoutError; publish_timeout reports a caught one as TIMEOUT_RAISED."""

from __future__ import annotations

import pytest
from support.ring_events import EventLog

from mpcache.cache.timeouts import Deadline, MpcacheTimeoutError, publish_timeout
from mpcache.contract.events import EventType as E
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.segment import Segment


def _raise_timeout(session_id: str = "") -> None:
    raise MpcacheTimeoutError("copy: too slow", session_id=session_id)


def test_a_caught_timeout_publishes_timeout_raised_with_the_raising_frames(provisioned):
    """publish_timeout (called where the error is caught) publishes one TIMEOUT_RAISED with the class
    name, message, session id and the frames down to where it was raised; building it publishes nothing."""
    config = provisioned()
    ring = Segment.attach(config.ring_name(0))
    publisher = Publisher(RingWriter(ring), Interner(ring.buf, read_geometry(ring).intern_capacity))
    log = EventLog(config)
    try:
        MpcacheTimeoutError("built, never raised", session_id="req-0")
        assert [] == log.take().events([E.TIMEOUT_RAISED])
        with pytest.raises(MpcacheTimeoutError) as caught:
            _raise_timeout("req-9")
        publish_timeout(publisher, caught.value)
        events = log.take().events([E.TIMEOUT_RAISED])
        assert [("MpcacheTimeoutError", "copy: too slow", "req-9")] == [
            (e.fields["exception_type"], e.texts["message"], e.session_id) for e in events]
        assert "_raise_timeout" in events[0].texts["stacktrace"]
        assert isinstance(caught.value, TimeoutError)
    finally:
        log.close()
        ring.close()


def test_deadline_raises_once_passed():
    """A deadline checks against its clock: not expired before, MpcacheTimeoutError naming the
    operation at and after; None never expires."""
    now = [10.0]
    deadline = Deadline(2.0, clock=lambda: now[0])
    deadline.check("copy")
    now[0] = 12.0
    with pytest.raises(MpcacheTimeoutError, match="copy: deadline of 2 s passed"):
        deadline.check("copy")
    assert (True, False) == (deadline.expired(), Deadline(None, clock=lambda: 1e18).expired())
