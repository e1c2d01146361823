"""EventBatch's column views agree with fully decoded events."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch


def test_session_ids_match_decoded_events(ring):
    """session_ids() returns each record's session id — short, empty, non-ASCII and multi-cell alike."""
    sessions = ["req-1", "", "rëq-ünïcode", "x" * 54, "y" * 55, "z" * 128, "req-7"]
    for i, session in enumerate(sessions):
        ring.publisher.emit(E.MP_STORE_START, ("cpu", i, "m"), session_id=session)
        ring.publisher.emit_salted(E.L1_WRITE_FINISHED, "a", "m", 1)  # records without a session in between
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    heads = batch.heads_of([E.MP_STORE_START])
    decoded = [event.session_id for event in batch.events([E.MP_STORE_START])]
    assert (sessions, sessions) == ([s.decode() for s in batch.session_ids(heads)], decoded)


def test_table_columns_match_decoded_events(ring):
    """table() gives, in ring order, the type, timestamp and fields (0 where a type lacks one)."""
    ring.publisher.emit(E.MP_STORE_START, ("cpu", 3, "m"), session_id="s")
    ring.publisher.emit(E.MP_STORE_END, ("cpu", 3, "m", 2, 4096, 512), session_id="s")
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    etypes, timestamps, columns = batch.table([E.MP_STORE_START, E.MP_STORE_END], ("engine_id", "total_bytes"))
    expected = ([int(E.MP_STORE_START), int(E.MP_STORE_END)], [ring.timestamp_ns] * 2,
                {"engine_id": [3, 3], "total_bytes": [0, 4096]})
    assert expected == (etypes, timestamps, columns)
