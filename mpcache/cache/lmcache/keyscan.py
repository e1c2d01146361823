"""An LMCache key frame's token list read straight from its msgpack bytes into int64s, without a Python
int per token: :func:`split_key` is the compiled scanner (``_keyscan.c``), None where it was not built.

``split_key(frame, max_tokens, kept)`` returns ``(rest, found, token_list, salt)`` — the frame with its token
list (0.5.6's ``token_ids`` array or 0.5.7's ``token_bytes`` bin) replaced by nil, and either the index of the
``kept`` (salt, token_list) pair whose bytes the frame's token list and ``cache_salt`` value are (then the last two
are None), or the tokens as little-endian int64 bytes and the frame's encodings of its token list and salt —
or None when the frame is not the regular case (one map, string keys, scalar values, one token list of at most
``max_tokens`` tokens, each in 0..2**63-1, nothing after it); the caller then decodes the frame the ordinary way,
whose checks name the problem.  ``kept`` holds pairs split_key returned before (their one owner is
:mod:`.keycache`); the scanner keeps nothing.  :func:`split_key_reference` is the same function in Python: the
definition the compiled one is held to, byte for byte, by a differential test.
"""

from __future__ import annotations

from collections.abc import Callable

Kept = tuple[tuple[bytes, bytes], ...]
Split = tuple[bytes, int, None, None] | tuple[bytes, bytes, bytes, bytes] | None
SplitKey = Callable[[bytes, int, Kept], Split]

split_key: SplitKey | None
try:
    from mpcache.cache.lmcache._keyscan import split_key
except ImportError:  # no C compiler at install time: the ordinary decode path
    split_key = None

_I64_MAX = (1 << 63) - 1
_FIXED = {0xCC: 1, 0xD0: 1, 0xCD: 2, 0xD1: 2, 0xCE: 4, 0xD2: 4, 0xCA: 4, 0xCF: 8, 0xD3: 8, 0xCB: 8}
_SIZED = {0xD9: 1, 0xC4: 1, 0xDA: 2, 0xC5: 2, 0xDB: 4, 0xC6: 4}  # str / bin: a length of 1, 2 or 4 bytes
_STR_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_BIN_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_MAP_SIZED = {0xDE: 2, 0xDF: 4}
_ARRAY_SIZED = {0xDC: 2, 0xDD: 4}
_TOKEN_LISTS = (b"token_ids", b"token_bytes")
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


def _count(c: _Cursor, t: int, fixed: int, sized: dict[int, int]) -> int:
    """A map's or array's element count from its type byte ``t``: in the byte (``fixed`` .. ``fixed`` + 15) or
    in the 2 or 4 bytes after it."""
    if fixed <= t <= fixed + 0x0F:
        return t & 0x0F
    if t not in sized:
        raise _Decline
    return c.length(sized[t])


def _read_tokens(c: _Cursor, field: bytes, max_tokens: int) -> bytes:
    """The token list at the cursor as int64 bytes (``token_ids``: an array, ``token_bytes``: a bin)."""
    t = c.byte()
    if field == b"token_bytes":
        if t not in _BIN_SIZED:
            raise _Decline
        n = c.length(_BIN_SIZED[t])
        if n % 4 or n // 4 > max_tokens:
            raise _Decline
        packed = c.take(n)
        return b"".join(int.from_bytes(packed[i : i + 4], "big").to_bytes(8, "little") for i in range(0, n, 4))
    count = _count(c, t, 0x90, _ARRAY_SIZED)
    if count > max_tokens or len(c.data) - c.pos < count:
        raise _Decline
    return b"".join(_read_token(c).to_bytes(8, "little") for _ in range(count))


def split_key_reference(frame: bytes, max_tokens: int, kept: Kept = ()) -> Split:
    """What :func:`split_key` returns, computed in Python (see the module's docstring)."""
    c = _Cursor(bytes(frame))
    try:
        entries = _count(c, c.byte(), 0x80, _MAP_SIZED)
        span: tuple[int, int] | None = None
        salt = b""
        tokens = b""
        for _ in range(entries):
            field = _read_str(c)
            if field not in _TOKEN_LISTS:
                at = c.pos
                _skip_scalar(c)
                if field == b"cache_salt":
                    salt = c.data[at : c.pos]
                continue
            if span is not None:
                return None  # a second token list
            at = c.pos
            tokens = _read_tokens(c, field, max_tokens)
            span = (at, c.pos)
        if span is None or c.pos != len(c.data):
            return None
    except _Decline:
        return None
    encoded = c.data[span[0] : span[1]]
    rest = c.data[: span[0]] + b"\xc0" + c.data[span[1] :]
    if (salt, encoded) in kept:
        return rest, kept.index((salt, encoded)), None, None
    return rest, tokens, encoded, salt
