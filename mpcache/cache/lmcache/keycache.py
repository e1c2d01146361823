"""The repeated token list of LMCache's key path, kept in one place.

LMCache sends a request's whole token list in the key of every operation (its lookup, each rank's prepare and
commit of store and retrieve, free_lookup_locks), in frames that otherwise differ a little or not at all; about
half repeat an earlier frame byte for byte.  A :class:`KeyCache` keeps, per request, what its token list gave: the
int64 tokens, the keys parsed from the frames that carried it (found by the rest of the frame), and its chunk
hashes and each rank layout's L1 keys, each computed once.  The compiled scanner (:mod:`.keyscan`) keeps nothing:
it is handed the encodings of the ``CANDIDATES`` most recently used token lists with their salts and says which
one a frame repeats (one ``memcmp`` instead of a read per token).

Within a tenant: a token list, and whatever came of it, is reused only for a frame with the same ``cache_salt``
(the scanner compares its encoding, a request's entry its value), so how fast a frame is read tells a client
nothing about another salt's prompts.  Reuse needs byte-equal tokens, so it gives exactly what parsing and hashing
would.

One bound: what is kept is charged in bytes (the tokens and their encoding, ``INT_BYTES`` per hash, key or rank,
``LAYOUT_BYTES`` per layout, ``KEY_BYTES`` and the frame's rest per parsed key, ``ENTRY_BYTES`` per request) and
held to ``MAX_BYTES``, the least recently used request out first; what would take one request past it is computed
and not kept.  A request's entry goes with its end_session.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from mpcache.cache.lmcache import keyscan, wire
from mpcache.cache.lmcache.groups import group_keys
from mpcache.contract.keys import chunk_hashes, rank_hashes

MAX_BYTES = 64 << 20
CANDIDATES = 4  # token lists the scanner compares a frame's against: the most recently used
ENTRY_BYTES = 1024  # a request's entry: its objects and its places in the indexes
INT_BYTES = 40  # a 64-bit Python int in a list
KEY_BYTES = 512  # a parsed Key and its strings, besides the frame's rest
LAYOUT_BYTES = 256  # a layout's place in its entry: the dict slot, its key tuple and ranks tuple, the list

Layout = tuple[int, tuple[int, ...], int]  # (world size, ranks, KV cache groups)


class _TokenList:
    """One request's token list and what came of it."""

    __slots__ = ("request_id", "scope", "cache_salt", "tokens", "kept", "hashes", "ranked", "keys", "charge")

    def __init__(self, request_id: str, scope: str | None, cache_salt: str, tokens: bytes,
                 kept: tuple[bytes, bytes] | None) -> None:
        self.request_id = request_id
        self.scope = scope  # the prefix its keys' request ids were given; None: its keys are not kept
        self.cache_salt = cache_salt
        self.tokens = tokens
        self.kept = kept  # (salt, token list) as the scanner read them; None: parsed the ordinary way
        self.hashes: list[int] | None = None  # prefix-chained hashes of every whole chunk
        self.ranked: dict[Layout, list[int]] = {}  # every chunk's L1 keys under a layout
        self.keys: dict[bytes, wire.Key] = {}  # the rest of a frame that carried the list → its key
        self.charge = ENTRY_BYTES + len(tokens) + (len(kept[0]) + len(kept[1]) if kept else 0)


class KeyCache:
    """``key(frame, scope)``: the key a frame carries; ``chunk_keys(key, ranks, first, last, groups)``: its L1 keys;
    both through the request's one entry (see the module's docstring)."""

    def __init__(self, max_tokens: int, chunk_tokens: int, max_bytes: int = MAX_BYTES) -> None:
        self.max_tokens = max_tokens
        self.chunk_tokens = chunk_tokens
        self.max_bytes = max_bytes
        self.bytes_kept = 0
        self._decode = wire.Decoder(max_tokens)
        self._entries: OrderedDict[str, _TokenList] = OrderedDict()  # by request id, least recently used first
        self._candidates: list[_TokenList] = []  # the scanner's kept pairs' entries, most recent first
        self._kept: keyscan.Kept = ()
        self._newest: _TokenList | None = None

    def key(self, frame: bytes, scope: str = "") -> wire.Key:
        """The frame's key (ProtocolError names what is wrong), its request id prefixed with ``scope``."""
        split = keyscan.split_key(frame, self.max_tokens, self._kept) if keyscan.split_key is not None else None
        if split is None:  # off the regular case, or no compiled scanner: the ordinary way, nothing parsed kept
            key = _scoped(wire.parse_key(self._decode(frame), self.max_tokens), scope)
            self._entry(key, None, scope)
            return key
        rest, found, encoded, salt = split
        hit = None
        if type(found) is int:
            hit = self._candidates[found]
            if hit.scope == scope:
                known = hit.keys.get(rest)
                if known is not None:
                    if self._newest is not hit or self._candidates[0] is not hit:
                        self._touch(hit)
                    return known
            tokens, kept = hit.tokens, hit.kept
        else:
            assert isinstance(found, bytes) and encoded is not None and salt is not None
            tokens, kept = found, (salt, encoded)
        key = _scoped(wire.key_from_map(self._decode(rest), tokens), scope)
        if hit is not None and hit.request_id == key.request_id:  # the request's own list, under its salt
            entry: _TokenList | None = hit
            self._touch(hit)
        else:
            entry = self._entry(key, kept, scope)
        if entry is not None and entry.scope == scope and self._grow(entry, KEY_BYTES + len(rest)):
            entry.keys[rest] = key
        return key

    def chunk_keys(self, key: wire.Key, ranks: tuple[int, ...], first: int, last: int, groups: int = 1) -> list[int]:
        """The L1 keys of chunks ``[first, last)`` for each of ``groups`` KV cache groups and each of ``ranks``,
        chunk-major and rank-minor (:func:`~mpcache.contract.keys.rank_hashes`, then :func:`.groups.group_keys`)."""
        entry, hashes = self._hashes(key)
        layout = (key.world_size, ranks, groups)
        ranked = None if entry is None else entry.ranked.get(layout)
        if ranked is None:
            ranked = rank_hashes(hashes, key.world_size, ranks)
            if groups > 1:
                ranked = group_keys(ranked, len(ranks), groups)
            if entry is not None and self._grow(entry, LAYOUT_BYTES + INT_BYTES * (len(ranked) + len(ranks))):
                entry.ranked[layout] = ranked
        per = len(ranks) * groups
        return ranked[first * per : last * per]

    def prefix_hash(self, key: wire.Key, last: int) -> int:
        """The hash of the key's first ``last`` chunks, as many as its tokens hold (of its tokens alone: the same
        for every rank and group), 0 for none."""
        hashes = self._hashes(key)[1]
        return hashes[min(last, len(hashes)) - 1] if last > 0 and hashes else 0

    def _hashes(self, key: wire.Key) -> tuple[_TokenList | None, list[int]]:
        """The key's request's entry (None: past the bound) and its chunks' prefix-chained hashes, computed once."""
        entry = self._newest  # the key's, most often: key() has just given it
        if (entry is None or entry.tokens is not key.tokens or entry.request_id != key.request_id
                or entry.cache_salt != key.cache_salt):
            entry = self._entry(key, None, None)
        hashes = None if entry is None else entry.hashes
        if hashes is None:
            hashes = chunk_hashes(np.frombuffer(key.tokens, dtype="<i8"), self.chunk_tokens)
            if entry is not None and self._grow(entry, INT_BYTES * len(hashes)):
                entry.hashes = hashes
        return entry, hashes

    def forget(self, request_id: str) -> None:
        """A request's end_session: its entry goes."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._drop(entry)

    def rechunk(self, chunk_tokens: int) -> None:
        """Another chunk size (LMCache 0.5.7's negotiation): every hash changes, so nothing kept stays."""
        self.chunk_tokens = chunk_tokens
        for entry in list(self._entries.values()):
            self._drop(entry)

    def __len__(self) -> int:
        return len(self._entries)

    # -- the one store ------------------------------------------------------------------------

    def _entry(self, key: wire.Key, kept: tuple[bytes, bytes] | None, scope: str | None) -> _TokenList | None:
        """The key's request's entry, made anew unless it holds this salt's same tokens; None where one request's
        list alone is past the bound."""
        entry = self._entries.get(key.request_id)
        if entry is not None and entry.cache_salt == key.cache_salt and entry.tokens == key.tokens:
            self._touch(entry)
            if entry.scope is None:
                entry.scope = scope
            if kept is not None and entry.kept != kept:  # first read by the scanner, or spelled another way
                before = len(entry.kept[0]) + len(entry.kept[1]) if entry.kept else 0
                if self._grow(entry, len(kept[0]) + len(kept[1]) - before):
                    self._unlist(entry)
                    entry.kept = kept
                    self._touch(entry)
            return entry
        if entry is not None:
            self._drop(entry)
        entry = _TokenList(key.request_id, scope, key.cache_salt, key.tokens, kept)
        if entry.charge > self.max_bytes:
            return None
        self._entries[key.request_id] = entry
        self.bytes_kept += entry.charge
        self._touch(entry)
        self._trim()
        return entry

    def _touch(self, entry: _TokenList) -> None:
        """Most recently used: last to go, and first of the scanner's candidates."""
        if self._newest is not entry:
            self._newest = entry
            self._entries.move_to_end(entry.request_id)
        if entry.kept is not None and (not self._candidates or self._candidates[0] is not entry):
            if entry in self._candidates:
                self._candidates.remove(entry)
            self._candidates.insert(0, entry)
            del self._candidates[CANDIDATES:]
            self._relist()

    def _unlist(self, entry: _TokenList) -> None:
        if entry in self._candidates:
            self._candidates.remove(entry)
            self._relist()

    def _relist(self) -> None:
        """The scanner's argument: each candidate's (salt, token list), in the candidates' order."""
        self._kept = tuple(candidate.kept for candidate in self._candidates if candidate.kept is not None)
        assert len(self._kept) == len(self._candidates)  # only entries the scanner read are candidates

    def _grow(self, entry: _TokenList, size: int) -> bool:
        """Charge ``size`` more bytes to ``entry`` (the most recently used), older entries out to make room;
        False, charging nothing, where it would take the entry alone past the bound."""
        if entry.charge + size > self.max_bytes:
            return False
        entry.charge += size
        self.bytes_kept += size
        if self.bytes_kept > self.max_bytes:
            self._trim()
        return True

    def _trim(self) -> None:
        while self.bytes_kept > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: _TokenList) -> None:
        del self._entries[entry.request_id]
        self.bytes_kept -= entry.charge
        if self._newest is entry:
            self._newest = None
        self._unlist(entry)


def _scoped(key: wire.Key, scope: str) -> wire.Key:
    return dataclasses.replace(key, request_id=scope + key.request_id) if scope else key
