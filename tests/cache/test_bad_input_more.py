"""More hostile input for an in-process server, beyond tests/cache/test_bad_input.py: msgpack payloads
built to exhaust the decoder, msgpack extension types, limits on lengths and counts, and requests that
are only wrong given the server's state (another request's job, one buffer too many).
Same contract: a one-line error reply, no event, no L1 slot touched, and everyone keeps being served."""

from __future__ import annotations

import os

import msgpack
import pytest
from support.bad_requests import assert_refused_harmlessly, store_msg
from support.cache_harness import CHUNK_BYTES, MODEL
from support.raw_frames import RawConn

from mpcache.shm.memfd import create_sealed

# name -> (payload bytes built from the raw connection's buffer id, error_type, part of the error message)
BAD_PAYLOADS = {
    "100000 nested arrays": (lambda b: b"\x91" * 100_000, "protocol", "malformed frame"),
    "array declaring 4 G entries": (lambda b: b"\xdd\xff\xff\xff\xff", "protocol", "malformed frame"),
    "string declaring 4 GiB": (lambda b: b"\xdb\xff\xff\xff\xff", "protocol", "malformed frame"),
    "map with an integer key": (lambda b: msgpack.packb({"op": "ping", "id": 1, 7: 8}), "protocol",
                                "malformed frame"),
    "extension type as the request": (lambda b: msgpack.packb(msgpack.ExtType(1, b"\0" * 8)), "protocol",
                                      "a request must be a map"),
    "extension type as a hash": (lambda b: msgpack.packb(store_msg(b, chunk_hashes=[1, msgpack.ExtType(1, b"x")])),
                                 "protocol", "chunk_hashes: every entry"),
    "binary salt": (lambda b: msgpack.packb(store_msg(b, cache_salt=b"tenant"), use_bin_type=True), "protocol",
                    "cache_salt: expected a string"),
    "request id of 257 bytes": (lambda b: msgpack.packb(store_msg(b, request_id="r" * 257)), "protocol",
                                "request_id: longer than 256 bytes"),
    "request id with a newline": (lambda b: msgpack.packb(store_msg(b, request_id="r\nX-Injected: 1")), "protocol",
                                  "request_id: longer than 256 bytes or has control characters"),
    "model of 129 bytes": (lambda b: msgpack.packb(store_msg(b, model_name="m" * 129)), "protocol",
                           "model_name: longer than 128 bytes"),
    "model with a control character": (lambda b: msgpack.packb(store_msg(b, model_name="m\x1bv")), "protocol",
                                       "model_name: contains a forbidden character"),
    "65537 chunk hashes": (lambda b: msgpack.packb(store_msg(b, chunk_hashes=list(range(65537)),
                                                           block_ids=[0] * 65537)),
                           "protocol", "chunk_hashes: 65537 entries, the limit is 65536"),
    "block id past the protocol limit": (lambda b: msgpack.packb(store_msg(b, block_ids=[0, 1 << 24])), "protocol",
                                         "block_ids: every entry must be an integer in 0..16777215"),
    "unregister an unknown buffer": (lambda b: msgpack.packb({"op": "unregister_buffer", "id": 9, "buffer_id": b + 50}),
                                     "request", "unknown buffer"),
    "retrieve into an unknown buffer": (lambda b: msgpack.packb({"op": "retrieve", "id": 9, "buffer_id": b + 50,
                                                                 "request_id": "r", "job_id": 1, "block_ids": [0]}),
                                        "request", "unknown buffer"),
    "timeout beyond a day": (lambda b: msgpack.packb({"op": "retrieve", "id": 9, "buffer_id": b, "request_id": "r",
                                                      "job_id": 1, "block_ids": [0], "timeout_s": 86401.0}),
                             "protocol", "timeout_s: expected nil or seconds in 0..86400"),
    "zero blocks": (lambda b: msgpack.packb({"op": "register_buffer", "id": 9, "num_blocks": 0,
                                             "block_bytes": CHUNK_BYTES}), "protocol", "num_blocks: 0 is outside"),
    "zero-byte blocks": (lambda b: msgpack.packb({"op": "register_buffer", "id": 9, "num_blocks": 4,
                                                  "block_bytes": 0}), "protocol", "block_bytes: 0 is outside"),
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_hostile_payload_gets_an_error_reply_and_changes_nothing(raw, case):
    """Each payload gets ok=False with its error_type and a one-line message naming the problem; no
    event is published, no L1 slot is used, the same connection then stores, and another client too."""
    harness, conn, buffer_id, _, _ = raw
    build, error_type, fragment = BAD_PAYLOADS[case]
    harness.events.take()
    conn.send_payload(build(buffer_id))
    assert_refused_harmlessly(raw, conn.reply(), error_type, fragment)


def _lookup(conn: RawConn, request_id: str, hashes: list[int]) -> int:
    reply = conn.request({"op": "lookup_prefetch", "id": 3, "request_id": request_id, "model_name": MODEL,
                          "cache_salt": "s", "chunk_hashes": hashes})
    assert True is reply["ok"], reply
    status = conn.request({"op": "query_prefetch_status", "id": 4, "job_id": reply["job_id"]})
    assert (True, len(hashes)) == (status["done"], status["found_count"]), status
    return reply["job_id"]


def _retrieve(buffer_id: int, request_id: str, job_id: int, block_ids: list[int]) -> dict:
    return {"op": "retrieve", "id": 5, "buffer_id": buffer_id, "request_id": request_id, "job_id": job_id,
            "block_ids": block_ids}


def test_retrieve_of_another_requests_job_or_of_more_than_it_found_is_refused(raw):
    """A retrieve naming a prefetch job of another request, or more blocks than the job found, is a
    request error that publishes nothing and copies nothing; the job's own request then retrieves it."""
    harness, conn, buffer_id, _, _ = raw
    assert 2 == conn.request(store_msg(buffer_id, chunk_hashes=[31, 32]))["stored_count"]
    job = _lookup(conn, "owner", [31, 32])
    harness.events.take()
    other = conn.request(_retrieve(buffer_id, "intruder", job, [2, 3]))
    too_many = conn.request(_retrieve(buffer_id, "owner", job, [1, 2, 3]))
    published = len(harness.events.take())
    own = conn.request(_retrieve(buffer_id, "owner", job, [2, 3]))
    assert ("request", "request") == (other["error_type"], too_many["error_type"])
    assert "belongs to another request" in other["error"]
    assert "3 blocks, but prefetch job" in too_many["error"]
    assert (0, True, 2) == (published, own["ok"], own["retrieved_count"])


def test_a_65th_buffer_on_one_connection_is_refused(raw):
    """A connection may register at most 64 buffers: the 65th is a request error, the 64 work."""
    _, conn, buffer_id, _, _ = raw  # the fixture's buffer is the first
    fds = [create_sealed(f"many{i}", CHUNK_BYTES) for i in range(64)]
    try:
        replies = [conn.request({"op": "register_buffer", "id": i, "num_blocks": 1, "block_bytes": CHUNK_BYTES}, [fd])
                   for i, fd in enumerate(fds)]
        stored = conn.request(store_msg(buffer_id, chunk_hashes=[41], block_ids=[0]))
    finally:
        for fd in fds:
            os.close(fd)
    assert [True] * 63 == [reply["ok"] for reply in replies[:63]]
    assert (False, "request") == (replies[63]["ok"], replies[63]["error_type"])
    assert "at most 64 buffers per connection" in replies[63]["error"]
    assert (True, 1) == (stored["ok"], stored["stored_count"])
