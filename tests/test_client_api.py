"""The typed client against the operation table: it cannot drift from what the server declares."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from mpcache.cache.native.ops import OPERATIONS
from mpcache.client import BlockBuffer, CacheClient, CudaKVBuffer, KVBuffer
from mpcache.client.results import from_reply, reply_keys
from mpcache.contract.protocol import REQUIRED
from mpcache.errors import ProtocolError

# Request fields the client fills in itself, and what a buffer parameter stands for.
CLIENT_FILLED = {"register_cuda_buffer": {"ipc_handle"}}
CLIENT_DEFAULTS = {("register_cuda_buffer", "device_index")}  # required on the wire, defaulted in the client
# Operations whose method returns one value, or a buffer, rather than a result type: the reply fields it reads.
PLAIN_REPLIES = {
    "lookup_prefetch": (int, ("job_id",)),
    "end_session": (bool, ("known",)),
    "unregister_buffer": (type(None), ()),
    "register_buffer": (KVBuffer, ("buffer_id",)),
    "register_cuda_buffer": (CudaKVBuffer, ("buffer_id", "device")),
}


# A new operation is one declaration (mpcache.cache.native.ops); `client.call(op, **fields)` reaches it at once. The
# typed methods are sugar over `call`: the ones that exist are held to the table here.
TYPED = sorted(op for op in OPERATIONS if hasattr(CacheClient, op))


def _method(op: str):
    return getattr(CacheClient, op)


def test_the_operations_an_engine_drives_have_typed_methods():
    """The request path has typed methods (a newly declared operation is reached by ``call`` until it gets one)."""
    assert {"ping", "register_buffer", "store", "lookup_prefetch", "query_prefetch_status", "wait_prefetch",
            "retrieve", "end_session", "report_block_allocations"} - {"wait_prefetch"} <= set(TYPED)


@pytest.mark.parametrize("op", TYPED)
def test_every_typed_method_takes_its_operations_request_fields(op):
    """Each operation has a CacheClient method of its name whose parameters are the op's request fields
    (``buffer`` for ``buffer_id``), with the server's defaults; everything after a buffer is keyword-only."""
    params = list(inspect.signature(_method(op)).parameters.values())[1:]  # without self
    fields = {name: default for name, _, default in OPERATIONS[op].fields if name not in CLIENT_FILLED.get(op, ())}
    names = ["buffer_id" if p.name == "buffer" else p.name for p in params]

    assert sorted(fields) == sorted(names)
    for param, name in zip(params, names):
        if fields[name] is REQUIRED and (op, name) not in CLIENT_DEFAULTS:
            assert param.default is inspect.Parameter.empty, f"{op}.{name} is required by the server"
        elif fields[name] is not REQUIRED:
            assert fields[name] == param.default, f"{op}.{name}: the server's default is {fields[name]!r}"
    if params and params[0].name == "buffer":
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), op


@pytest.mark.parametrize("op", TYPED)
def test_every_result_type_reads_exactly_its_operations_reply_fields(op):
    """A method returning a result type reads, field for field and in order, the reply fields the operation
    declares; the others read the one value (or the buffer's fields) listed here."""
    returned = typing.get_type_hints(_method(op))["return"]
    replies = OPERATIONS[op].replies

    if dataclasses.is_dataclass(returned):
        assert replies == reply_keys(returned)
        assert returned.__dataclass_params__.frozen  # type: ignore[attr-defined]
    else:
        assert (returned, replies) == PLAIN_REPLIES[op]


def test_wait_prefetch_returns_the_status_type():
    """wait_prefetch returns what query_prefetch_status returns."""
    hints = typing.get_type_hints(CacheClient.wait_prefetch)
    assert typing.get_type_hints(CacheClient.query_prefetch_status)["return"] is hints["return"]


def test_a_reply_missing_a_declared_field_is_a_protocol_error():
    """A reply without a field its result type reads raises ProtocolError naming the field."""
    from mpcache.client import StoreResult

    with pytest.raises(ProtocolError, match="skipped_count"):
        from_reply(StoreResult, {"stored_count": 1, "failed_count": 0})


def test_both_buffer_kinds_declare_the_buffer_interface():
    """KVBuffer and CudaKVBuffer carry every attribute BlockBuffer declares."""
    declared = set(BlockBuffer.__annotations__) | {"close"}
    for kind in (KVBuffer, CudaKVBuffer):
        annotated = {name for cls in kind.__mro__ for name in getattr(cls, "__annotations__", {})}
        assert declared <= annotated | set(dir(kind)), kind
