"""The chunk record (header, name, payload, checksum) that fs files and redis values hold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from support.l2 import MAC_KEY

from mpcache.cache.l2.base import (
    HEADER_BYTES,
    decode_name,
    decode_record,
    encode_name,
    encode_record,
    key_digest,
    parse_header,
)
from mpcache.contract.keys import ChunkKey

KEY = ChunkKey("llama-3-8b", "tenant-1", 0x0123456789ABCDEF)
keys = st.builds(ChunkKey, st.text(max_size=40), st.text(max_size=40), st.integers(0, 2**64 - 1))


@given(keys, st.binary(max_size=300))
def test_records_decode_to_their_key_and_payload(chunk_key, data):
    """Any key (unicode names, any 64-bit hash) and payload survive encode → decode unchanged."""
    decoded = decode_record(encode_record(chunk_key, data, MAC_KEY), MAC_KEY)

    assert (chunk_key, data) == (decoded[0], bytes(decoded[1]))


@given(keys)
def test_names_decode_to_their_key(chunk_key):
    """encode_name is reversible (redis reports evicted keys from it)."""
    assert chunk_key == decode_name(encode_name(chunk_key))


def test_every_truncation_is_rejected():
    """A record cut short at any length decodes to None."""
    record = encode_record(KEY, bytes(range(200)), MAC_KEY)

    assert [None] * len(record) == [decode_record(record[:length], MAC_KEY) for length in range(len(record))]


@settings(max_examples=50)
@given(st.binary(min_size=1, max_size=64), st.data())
def test_every_single_byte_change_is_rejected(data, draw):
    """Changing any one byte of a record (header, name or payload) makes it decode to None."""
    record = bytearray(encode_record(KEY, data, MAC_KEY))
    position = draw.draw(st.integers(0, len(record) - 1))
    record[position] ^= draw.draw(st.integers(1, 255))

    assert None is decode_record(bytes(record), MAC_KEY)


def test_trailing_bytes_are_rejected():
    """A record with bytes after its declared payload is not accepted."""
    assert None is decode_record(encode_record(KEY, b"payload", MAC_KEY) + b"\0", MAC_KEY)


def test_header_parse_needs_no_payload():
    """parse_header reads key and payload extent from the header and name bytes alone (the fs scan)."""
    record = encode_record(KEY, b"x" * 5000, MAC_KEY)
    name_end = HEADER_BYTES + len(KEY.model_name) + len(KEY.cache_salt)

    assert (KEY, name_end, 5000) == tuple(parse_header(record[:name_end]))


def test_digest_is_stable_across_processes():
    """key_digest is a content hash (not Python's salted hash): this value holds in every process."""
    assert "db76634160f915b553c73e2d202a1270" == key_digest(KEY)
