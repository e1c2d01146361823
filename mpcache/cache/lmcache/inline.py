"""LMCache 0.5.7's typed inline transfer (``transfer_context/tensor_wire.py``): KV objects carried in the
requests themselves, for a worker that cannot map the shared-memory pool.

Two msgpack envelopes, decoded by field name with no unknown field allowed (msgspec's
``forbid_unknown_fields``): ``TensorEnvelope{version: 1, tensors: [{dtype, shape, data}]}`` for a model of
one KV cache group, and ``GroupedTensorEnvelope{version: 1, groups: [{chunk_indices, tensors}]}`` for a
hybrid model, each group's chunk positions strictly increasing.  The bounds are the client's: at most 65,536
tensors, 64 groups, rank 16, 2 GiB a tensor and 16 GiB in all, the envelope at most those bytes plus 1 KiB per
tensor expected; and the server's own: every tensor exactly its group's registered dtype and shape, its bytes
exactly ``shape × itemsize``, no more tensors or chunk positions than the request has chunks, and no more
decoded containers than that many tensors need.  Nothing is unpickled; a bad envelope is one ProtocolError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack

from mpcache.cache.lmcache.groups import CANONICAL_DTYPE, GroupLayout
from mpcache.errors import ProtocolError

VERSION = 1
MAX_TENSORS = 65536
MAX_GROUPS = 64
MAX_RANK = 16
MAX_TENSOR_BYTES = 2 << 30
MAX_TOTAL_BYTES = 16 << 30
METADATA_BYTES_PER_TENSOR = 1024
MAX_NAME_CHARS = 64  # field and dtype names
MAX_MAP_ENTRIES = 8  # a map of the envelope has 2 or 3 fields: one of a few more is named as unknown
_ENVELOPE = frozenset({"version", "tensors"})
_GROUPED = frozenset({"version", "groups"})
_TENSOR = frozenset({"dtype", "shape", "data"})
_GROUP = frozenset({"chunk_indices", "tensors"})

Grouped = list[tuple[list[int], list[bytes]]]  # per group: the chunk positions and each one's bytes
_packer = msgpack.Packer(use_bin_type=True)


def frame_bytes(l1_bytes: int) -> int:
    """The largest inline envelope a connection may send or be sent: no more than L1 could hold (capped at the
    client's own 16 GiB), plus the client's 1 KiB of metadata per tensor for the most tensors."""
    return min(l1_bytes, MAX_TOTAL_BYTES) + METADATA_BYTES_PER_TENSOR * MAX_TENSORS


def encode(layout: GroupLayout, objects: Sequence[Any]) -> bytes:
    """A TensorEnvelope of ``objects`` (buffers of ``layout.object_bytes`` each)."""
    return _packer.pack({"version": VERSION, "tensors": _frames(layout, objects)})


def encode_grouped(groups: Sequence[tuple[GroupLayout, Sequence[int], Sequence[Any]]]) -> bytes:
    """A GroupedTensorEnvelope: per group its layout, the chunk positions and their objects."""
    return _packer.pack({"version": VERSION, "groups": [{"chunk_indices": list(indices),
                                                          "tensors": _frames(layout, objects)}
                                                         for layout, indices, objects in groups]})


def _frames(layout: GroupLayout, objects: Sequence[Any]) -> list[dict[str, Any]]:
    shape = list(layout.shape)
    return [{"dtype": layout.dtype, "shape": shape, "data": data} for data in objects]


def decode(payload: Any, layout: GroupLayout, count: int) -> list[bytes]:
    """A TensorEnvelope of exactly ``count`` objects of ``layout``: their bytes."""
    envelope = _unpack(payload, count, _ENVELOPE)
    tensors = _list(envelope["tensors"], "tensors", MAX_TENSORS)
    if len(tensors) != count:
        raise ProtocolError(f"data: {len(tensors)} tensors for the request's {count} chunks")
    return _tensors(tensors, layout, "tensors", [0])


def decode_grouped(payload: Any, expected: Sequence[tuple[GroupLayout, int]]) -> Grouped:
    """A GroupedTensorEnvelope of one group per ``(layout, chunks)`` of ``expected``: per group its chunk
    positions (strictly increasing, below ``chunks``) and their objects' bytes."""
    envelope = _unpack(payload, sum(chunks for _, chunks in expected), _GROUPED)
    listed = _list(envelope["groups"], "groups", MAX_GROUPS)
    if len(listed) != len(expected):
        raise ProtocolError(f"data: {len(listed)} groups for the registration's {len(expected)}")
    total = [0]
    out: Grouped = []
    for index, (group, (layout, chunks)) in enumerate(zip(listed, expected)):
        name = f"groups[{index}]"
        _fields(group, _GROUP, name)
        positions = _list(group["chunk_indices"], f"{name}.chunk_indices", chunks)
        if any(type(p) is not int for p in positions) or positions != sorted(set(positions)) or (
                positions and not 0 <= positions[0] <= positions[-1] < chunks):
            raise ProtocolError(f"data: {name}.chunk_indices must be strictly increasing chunk positions "
                                f"below {chunks}")
        tensors = _list(group["tensors"], f"{name}.tensors", chunks)
        if len(tensors) != len(positions):
            raise ProtocolError(f"data: {name} has {len(positions)} chunk positions for {len(tensors)} tensors")
        out.append((positions, _tensors(tensors, layout, f"{name}.tensors", total)))
    return out


def _unpack(payload: Any, count: int, fields: frozenset[str]) -> dict[str, Any]:
    """The envelope's map, decoded within the bounds (size, and at most the containers ``count`` tensors
    need), with exactly ``fields`` and version 1."""
    if type(payload) is not bytes:
        raise ProtocolError(f"data: expected bytes, got {type(payload).__name__}")
    if len(payload) > MAX_TOTAL_BYTES + METADATA_BYTES_PER_TENSOR * count:
        raise ProtocolError(f"data: an envelope of {len(payload)} bytes, over the limit for {count} tensors")
    # list entries and maps: per tensor its shape, its map and its places in two lists; per group its map,
    # its lists and its place in the list of groups; the envelope
    budget = [count * (MAX_RANK + 7) + 6 * MAX_GROUPS + 8]

    def spend(container: Any) -> Any:
        budget[0] -= len(container) + 1
        if budget[0] < 0:
            raise ProtocolError(f"data: more containers than {count} tensors need")
        return container

    try:
        envelope = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True, ext_hook=_no_ext,
                                   max_bin_len=MAX_TENSOR_BYTES, max_str_len=MAX_NAME_CHARS,
                                   max_array_len=MAX_TENSORS, max_map_len=MAX_MAP_ENTRIES,
                                   list_hook=spend, object_hook=spend)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ProtocolError(f"data: not one bounded msgpack envelope ({type(exc).__name__})") from None
    _fields(envelope, fields, "envelope")
    version = envelope["version"]
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"data: envelope version {str(version)[:16]}; version {VERSION} is served")
    return envelope


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"data: msgpack extension type {code} in an envelope")


def _fields(value: Any, fields: frozenset[str], name: str) -> None:
    if not isinstance(value, dict):
        raise ProtocolError(f"data: {name}: expected a map, got {type(value).__name__}")
    if value.keys() != fields:
        unknown, missing = sorted(value.keys() - fields), sorted(fields - value.keys())
        raise ProtocolError(f"data: {name}: " + (f"unknown field {unknown[0]!r}" if unknown
                                                 else f"missing field {missing[0]!r}"))


def _list(value: Any, name: str, most: int) -> list[Any]:
    if type(value) is not list or len(value) > most:
        raise ProtocolError(f"data: {name}: expected a list of at most {most}")
    return value


def _tensors(tensors: list[Any], layout: GroupLayout, name: str, total: list[int]) -> list[bytes]:
    """Each tensor's bytes, checked against ``layout``; ``total`` counts every group's bytes."""
    out = []
    for index, tensor in enumerate(tensors):
        where = f"{name}[{index}]"
        _fields(tensor, _TENSOR, where)
        dtype, shape, data = tensor["dtype"], tensor["shape"], tensor["data"]
        if type(dtype) is not str or dtype not in CANONICAL_DTYPE.values():
            raise ProtocolError(f"data: {where}.dtype: {str(dtype)[:32]!r} is not a supported torch dtype")
        if dtype != layout.dtype:
            raise ProtocolError(f"data: {where}.dtype: {dtype}, but this group's objects are {layout.dtype}")
        if (type(shape) is not list or len(shape) > MAX_RANK
                or not all(type(size) is int and size >= 0 for size in shape)):
            raise ProtocolError(f"data: {where}.shape: expected at most {MAX_RANK} sizes")
        if tuple(shape) != layout.shape:
            raise ProtocolError(f"data: {where}.shape: {shape}, but this group's objects are {list(layout.shape)}")
        if type(data) is not bytes or len(data) != layout.object_bytes:
            size = len(data) if type(data) is bytes else type(data).__name__
            raise ProtocolError(f"data: {where}.data: {size} bytes for shape {shape} of {dtype} "
                                f"({math.prod(shape)} elements: {layout.object_bytes} bytes)")
        total[0] += len(data)
        if total[0] > MAX_TOTAL_BYTES:
            raise ProtocolError(f"data: tensors of over {MAX_TOTAL_BYTES >> 30} GiB")
        out.append(data)
    return out
