"""An LMCache key frame's token list read straight from its msgpack bytes into int64s, without a Python
int per token: :func:`split_key` is the compiled scanner (``_keyscan.c``), None where it was not built.

``split_key(frame, max_tokens)`` returns ``(rest, tokens)`` — the frame with its ``token_ids`` array
replaced by nil, and the tokens as little-endian int64 bytes — or None when the frame is not the regular
case (one map, string keys, scalar values, one ``token_ids`` array of at most ``max_tokens`` integers in
0..2**63-1, nothing after it); the caller then decodes the frame the ordinary way, whose checks name the
problem.  :func:`split_key_reference` is the same function in Python: the definition the compiled one is
held to, byte for byte, by a differential test.  The compiled one keeps the last few token arrays it read
and finds a repeated one (a request's token list comes with every operation) with one comparison, for frames
of the same ``cache_salt`` only.
"""

from __future__ import annotations

from collections.abc import Callable

SplitKey = Callable[[bytes, int], "tuple[bytes, bytes] | None"]

split_key: SplitKey | None
try:
    from mpcache.cache.lmcache._keyscan import split_key
except ImportError:  # no C compiler at install time: the ordinary decode path
    split_key = None

_I64_MAX = (1 << 63) - 1
_FIXED = {0xCC: 1, 0xD0: 1, 0xCD: 2, 0xD1: 2, 0xCE: 4, 0xD2: 4, 0xCA: 4, 0xCF: 8, 0xD3: 8, 0xCB: 8}
_SIZED = {0xD9: 1, 0xC4: 1, 0xDA: 2, 0xC5: 2, 0xDB: 4, 0xC6: 4}  # str / bin: a length of 1, 2 or 4 bytes
_STR_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_TOKEN_INTS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
               0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


class _Decline(Exception):
    pass


class _Cursor:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or len(self.data) - self.pos < n:
            raise _Decline
        piece = self.data[self.pos : self.pos + n]
        self.pos += n
        return piece

    def byte(self) -> int:
        return self.take(1)[0]

    def length(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")


def _skip_scalar(c: _Cursor) -> None:
    t = c.byte()
    if t <= 0x7F or t >= 0xE0 or t in (0xC0, 0xC2, 0xC3):
        return
    if 0xA0 <= t <= 0xBF:
        c.take(t & 0x1F)
    elif t in _FIXED:
        c.take(_FIXED[t])
    elif t in _SIZED:
        c.take(c.length(_SIZED[t]))
    else:
        raise _Decline  # array, map, ext, or the never-used 0xc1


def _read_str(c: _Cursor) -> bytes:
    t = c.byte()
    if 0xA0 <= t <= 0xBF:
        return c.take(t & 0x1F)
    if t in _STR_SIZED:
        return c.take(c.length(_STR_SIZED[t]))
    raise _Decline


def _read_token(c: _Cursor) -> int:
    t = c.byte()
    if t <= 0x7F:
        return t
    if t not in _TOKEN_INTS:
        raise _Decline
    n, signed = _TOKEN_INTS[t]
    value = c.length(n)
    if (signed and value >> (8 * n - 1)) or value > _I64_MAX:
        raise _Decline
    return value


def split_key_reference(frame: bytes, max_tokens: int) -> tuple[bytes, bytes] | None:
    """What :func:`split_key` returns, computed in Python (see the module's docstring)."""
    c = _Cursor(bytes(frame))
    try:
        t = c.byte()
        if 0x80 <= t <= 0x8F:
            entries = t & 0x0F
        elif t in (0xDE, 0xDF):
            entries = c.length(2 if t == 0xDE else 4)
        else:
            return None
        span: tuple[int, int] | None = None
        tokens = b""
        for _ in range(entries):
            if _read_str(c) != b"token_ids":
                _skip_scalar(c)
                continue
            if span is not None:
                return None  # a second token_ids
            at = c.pos
            a = c.byte()
            if 0x90 <= a <= 0x9F:
                count = a & 0x0F
            elif a in (0xDC, 0xDD):
                count = c.length(2 if a == 0xDC else 4)
            else:
                return None
            if count > max_tokens or len(c.data) - c.pos < count:
                return None
            tokens = b"".join(_read_token(c).to_bytes(8, "little") for _ in range(count))
            span = (at, c.pos)
        if span is None or c.pos != len(c.data):
            return None
    except _Decline:
        return None
    return c.data[: span[0]] + b"\xc0" + c.data[span[1] :], tokens
