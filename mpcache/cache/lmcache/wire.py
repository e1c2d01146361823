"""LMCache 0.5.x MP-mode wire format: argument decoding and validation.

A request is ``[identity, uid, op, arg1, …]``; every frame after the identity is one msgpack object
(``op`` an integer from LMCache's frozen table or an operation name: :mod:`.operations`).  A reply echoes
identity, uid and op, then the msgpack result, which is left out when the result is None.  LMCache has no
error frame, so a refused request is answered with its operation's failure value.  Nothing here unpickles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from mpcache.contract import protocol
from mpcache.errors import ProtocolError

MAX_WORLD_SIZE = 4096
MAX_READERS = 4096
MAX_MAP_ENTRIES = 256  # the largest legitimate map (a key, a registration) has a dozen
SMALL_FRAME_BYTES = 4096  # frames up to this size are decoded without counting containers
MEMO_FRAME_BYTES = 48  # frames up to this size that decode to a scalar are remembered, at most MEMO_ENTRIES
MEMO_ENTRIES = 4096
_SCALARS = frozenset({int, str, bytes, bool, float, type(None)})
_MISSING = object()
BYTES_PER_TOKEN = 5  # a token id below 2**32 is at most 5 bytes of msgpack
FRAME_MARGIN_BYTES = 1 << 20  # the rest of the largest legitimate frame: a key's other fields, block records
_I64_MAX = (1 << 63) - 1
_I64 = protocol.int_range(-(1 << 63), _I64_MAX)
_POSITION = protocol.int_range(0, (1 << 62) - 1)
_WORLD_SIZE = protocol.int_range(1, MAX_WORLD_SIZE)
_READERS = protocol.int_range(0, MAX_READERS)


def frame_cap(max_tokens: int) -> int:
    """The largest frame a client may send: a key of ``max_tokens`` token ids, and some room."""
    return max_tokens * BYTES_PER_TOKEN + FRAME_MARGIN_BYTES


class Decoder:
    """msgpack frames into objects, bounded: no array longer than ``max_tokens``, no map over
    ``MAX_MAP_ENTRIES``, and (over ``SMALL_FRAME_BYTES``) at most one container per 8 bytes, so no frame expands into
    more than a small multiple of its size in Python objects; extension types are refused.  Frames of a few
    bytes that decode to an immutable scalar (an instance id, a request id, ``b""``) are remembered: the same
    frame comes with every request of an instance or a request."""

    __slots__ = ("max_tokens", "_scalars")

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._scalars: dict[bytes, Any] = {}

    def __call__(self, frame: bytes) -> Any:
        if len(frame) <= MEMO_FRAME_BYTES:
            scalars = self._scalars
            value = scalars.get(frame, _MISSING)
            if value is _MISSING:
                value = self._unpack(frame, None, None)
                if type(value) in _SCALARS:
                    if len(scalars) >= MEMO_ENTRIES:
                        scalars.clear()
                    scalars[frame] = value
            return value
        if len(frame) <= SMALL_FRAME_BYTES:  # too small to expand into many objects: no hooks to call
            return self._unpack(frame, None, None)
        budget = 16 + len(frame) // 8

        def count(container: Any) -> Any:
            nonlocal budget
            budget -= 1
            if budget < 0:
                raise ProtocolError("malformed frame: more nested containers than its size allows")
            return container

        return self._unpack(frame, count, count)

    def _unpack(self, frame: bytes, list_hook: Any, object_hook: Any) -> Any:
        try:
            return msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_refuse_ext,
                                   max_array_len=self.max_tokens, max_map_len=MAX_MAP_ENTRIES,
                                   list_hook=list_hook, object_hook=object_hook)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
            raise ProtocolError(f"malformed frame: not one bounded msgpack object ({type(exc).__name__})") from None


decode = Decoder(protocol.MAX_CHUNKS * 256)  # the operation frame, and callers without a configured bound


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not accepted (CUDA IPC handles need lmcache_driven mode)")


_packer = msgpack.Packer(use_bin_type=True)  # one for the loop: no Packer built per reply


def encode(result: Any) -> bytes:
    return _packer.pack(result)


@dataclass(frozen=True, slots=True)
class Key:
    """LMCache's IPCCacheServerKey: which tokens of which request, for which rank of which model
    (``tokens``: the token ids as little-endian int64 bytes, whichever way the client spelled them, so a chunk
    hashes the same for every client version).  ``engine_hit_tokens``: the prompt's prefix the engine's own
    prefix cache holds, as a 0.5.7 client hints it (``request_configs``), else 0."""

    model_name: str
    world_size: int
    worker_id: int | None
    tokens: bytes
    start: int
    end: int
    request_id: str
    cache_salt: str
    num_kv_readers: int
    engine_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 8


ENGINE_HIT_HINT = "lmcache.hint.engine_computed_tokens"
PACKED_TOKEN_BYTES = 4  # LMCache 0.5.7's token_bytes: each token a big-endian uint32
_BOTH_SPELLINGS = "key: token_ids and token_bytes both given; a key carries one of them"


def _field(value: dict, name: str) -> Any:
    if name not in value:
        raise ProtocolError(f"key.{name}: missing")
    return value[name]


def parse_key(value: Any, max_tokens: int) -> Key:
    """Validate an IPCCacheServerKey map (0.5.6's ``token_ids`` or 0.5.7's ``token_bytes``); ProtocolError names
    the first bad field."""
    if not isinstance(value, dict):
        raise ProtocolError(f"key: expected a map, got {type(value).__name__}")
    if "token_bytes" in value:
        if "token_ids" in value:
            raise ProtocolError(_BOTH_SPELLINGS)
        return key_from_map(value, unpack_token_bytes(value["token_bytes"], max_tokens))
    tokens = _field(value, "token_ids")
    if type(tokens) is not list or len(tokens) > max_tokens:
        raise ProtocolError(f"key.token_ids: expected a list of at most {max_tokens} token ids (--lmcache-max-tokens)")
    if not all(type(t) is int and 0 <= t <= _I64_MAX for t in tokens):
        raise ProtocolError("key.token_ids: every entry must be an integer in 0..2**63-1")
    return key_from_map(value, np.array(tokens, dtype="<i8").tobytes())


def unpack_token_bytes(packed: Any, max_tokens: int) -> bytes:
    """0.5.7's packed tokens (big-endian uint32 each) as little-endian int64 bytes, without a Python int per
    token."""
    if type(packed) is not bytes or len(packed) % PACKED_TOKEN_BYTES or len(packed) > max_tokens * PACKED_TOKEN_BYTES:
        raise ProtocolError(f"key.token_bytes: expected bytes of whole 4-byte tokens, at most {max_tokens} tokens "
                            "(--lmcache-max-tokens)")
    return np.frombuffer(packed, dtype=">u4").astype("<i8").tobytes()


def key_from_map(value: dict, tokens: bytes) -> Key:
    """A key map's fields besides its token list, checked, around its tokens (validated int64 bytes)."""
    world_size = _WORLD_SIZE(_field(value, "world_size"), "key.world_size")
    worker_id = value.get("worker_id")
    if worker_id is not None and (type(worker_id) is not int or not 0 <= worker_id < world_size):
        protocol.int_range(0, world_size - 1)(worker_id, "key.worker_id")  # raises, naming the range
    start = _POSITION(_field(value, "start"), "key.start")
    end = _POSITION(_field(value, "end"), "key.end")
    if start > end:
        raise ProtocolError(f"key.start: {start} is after key.end {end}")
    readers = _READERS(value.get("num_kv_readers", 0), "key.num_kv_readers")
    salt = value.get("cache_salt") or ""
    return Key(protocol.MODEL(_field(value, "model_name"), "key.model_name"), world_size, worker_id, tokens,
               start, end, protocol.REQUEST_ID(_field(value, "request_id"), "key.request_id"),
               protocol.SALT(salt, "key.cache_salt"), readers, _engine_hit_tokens(value.get("request_configs")))


def _engine_hit_tokens(configs: Any) -> int:
    """The engine's prefix-cache hit a 0.5.7 lookup hints; 0 without the hint."""
    if configs is None:
        return 0
    if not isinstance(configs, dict):
        raise ProtocolError(f"key.request_configs: expected a map, got {type(configs).__name__}")
    return _POSITION(configs.get(ENGINE_HIT_HINT, 0), f"key.request_configs[{ENGINE_HIT_HINT!r}]")


def chunk_range(key: Key, chunk_tokens: int) -> tuple[int, int]:
    """The whole chunks a key's ``[start, end)`` covers: chunk i spans tokens ``[i·c, (i+1)·c)``,
    and only chunks that end within ``min(end, len(token_ids))`` count (LMCache's rule)."""
    first = -(-key.start // chunk_tokens)
    last = min(key.end, key.num_tokens) // chunk_tokens
    return first, max(first, last)


def instance_id(value: Any, field: str = "instance_id") -> int:
    return _I64(value, field)


def parse_block_records(value: Any) -> list[tuple[str, list[int], list[int]]]:
    """``[{req_id, new_block_ids, new_token_ids}, …]`` as the cache protocol's block records."""
    if type(value) is not list:
        raise ProtocolError(f"allocations: expected a list, got {type(value).__name__}")
    rows = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise ProtocolError(f"allocations[{index}]: expected a map")
        rows.append([item.get("req_id"), item.get("new_block_ids"), item.get("new_token_ids")])
    return protocol.BLOCK_RECORDS(rows, "allocations")
