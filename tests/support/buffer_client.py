"""A client process for the client-buffer tests: ``python buffer_client.py MODE SOCKET`` prints one JSON line.

* ``round_trip``: register a buffer, store 2 random chunks, prefetch and retrieve them into other blocks;
  prints this process's pid (1 as PID 1 of a new PID namespace), the counts and whether the bytes match.
* ``hold``: register a buffer and store one chunk, print the pid and the buffer's name, then wait for a
  line on stdin (the test kills it meanwhile).
"""

from __future__ import annotations

import json
import os
import secrets
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from mpcache.client import CacheClient  # noqa: E402

CHUNK = 4096


def round_trip(client: CacheClient) -> dict:
    kv = client.register_buffer(4, CHUNK)
    kv.blocks[:2] = np.random.default_rng().integers(0, 256, (2, CHUNK))
    hashes = [secrets.randbits(63) for _ in range(2)]
    stored = client.store(kv, request_id="w", model_name="org/m", chunk_hashes=hashes, block_ids=[0, 1]).stored
    job = client.lookup_prefetch(request_id="r", model_name="org/m", chunk_hashes=hashes)
    found = client.wait_prefetch(job).found_count
    retrieved = client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3]).retrieved
    equal = bool(np.array_equal(kv.blocks[:2], kv.blocks[2:]))
    return {"pid": os.getpid(), "stored": stored, "found": found, "retrieved": retrieved, "equal": equal}


def hold(client: CacheClient) -> dict:
    kv = client.register_buffer(2, CHUNK)
    kv.blocks[0] = 7
    stored = client.store(kv, request_id="w", model_name="org/m", chunk_hashes=[secrets.randbits(63)],
                          block_ids=[0]).stored
    print(json.dumps({"pid": os.getpid(), "name": kv.name, "stored": stored}), flush=True)
    sys.stdin.readline()
    return {}


def main() -> int:
    mode, socket_path = sys.argv[1], sys.argv[2]
    with CacheClient(socket_path) as client:
        result = {"round_trip": round_trip, "hold": hold}[mode](client)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
