"""The client ⇄ cache-process protocol: frames and request validation, without a server."""

from __future__ import annotations

import msgpack
import pytest

from mpcache.cache.native.ops import OPERATIONS
from mpcache.contract import protocol
from mpcache.errors import ProtocolError

SCHEMAS = {name: op.fields for name, op in OPERATIONS.items()}


def parse(message):
    return protocol.parse_request(message, SCHEMAS)


def _store(**changes) -> dict:
    message = {"op": "store", "id": 1, "buffer_id": 1, "request_id": "r", "model_name": "m",
               "chunk_hashes": [1, 2], "block_ids": [0, 1]}
    message.update(changes)
    return message


def test_frame_is_big_endian_length_then_msgpack():
    """encode_frame writes a 4-byte big-endian payload length followed by the msgpack map."""
    frame = protocol.encode_frame({"op": "ping", "id": 3})
    payload = msgpack.packb({"op": "ping", "id": 3})
    assert len(payload).to_bytes(4, "big") + payload == frame


def test_encode_refuses_a_frame_over_the_limit():
    """A message whose payload would exceed MAX_FRAME_BYTES is refused before it is sent."""
    with pytest.raises(ProtocolError, match="the limit is 1048576"):
        protocol.encode_frame({"blob": b"x" * protocol.MAX_FRAME_BYTES})


def test_parse_fills_defaults_and_keeps_values():
    """Optional arguments get their defaults (cache_salt "", engine_id 0); given ones are kept."""
    request = parse(_store())
    assert ("store", 1, "", 0, [1, 2]) == (request.op, request.id, request.args["cache_salt"],
                                           request.args["engine_id"], request.args["chunk_hashes"])


def test_hashes_span_the_full_unsigned_64_bit_range():
    """Chunk hashes are u64: 0 and 2**64-1 are accepted, -1 and 2**64 are not representable as hashes."""
    assert [0, 2**64 - 1] == parse(_store(chunk_hashes=[0, 2**64 - 1])).args["chunk_hashes"]
    with pytest.raises(ProtocolError, match="chunk_hashes"):
        parse(_store(chunk_hashes=[-1, 0]))


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B", "m", "模型"])
def test_model_names_with_organisation_prefix_are_valid(model):
    """Model names may contain '/' (Hugging Face style) and any printable Unicode."""
    assert model == parse(_store(model_name=model)).args["model_name"]


@pytest.mark.parametrize("salt", ["", "tenant-1", "x" * 128])
def test_valid_cache_salts(salt):
    """An empty salt and salts up to 128 bytes of allowed characters are accepted."""
    assert salt == parse(_store(cache_salt=salt)).args["cache_salt"]


@pytest.mark.parametrize("salt", ["a/b", "a@b", "a\\b", "a\x00b", "a\x1fb", "a\x7fb", "x" * 129])
def test_invalid_cache_salts(salt):
    """cache_salt: no @ / \\ NUL or control characters, at most 128 bytes."""
    with pytest.raises(ProtocolError, match="cache_salt"):
        parse(_store(cache_salt=salt))


@pytest.mark.parametrize("timeout", [None, 0, 0.5, 3])
def test_timeout_accepts_nil_and_non_negative_seconds(timeout):
    """timeout_s is nil (no deadline) or seconds >= 0, returned as float."""
    request = parse({"op": "retrieve", "id": 1, "buffer_id": 1, "request_id": "r", "job_id": 1,
                                      "block_ids": [0], "timeout_s": timeout})
    assert (None if timeout is None else float(timeout)) == request.args["timeout_s"]


@pytest.mark.parametrize("timeout", [-0.1, float("nan"), float("inf"), "1", True])
def test_timeout_rejects_other_values(timeout):
    """Negative, NaN, infinite, string and boolean timeouts are protocol errors."""
    with pytest.raises(ProtocolError, match="timeout_s"):
        parse({"op": "retrieve", "id": 1, "buffer_id": 1, "request_id": "r", "job_id": 1,
                                "block_ids": [0], "timeout_s": timeout})


def test_too_many_chunks_is_refused():
    """More than MAX_CHUNKS chunk hashes in one request is a protocol error."""
    n = protocol.MAX_CHUNKS + 1
    with pytest.raises(ProtocolError, match="the limit is 65536"):
        parse(_store(chunk_hashes=list(range(n)), block_ids=list(range(n))))


def test_error_reply_is_one_line():
    """Error replies collapse whitespace so the error is always one line."""
    assert {"id": 4, "ok": False, "error": "a b c", "error_type": "request"} == protocol.error_reply(
        4, "request", "a\n b\tc")


def test_decode_rejects_extension_types():
    """msgpack extension types (and so anything but plain data) do not decode as a request."""
    payload = msgpack.packb(msgpack.ExtType(5, b"x"))
    decoded = protocol.decode_payload(payload)
    with pytest.raises(ProtocolError, match="a request must be a map"):
        parse(decoded)
