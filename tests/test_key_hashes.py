"""Reference values of the stable hashes clients and files depend on.

``chunk_hashes`` is a client contract: an engine computes the keys it stores and looks up with it, and
the fs tier names its files after them, so the files written before a restart (or an upgrade) are found
only if every input still maps to the same hash.  ``token_hash`` (the L0 block contents, see
:mod:`mpcache.cache.l0`) and ``block_sample_hash`` (which blocks are tracked) must agree across
processes and restarts in the same way.

Each value is checked twice: against a re-implementation of the documented algorithm written here with
``hashlib`` and ``struct`` only (no numpy, none of mpcache's code), and against literal constants.  The
constants were produced once by that re-implementation (``_reference_chunk_hashes`` /
``_reference_token_hash`` / ``_reference_block_hash`` below, run on the inputs next to them) and pinned, so a
change to the algorithm that were mirrored in the reference would still fail here.
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np
import pytest

from mpcache.cache.l0 import block_sample_hash
from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.contract.keys import ChunkKey, chunk_hashes, token_hash


def _reference_chunk_hashes(tokens: list[int], chunk_size: int) -> list[int]:
    """keys.py's documented algorithm: chunk i's hash is blake2b with an 8-byte digest of (the previous
    chunk's 8 digest bytes, eight zero bytes for the first chunk) followed by the chunk's token ids as
    little-endian int64; the hash is the digest read as a little-endian u64; a trailing partial chunk is
    not hashed."""
    out, previous = [], bytes(8)
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = struct.pack(f"<{chunk_size}q", *tokens[start:start + chunk_size])
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        out.append(int.from_bytes(previous, "little"))
    return out


def _reference_token_hash(tokens: list[int]) -> int:
    """blake2b-64 of the token ids as little-endian int64, read as a little-endian u64."""
    return int.from_bytes(hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=8).digest(), "little")


def _reference_block_hash(instance_id: int, block_id: int) -> int:
    """blake2b-64 of (instance_id, block_id) as two little-endian int64, read as a little-endian u64."""
    return int.from_bytes(hashlib.blake2b(struct.pack("<qq", instance_id, block_id), digest_size=8).digest(), "little")


# (tokens, chunk_size, pinned hashes)
CHUNK_CASES = [
    (list(range(10)), 4, [0x1DB849935BDC7198, 0xD56787C52612DAEC]),  # the trailing 2 tokens are not hashed
    (list(range(512)), 256, [0x3FD54A80F9770E2F, 0x00A6A85C185407C2]),  # the default chunk size
    ([-1, 2**63 - 1, -2**63, 0], 2, [0xD333044D4AE24F41, 0x5C399E20ACD1152E]),  # int64 extremes
]

# (tokens, pinned hash)
TOKEN_CASES = [
    ([], 0xB4B2797457A0A6E4),
    ([1, 2, 3], 0xB4FB5A8DE61ABA77),
    ([-1, 2**63 - 1], 0x6BE8B0A7EE473F98),
]


@pytest.mark.parametrize("tokens, chunk_size, pinned", CHUNK_CASES)
def test_chunk_hashes_match_the_documented_algorithm_and_pinned_values(tokens, chunk_size, pinned):
    """Lists, int64 and int32 numpy arrays (what engines hand over) give the pinned prefix-chained hashes."""
    assert pinned == _reference_chunk_hashes(tokens, chunk_size)
    assert pinned == chunk_hashes(tokens, chunk_size)
    assert pinned == chunk_hashes(np.array(tokens, dtype=np.int64), chunk_size)
    if all(-2**31 <= t < 2**31 for t in tokens):
        assert pinned == chunk_hashes(np.array(tokens, dtype=np.int32), chunk_size)


def test_chunk_hashes_are_prefix_chained_and_skip_partial_chunks():
    """Equal first chunks after different earlier chunks hash differently (the chain), a shorter input
    yields a prefix of the longer one's hashes, and fewer tokens than a chunk yield none."""
    a = chunk_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = chunk_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert chunk_hashes(list(range(512)), 256)[:1] == chunk_hashes(list(range(300)), 256)
    assert [] == chunk_hashes([1, 2, 3], 4)


@pytest.mark.parametrize("tokens, pinned", TOKEN_CASES)
def test_token_hash_matches_the_documented_algorithm_and_pinned_values(tokens, pinned):
    assert pinned == _reference_token_hash(tokens)
    assert pinned == token_hash(tokens)
    assert pinned == token_hash(iter(tokens))  # any iterable of ints


def test_block_sample_hash_is_pinned():
    """The L0 sampling key of block 42 of instance 7 (what decides, in every process, whether it is tracked)."""
    assert 0x5B201EEA7A8D028C == _reference_block_hash(7, 42) == block_sample_hash(7, 42)


def test_fs_tier_file_name_of_a_key_is_pinned(tmp_path):
    """The fs tier's file for ("org/model", "tenant-a", chunk_hashes(range(512), 256)[1]):
    ``<dir>/<ns>/<hh>/<chunk hash as 16 hex digits>.chunk`` where ``ns`` is blake2b-64 (hex) of
    struct ``<HHQ`` (len(model), len(salt), 0) + model + salt — ff3137f0f8a1442e for this pair."""
    namespace = hashlib.blake2b(struct.pack("<HHQ", 9, 8, 0) + b"org/model" + b"tenant-a", digest_size=8).hexdigest()
    assert "ff3137f0f8a1442e" == namespace
    adapter = FsL2Adapter(str(tmp_path), 1 << 20, threads=1, mac_key=bytes(32))
    try:
        key = ChunkKey("org/model", "tenant-a", chunk_hashes(list(range(512)), 256)[1])
        expected = os.path.join(str(tmp_path), "ff3137f0f8a1442e", "00", "00a6a85c185407c2.chunk")
        assert expected == adapter.file_path(key)
    finally:
        adapter.close()
