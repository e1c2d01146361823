"""What the hostile-input tests of tests/cache/ share: a valid store request of the raw connection's buffer
(fields changed or dropped), and the check that a refused request left everything as it was."""

from __future__ import annotations

from support.cache_harness import MODEL

BLOCKS = 4  # the raw connection's buffer (the ``raw`` fixture of tests/cache/conftest.py)
DROP = object()  # a field value that leaves the field out


def store_msg(buffer_id: int, **changes) -> dict:
    message = {"op": "store", "id": 9, "buffer_id": buffer_id, "request_id": "req", "model_name": MODEL,
               "cache_salt": "s", "chunk_hashes": [11, 12], "block_ids": [0, 1]}
    message.update(changes)
    return {key: value for key, value in message.items() if value is not DROP}


def assert_refused_harmlessly(raw, reply: dict, error_type: str, fragment: str) -> None:
    """``reply`` is a one-line error of ``error_type`` naming ``fragment``; since the events were last
    taken nothing was published and no L1 slot used; the connection and a bystander then store."""
    harness, conn, buffer_id, bystander, bystander_kv = raw
    assert (False, error_type) == (reply["ok"], reply["error_type"])
    assert fragment in reply["error"] and "\n" not in reply["error"]
    assert 0 == len(harness.events.take())
    assert 0 == harness.server.l1.used_bytes
    assert True is conn.request(store_msg(buffer_id))["ok"]
    assert 1 == bystander.store(bystander_kv, request_id="b", model_name=MODEL, chunk_hashes=[77],
                                block_ids=[0]).stored
