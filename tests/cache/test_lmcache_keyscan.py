"""The key-frame scanner: the compiled ``split_key`` and its Python definition agree byte for byte on any
frame and any token lists kept before, what they accept decodes to the same key as the ordinary path, and what
they decline is left to it."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpcache.cache.lmcache import keyscan, wire
from mpcache.cache.lmcache.keycache import KeyCache
from mpcache.errors import ProtocolError

compiled = pytest.mark.skipif(keyscan.split_key is None, reason="mpcache.cache.lmcache._keyscan was not built")
MAX = 64

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=40), st.binary(max_size=40))
tokens = st.lists(st.one_of(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**64 - 1), st.floats(), st.booleans(),
                            st.text(max_size=2)), max_size=MAX + 4)
values = st.one_of(scalars, tokens, st.dictionaries(st.text(max_size=4), scalars, max_size=3))
maps = st.dictionaries(st.one_of(st.sampled_from(["token_ids", "token_bytes", "start", "end", "model_name"]),
                                 st.text(max_size=12),
                                 st.integers(0, 9)), values, max_size=9)


def _frames(draw_map: dict, tail: bytes, cut: int) -> list[bytes]:
    frame = msgpack.packb(draw_map, use_bin_type=True)
    return [frame, frame + tail, frame[:cut], frame[: len(frame) // 2]]


@compiled
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(maps, st.binary(max_size=3), st.integers(0, 64))
def test_the_compiled_scanner_gives_what_its_python_definition_gives(value, tail, cut):
    """Maps of scalars, lists and nested maps, with good and bad token lists, whole, with trailing bytes and
    truncated: the compiled answer is the reference's, byte for byte."""
    for frame in _frames(value, tail, cut):
        assert keyscan.split_key(frame, MAX, ()) == keyscan.split_key_reference(frame, MAX)


@compiled
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tokens, min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 2), maps, st.sampled_from([None, "a", "b", 7]), st.booleans(),
                          st.booleans(), st.integers(0, 3), st.integers(1, 64), st.integers(0, MAX + 2)),
                min_size=1, max_size=12))
def test_token_lists_kept_before_give_what_reading_them_again_gives(lists, steps):
    """Given the (salt, token list) pairs of its last answers, as its owner keeps them: frames that share, extend,
    cut or follow a list with other bytes, in either spelling, under another salt or a smaller token cap, one after
    the other, each give the reference's answer."""
    kept: list[tuple[bytes, bytes]] = []
    for which, others, salt, packed, tokens_first, shape, cut, cap in steps:
        if salt is not None:
            others = {**others, "cache_salt": salt}
        chosen = lists[which % len(lists)]
        if packed:
            listed = {"token_bytes": b"".join(int(t).to_bytes(4, "big") for t in chosen
                                              if type(t) is int and 0 <= t < 2**32)}
        else:
            listed = {"token_ids": chosen}
        frame = msgpack.packb({**listed, **others} if tokens_first else {**others, **listed}, use_bin_type=True)
        frame = [frame, frame + b"\x00", frame[:-cut], frame][shape]
        split = keyscan.split_key(frame, cap, tuple(kept))
        assert split == keyscan.split_key_reference(frame, cap, tuple(kept))
        if split is not None and split[2] is not None:
            kept = [(split[3], split[2]), *kept][:4]


@given(st.lists(st.integers(0, 2**63 - 1), max_size=MAX), st.dictionaries(st.text(max_size=8), scalars, max_size=6))
@settings(max_examples=300, deadline=None)
def test_an_accepted_frame_is_its_map_with_the_tokens_as_int64(token_list, others):
    """What the reference accepts is the map with token_ids nil, and exactly the token values as int64."""
    others.pop("token_ids", None)
    frame = msgpack.packb({**others, "token_ids": token_list}, use_bin_type=True)
    split = keyscan.split_key_reference(frame, MAX)
    assert split is not None
    rest, data, _, _ = split
    assert type(data) is bytes
    assert msgpack.unpackb(rest, raw=False, strict_map_key=False) == {**others, "token_ids": None}
    assert np.frombuffer(data, dtype="<i8").tolist() == token_list


@pytest.mark.parametrize("frame", [
    msgpack.packb([1, 2]),  # not a map
    msgpack.packb({"token_ids": [1, -1]}),  # a negative token
    msgpack.packb({"token_ids": [1, 2**63]}),  # past int64
    msgpack.packb({"token_ids": [1, 1.0]}),  # a float
    msgpack.packb({"token_ids": [True]}),  # a boolean
    msgpack.packb({"token_ids": list(range(MAX + 1))}),  # over the cap
    msgpack.packb({"token_ids": "abc"}),  # not an array
    msgpack.packb({"a": [1], "token_ids": [1]}),  # a container among the other values
    msgpack.packb({1: 2, "token_ids": [1]}),  # a key that is not a string
    msgpack.packb({"start": 0}),  # no token_ids
    b"\x82\xa9token_ids\x91\x01\xa9token_ids\x91\x02",  # token_ids twice
    msgpack.packb({"token_ids": [1]}) + b"\x00",  # trailing bytes
    b"\x81\xa9token_ids\xdd\xff\xff\xff\xff\x01",  # a count far past the frame
    b"\x81\xa9token_ids\x92\xd3\x00\x00\x00",  # a truncated int64
    msgpack.packb({"token_ids": [1], "x": msgpack.ExtType(1, b"a")}),  # an extension type
    msgpack.packb({"token_bytes": b"\x00\x00\x01"}, use_bin_type=True),  # not whole 4-byte tokens
    msgpack.packb({"token_bytes": "abcd"}, use_bin_type=True),  # a str, not a bin
    msgpack.packb({"token_bytes": bytes(4 * (MAX + 1))}, use_bin_type=True),  # over the cap
    msgpack.packb({"token_ids": [1], "token_bytes": bytes(4)}, use_bin_type=True),  # both spellings
])
def test_a_frame_off_the_regular_case_is_declined_by_both(frame):
    assert keyscan.split_key_reference(frame, MAX) is None
    if keyscan.split_key is not None:
        assert keyscan.split_key(frame, MAX, ()) is None


def test_every_integer_encoding_of_a_token_is_read():
    """Tokens msgpack may send as fixint, uint8..64 or (non-negative) int8..64 are all read as their value."""
    elements = [b"\x05", b"\xcc\xff", b"\xcd\x01\x00", b"\xce\x00\x01\x00\x00", b"\xcf" + struct.pack(">Q", 2**63 - 1),
                b"\xd0\x7f", b"\xd1\x7f\xff", b"\xd2\x00\x00\x00\x07", b"\xd3" + struct.pack(">q", 2**40)]
    frame = b"\x81\xa9token_ids" + bytes([0x90 | len(elements)]) + b"".join(elements)
    want = [5, 255, 256, 65536, 2**63 - 1, 127, 32767, 7, 2**40]
    for scan in filter(None, (keyscan.split_key, keyscan.split_key_reference)):
        split = scan(frame, MAX, ())
        assert split is not None and type(split[1]) is bytes
        assert np.frombuffer(split[1], dtype="<i8").tolist() == want


def _key_map(token_list: object) -> dict:
    return {"model_name": "m", "world_size": 2, "worker_id": 1, "token_ids": token_list, "start": 0, "end": 512,
            "request_id": "r", "cache_salt": "s", "num_kv_readers": 1}


@given(st.lists(st.integers(0, 2**63 - 1), max_size=MAX))
@settings(max_examples=200, deadline=None)
def test_a_key_frame_parses_to_the_key_the_ordinary_path_gives(token_list):
    frame = msgpack.packb(_key_map(token_list))
    assert KeyCache(MAX, 4).key(frame) == wire.parse_key(msgpack.unpackb(frame), MAX)


@pytest.mark.parametrize(("token_list", "message"), [
    ([1, -1], "every entry must be an integer"), ([1.0], "every entry must be an integer"),
    (list(range(MAX + 1)), "malformed frame"), ("abc", "expected a list of at most"),
])
def test_a_declined_key_frame_gets_the_ordinary_paths_error(token_list, message):
    with pytest.raises(ProtocolError, match=message):
        KeyCache(MAX, 4).key(msgpack.packb(_key_map(token_list)))
