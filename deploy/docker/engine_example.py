"""An inference engine's side of mpcache, in a container of its own: ``python3 engine_example.py [ROUNDS]``.

It runs in another PID namespace than mpcache, shares mpcache's IPC namespace and the socket volume
(``/run/mpcache``), and runs as mpcache's uid.  With mpcache's own client it registers a KV buffer (a
sealed memfd, passed over the socket: no name in ``/dev/shm``, no pid to match), and per round trip
stores random blocks, prefetches them and retrieves them into other blocks, which must hold the same
bytes.  It prints one JSON line per cache process, then (``--hold``) waits for a line on stdin.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
import sys

import numpy as np

from mpcache.client import CacheClient

BLOCK_BYTES = 64 * 1024  # the default --chunk-bytes


def round_trips(socket_path: str, rounds: int) -> dict:
    verified = 0
    with CacheClient(socket_path) as client:
        server = client.ping()
        kv = client.register_buffer(4, BLOCK_BYTES)
        for round_index in range(rounds):
            kv.blocks[:2] = np.frombuffer(secrets.token_bytes(2 * BLOCK_BYTES), np.uint8).reshape(2, BLOCK_BYTES)
            sent = [hashlib.sha256(kv.blocks[i].tobytes()).hexdigest() for i in range(2)]
            kv.blocks[2:] = 0
            hashes = [secrets.randbits(63) for _ in range(2)]
            request = f"engine-{os.getpid()}-{round_index}"
            stored = client.store(kv, request_id=request, model_name="example/model", chunk_hashes=hashes,
                                  block_ids=[0, 1]).stored
            job = client.lookup_prefetch(request_id=request, model_name="example/model", chunk_hashes=hashes)
            found = client.wait_prefetch(job).found_count
            retrieved = client.retrieve(kv, request_id=request, job_id=job, block_ids=[2, 3]).retrieved
            received = [hashlib.sha256(kv.blocks[i].tobytes()).hexdigest() for i in (2, 3)]
            client.end_session(request)
            verified += (stored, found, retrieved, received) == (2, 2, 2, sent)
        client.unregister_buffer(kv)
    return {"socket": socket_path, "server_pid": server.pid, "rounds": rounds, "verified": verified}


def main(argv: list[str]) -> int:
    hold = "--hold" in argv
    words = [word for word in argv if word != "--hold"]
    rounds = int(words[0]) if words else 10
    identity = {"pid": os.getpid(), "pid_namespace": os.readlink("/proc/self/ns/pid"),
                "ipc_namespace": os.readlink("/proc/self/ns/ipc"), "uid": os.getuid()}
    sockets = sorted(glob.glob(os.path.join(os.environ.get("MPCACHE_RUNTIME_DIR", "/run/mpcache/service"),
                                            "cache*.sock")))
    if not sockets:
        print(json.dumps({**identity, "error": "no cache<i>.sock: is the mpcache-run volume mounted?"}), flush=True)
        return 1
    results = [round_trips(path, rounds) for path in sockets]
    print(json.dumps({**identity, "results": results}), flush=True)
    if hold:
        sys.stdin.readline()
    return 0 if all(result["verified"] == rounds for result in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
