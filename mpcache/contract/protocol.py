"""The client protocol's wire format: length-prefixed msgpack frames, the request and reply envelopes, and
the field validators operations declare (``docs/PROTOCOL.md``).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgpack

from mpcache.errors import ProtocolError

MAX_FRAME_BYTES = 1 << 20
FRAME_HEADER = struct.Struct(">I")
NAME_MAX_BYTES = 128  # model_name, cache_salt (UTF-8 bytes)
REQUEST_ID_MAX_BYTES = 256
MAX_CHUNKS = 65536  # chunk hashes / block ids per request
MAX_BLOCKS = 1 << 24  # blocks per registered buffer
MAX_TIMEOUT_S = 86400.0
MAX_REPORT_TOKENS = 1 << 20  # token ids per block allocation report
CUDA_IPC_HANDLE_BYTES = 64
MAX_CUDA_DEVICES = 1024
_U64_MAX = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SALT_FORBIDDEN = re.compile(r"[@/\\]")
_MODEL_FORBIDDEN = re.compile(r"[@\\]")  # "org/model" names are normal; "@" is L2's key separator


class Request(NamedTuple):
    op: str
    id: int
    args: dict[str, Any]


# -- frames ---------------------------------------------------------------------


def encode_frame(message: dict) -> bytes:
    """Length-prefixed msgpack frame; ProtocolError if it would exceed MAX_FRAME_BYTES."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message is {len(payload)} bytes, the limit is {MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Any:
    """The msgpack object in one frame's payload; ProtocolError if it is not exactly one."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ProtocolError(f"malformed frame: not one msgpack object ({type(exc).__name__})") from None


def message_id(message: Any) -> int | None:
    """The request id, if the message has a valid one (for error replies)."""
    if isinstance(message, dict):
        value = message.get("id")
        if type(value) is int and 0 <= value <= _I64_MAX:
            return value
    return None


ERROR_MAX_CHARS = 512  # an error echoes at most this much of what the client sent


def error_reply(request_id: int | None, error_type: str, message: str) -> dict:
    """One line, at most ERROR_MAX_CHARS characters, whatever the bad input was."""
    return {"id": request_id, "ok": False, "error": bounded(message), "error_type": error_type}


def bounded(message: str) -> str:
    """``message`` on one line, cut to ERROR_MAX_CHARS characters (with a marker when cut)."""
    line = " ".join(str(message).split())
    return line if len(line) <= ERROR_MAX_CHARS else line[: ERROR_MAX_CHARS - 12] + " …(cut)"


# -- field validators -------------------------------------------------------------


def int_range(lo: int, hi: int) -> Callable[[Any, str], int]:
    def check(value: Any, field: str) -> int:
        if type(value) is not int:
            raise ProtocolError(f"{field}: expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ProtocolError(f"{field}: {value} is outside {lo}..{hi}")
        return value

    return check


def _name(forbidden: re.Pattern, shown: str, allow_empty: bool) -> Callable[[Any, str], str]:
    def check(value: Any, field: str) -> str:
        if type(value) is not str:
            raise ProtocolError(f"{field}: expected a string, got {type(value).__name__}")
        if not value and not allow_empty:
            raise ProtocolError(f"{field}: must not be empty")
        if len(value.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
            raise ProtocolError(f"{field}: longer than {NAME_MAX_BYTES} bytes of UTF-8")
        if forbidden.search(value) or _CONTROL.search(value):
            raise ProtocolError(f"{field}: contains a forbidden character ({shown}, NUL or a control character)")
        return value

    return check


def _request_id(value: Any, field: str) -> str:
    if type(value) is not str or not value:
        raise ProtocolError(f"{field}: expected a non-empty string")
    if len(value.encode("utf-8", "surrogatepass")) > REQUEST_ID_MAX_BYTES or _CONTROL.search(value):
        raise ProtocolError(f"{field}: longer than {REQUEST_ID_MAX_BYTES} bytes or has control characters")
    return value


def int_list(lo: int, hi: int, allow_empty: bool) -> Callable[[Any, str], list[int]]:
    def check(value: Any, field: str) -> list[int]:
        if type(value) is not list:
            raise ProtocolError(f"{field}: expected a list of integers, got {type(value).__name__}")
        if not value and not allow_empty:
            raise ProtocolError(f"{field}: must not be empty")
        if len(value) > MAX_CHUNKS:
            raise ProtocolError(f"{field}: {len(value)} entries, the limit is {MAX_CHUNKS}")
        for item in value:
            if type(item) is not int or not lo <= item <= hi:
                raise ProtocolError(f"{field}: every entry must be an integer in {lo}..{hi}")
        return value

    return check


def _timeout(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 <= value <= MAX_TIMEOUT_S:  # NaN fails the range test
        raise ProtocolError(f"{field}: expected nil or seconds in 0..{MAX_TIMEOUT_S:g}")
    return float(value)


ID = int_range(0, _I64_MAX)
COUNT = int_range(1, MAX_BLOCKS)
BYTES = int_range(1, 1 << 40)
ENGINE = int_range(_I64_MIN, _I64_MAX)
MODEL = _name(_MODEL_FORBIDDEN, "@ \\", allow_empty=False)
SALT = _name(_SALT_FORBIDDEN, "@ / \\", allow_empty=True)
HASHES = int_list(0, _U64_MAX, allow_empty=False)
BLOCK_IDS = int_list(0, MAX_BLOCKS - 1, allow_empty=False)
TOKENS = int_list(0, _I64_MAX, allow_empty=False)
OPTIONAL_BLOCK_IDS = int_list(0, MAX_BLOCKS - 1, allow_empty=True)
CHUNK_INDICES = int_list(0, MAX_CHUNKS - 1, allow_empty=True)
DEVICE_INDEX = int_range(0, MAX_CUDA_DEVICES - 1)
WORKER_ID = int_range(-1, _I64_MAX)


def _block_records(value: Any, field: str) -> list[tuple[str, list[int], list[int]]]:
    """``[[request_id, [block_id, …], [token_id, …]], …]`` of one scheduler step (see mpcache.cache.l0)."""
    if type(value) is not list:
        raise ProtocolError(f"{field}: expected a list of [request_id, block_ids, token_ids], "
                            f"got {type(value).__name__}")
    if len(value) > MAX_CHUNKS:
        raise ProtocolError(f"{field}: {len(value)} records, the limit is {MAX_CHUNKS}")
    records, blocks, tokens = [], 0, 0
    for i, record in enumerate(value):
        where = f"{field}[{i}]"
        if type(record) is not list or len(record) != 3:
            raise ProtocolError(f"{where}: expected [request_id, block_ids, token_ids]")
        request_id, block_ids, token_ids = record
        _request_id(request_id, f"{where}.request_id")
        for name, ids in (("block_ids", block_ids), ("token_ids", token_ids)):
            if type(ids) is not list:
                raise ProtocolError(f"{where}.{name}: expected a list of integers, got {type(ids).__name__}")
            for item in ids:
                if type(item) is not int or not 0 <= item <= _I64_MAX:
                    raise ProtocolError(f"{where}.{name}: every entry must be an integer in 0..2**63-1")
        blocks += len(block_ids)
        tokens += len(token_ids)
        if blocks > MAX_CHUNKS:
            raise ProtocolError(f"{field}: more than {MAX_CHUNKS} block ids in one report")
        if tokens > MAX_REPORT_TOKENS:
            raise ProtocolError(f"{field}: more than {MAX_REPORT_TOKENS} token ids in one report")
        records.append((request_id, block_ids, token_ids))
    return records


def _ipc_handle(value: Any, field: str) -> bytes:
    """A CUDA IPC memory handle (``cudaIpcMemHandle_t``, 64 bytes) as 128 hex digits."""
    if type(value) is not str or len(value) != 2 * CUDA_IPC_HANDLE_BYTES:
        raise ProtocolError(f"{field}: expected {2 * CUDA_IPC_HANDLE_BYTES} hex digits (a CUDA IPC memory handle)")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{field}: expected {2 * CUDA_IPC_HANDLE_BYTES} hex digits "
                            "(a CUDA IPC memory handle)") from None

REQUEST_ID = _request_id
TIMEOUT = _timeout
BLOCK_RECORDS = _block_records
IPC_HANDLE = _ipc_handle
REQUIRED = object()  # a field without a default
Validator = Callable[[Any, str], Any]
Field = tuple[str, Validator, Any]  # (name, validator, default or REQUIRED)
_ENVELOPE = frozenset(("op", "id"))


def parse_request(message: Any, schemas: Mapping[str, tuple[Field, ...]]) -> Request:
    """Validate one decoded message against its op's fields; ProtocolError names the first problem."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a request must be a map, got {type(message).__name__}")
    op = message.get("op")
    if type(op) is not str:
        raise ProtocolError("op: expected a string")
    request_id = message_id(message)
    if request_id is None:
        raise ProtocolError("id: expected an integer in 0..2**63-1")
    schema = schemas.get(op)
    if schema is None:
        raise ProtocolError(f"op: unknown operation {op[:64]!r}")
    args: dict[str, Any] = {}
    given = 2  # op and id
    for field, check, default in schema:
        if field in message:
            args[field] = check(message[field], field)
            given += 1
        elif default is REQUIRED:
            raise ProtocolError(f"{field}: missing (required by {op})")
        else:
            args[field] = default
    if len(message) != given:
        extra = [str(k)[:32] for k in message if k not in _ENVELOPE and k not in args]
        shown = ", ".join(sorted(extra[:8])) + (f" and {len(extra) - 8} more" if len(extra) > 8 else "")
        raise ProtocolError(f"unexpected field(s) for {op}: {shown}")
    return Request(op, request_id, args)

