"""One engine request against an :class:`~mpcache.cache.l1.L1Manager`, as LMCache's front end drives it."""

from __future__ import annotations

from mpcache.cache.l1 import L1Manager


def engine_request(l1: L1Manager, group: tuple[str, str], hashes: list[int]) -> int:
    """Look up ``hashes`` for ``group`` (a model and cache salt; the prefix found read-locked), store the rest
    (64-byte objects), release; returns the chunks found."""
    return engine_request_outcome(l1, group, hashes)[0]


def engine_request_outcome(l1: L1Manager, group: tuple[str, str], hashes: list[int]) -> tuple[int, int]:
    """:func:`engine_request`, returning the chunks found and the chunks its store got no space for."""
    found = l1.lock_prefix(*group, hashes, publish=False)
    reservation = l1.reserve_write(*group, hashes[found:])
    l1.commit_write(*group, [hashes[found + position] for position in reservation.positions], 64)
    l1.release_read(*group, hashes[:found])
    return found, reservation.failed
