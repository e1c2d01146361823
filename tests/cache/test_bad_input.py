"""Hostile or broken clients: every bad request gets a one-line error reply, nothing outside the
client's buffer is touched, and the server goes on serving that client and everyone else."""

from __future__ import annotations

import os

import msgpack
import pytest
from support.bad_requests import BLOCKS, DROP, assert_refused_harmlessly, store_msg
from support.cache_harness import CHUNK_BYTES, MODEL
from support.raw_frames import RawConn

from mpcache.contract import protocol
from mpcache.shm.memfd import create_sealed

# name -> (message builder taking the buffer id, error_type, part of the error message)
BAD_REQUESTS = {
    "not a map": (lambda b: [1, 2], "protocol", "a request must be a map"),
    "unknown op": (lambda b: {"op": "explode", "id": 9}, "protocol", "unknown operation 'explode'"),
    "missing id": (lambda b: {"op": "ping"}, "protocol", "id: expected an integer"),
    "unknown field": (lambda b: store_msg(b, colour="red"), "protocol", "unexpected field(s) for store: colour"),
    "missing field": (lambda b: store_msg(b, chunk_hashes=DROP), "protocol", "chunk_hashes: missing"),
    "unknown buffer": (lambda b: store_msg(b + 100), "request", "unknown buffer"),
    "block id out of range": (lambda b: store_msg(b, block_ids=[0, BLOCKS]), "request", f"block {BLOCKS} is outside"),
    "negative block id": (lambda b: store_msg(b, block_ids=[0, -1]), "protocol", "block_ids: every entry"),
    "counts differ": (lambda b: store_msg(b, block_ids=[0]), "protocol", "1 entries for 2 chunk_hashes"),
    "hash not an int": (lambda b: store_msg(b, chunk_hashes=[1, "2"]), "protocol", "chunk_hashes: every entry"),
    "bool engine id": (lambda b: store_msg(b, engine_id=True), "protocol", "engine_id: expected an integer"),
    "salt with slash": (lambda b: store_msg(b, cache_salt="a/b"), "protocol", "cache_salt: contains a forbidden"),
    "salt with at": (lambda b: store_msg(b, cache_salt="a@b"), "protocol", "cache_salt: contains a forbidden"),
    "salt with backslash": (lambda b: store_msg(b, cache_salt="a\\b"), "protocol", "cache_salt: contains a forbidden"),
    "salt with NUL": (lambda b: store_msg(b, cache_salt="a\0b"), "protocol", "cache_salt: contains a forbidden"),
    "salt with newline": (lambda b: store_msg(b, cache_salt="a\nb"), "protocol", "cache_salt: contains a forbidden"),
    "salt too long": (lambda b: store_msg(b, cache_salt="é" * 65), "protocol", "cache_salt: longer than 128 bytes"),
    "salt not a string": (lambda b: store_msg(b, cache_salt=b"bytes"), "protocol", "cache_salt: expected a string"),
    "model with at": (lambda b: store_msg(b, model_name="m@1"), "protocol", "model_name: contains a forbidden"),
    "empty model": (lambda b: store_msg(b, model_name=""), "protocol", "model_name: must not be empty"),
    "unknown job": (lambda b: {"op": "query_prefetch_status", "id": 9, "job_id": 424242}, "request",
                    "unknown or expired prefetch job"),
    "negative timeout": (lambda b: {"op": "retrieve", "id": 9, "buffer_id": b, "request_id": "r", "job_id": 1,
                                    "block_ids": [0], "timeout_s": -1.0}, "protocol", "timeout_s"),
    "buffer by name (the old protocol)": (lambda b: {"op": "register_buffer", "id": 9, "shm_name": "/mpcache.1.a.kv0",
                                                     "num_blocks": 1, "block_bytes": 8}, "protocol",
                                          "unexpected field(s) for register_buffer: shm_name"),
    "buffer without its descriptor": (lambda b: {"op": "register_buffer", "id": 9, "num_blocks": 1,
                                                 "block_bytes": 8}, "protocol", "expects one file descriptor"),
    "buffer larger than its memfd": (lambda b: {"op": "register_buffer", "id": 9, "num_blocks": BLOCKS + 1,
                                                "block_bytes": CHUNK_BYTES}, "request",
                                     f"the memfd is {BLOCKS * CHUNK_BYTES} bytes"),
    "block larger than a chunk": (lambda b: {"op": "register_buffer", "id": 9, "num_blocks": 1,
                                             "block_bytes": CHUNK_BYTES + 1}, "request", "larger than the chunk size"),
}
SENT_WITH_A_MEMFD = {"buffer larger than its memfd", "block larger than a chunk"}  # of BLOCKS × CHUNK_BYTES


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_an_error_reply_and_the_server_keeps_serving(raw, case):
    """Each malformed or invalid request is answered with ok=False, a one-line error naming the
    problem and its type; the same connection and another client then work normally, and a
    refused store publishes no event and touches no L1 slot."""
    harness, conn, buffer_id, _, _ = raw
    build, error_type, fragment = BAD_REQUESTS[case]
    fds = [create_sealed("bad", BLOCKS * CHUNK_BYTES)] if case in SENT_WITH_A_MEMFD else []
    harness.events.take()
    reply = conn.request(build(buffer_id), fds)
    for fd in fds:
        os.close(fd)
    assert_refused_harmlessly(raw, reply, error_type, fragment)


def test_reply_to_a_request_with_an_id_carries_that_id(raw):
    """An error reply answers the request's id when it had a valid one, and nil when it did not."""
    _, conn, _, _, _ = raw
    assert (123, None) == (conn.request({"op": "explode", "id": 123})["id"], conn.request({"op": "ping"})["id"])


def test_malformed_frame_gets_an_error_reply_and_the_connection_stays_usable(raw):
    """A frame whose payload is not one msgpack object (garbage, or trailing bytes) is answered with a
    protocol error; the next request on the same connection is served."""
    _, conn, _, _, _ = raw
    for payload in (b"\xc1", b"", msgpack.packb({"op": "ping", "id": 1}) + b"\x00"):
        conn.send_payload(payload)
        reply = conn.reply()
        assert (False, "protocol", None) == (reply["ok"], reply["error_type"], reply["id"])
        assert "malformed frame" in reply["error"]
    assert True is conn.request({"op": "ping", "id": 2})["ok"]


def test_oversized_frame_gets_an_error_reply_then_that_connection_is_closed(raw):
    """A frame header announcing more than 1 MiB gets an error reply and its connection is closed;
    other clients are served, and a new connection works."""
    harness, conn, _, bystander, bystander_kv = raw
    conn.sock.sendall(protocol.FRAME_HEADER.pack(protocol.MAX_FRAME_BYTES + 1))
    reply = conn.reply()
    assert (False, "protocol") == (reply["ok"], reply["error_type"])
    assert "exceeds the 1048576-byte limit" in reply["error"]
    assert b"" == conn.sock.recv(1)
    assert 1 == bystander.store(bystander_kv, request_id="b", model_name=MODEL, chunk_hashes=[78],
                                block_ids=[0]).stored
    fresh = RawConn(harness.config.socket_path(0))
    assert True is fresh.request({"op": "ping", "id": 1})["ok"]
    fresh.close()


def test_abrupt_disconnect_mid_frame_does_not_disturb_others(raw):
    """A client that sends half a frame and vanishes is dropped; the server goes on serving."""
    harness, conn, _, bystander, bystander_kv = raw
    conn.sock.sendall(protocol.FRAME_HEADER.pack(100) + b"\x81")
    conn.sock.close()
    assert 1 == bystander.store(bystander_kv, request_id="b", model_name=MODEL, chunk_hashes=[79],
                                block_ids=[0]).stored


def test_pipelined_requests_from_a_client_that_reads_late_are_all_answered_in_order(raw):
    """A client that sends 40,000 requests before reading any reply (more than the server buffers
    for it) gets every reply, in order: the server pauses reading instead of buffering without bound."""
    import threading

    harness, conn, _, bystander, bystander_kv = raw
    count = 40_000
    frames = b"".join(protocol.encode_frame({"op": "ping", "id": i}) for i in range(count))
    sender = threading.Thread(target=conn.sock.sendall, args=(frames,))
    sender.start()
    ids = [conn.reply()["id"] for _ in range(count)]
    sender.join(10)
    assert list(range(count)) == ids
    assert 1 == bystander.store(bystander_kv, request_id="b", model_name=MODEL, chunk_hashes=[80],
                                block_ids=[0]).stored
