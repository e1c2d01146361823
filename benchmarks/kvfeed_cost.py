"""``python -m benchmarks.kvfeed_cost``: what the KV event feed (``--kv-event-log-size``) costs the cache
process per chunk, counted: instructions under callgrind of LMCache stores into a full L1 (each store of
``BATCH`` fresh chunks evicts as many), with the feed on and off, the ring publisher publishing in both.

Only the stores after L1 and the log are full are counted, as the log runs once its first ``LOG_RECORDS``
records are in (while it grows, what it keeps makes the garbage collector run: a cost paid once); callgrind
collects inside the ``functools.reduce`` that runs them, with ``PYTHONHASHSEED`` fixed, so the counts repeat
exactly.  The stores go the way an LMCache ``store``
goes once its objects are copied: the feed's details taken (:func:`~mpcache.cache.lmcache.kvevents.feed_of`,
:func:`~mpcache.cache.lmcache.kvevents.details`), then :meth:`~mpcache.cache.l1.L1Manager.commit_write`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

BATCH = 16  # chunks per store (4096 tokens at LMCache's 256 per chunk)
STORES = 500
CHUNK_TOKENS = 256
SLOTS = 256  # L1 objects: full after the first 16 stores
CHUNK_BYTES = 4096
LOG_RECORDS = 32768  # --kv-event-log-size's default


def workload(stores: int, feed: bool) -> None:
    """``stores`` stores of ``BATCH`` fresh chunks each into a full L1 (with the feed on or off)."""
    from mpcache.cache.kvlog import KVEventLog
    from mpcache.cache.l1 import L1Manager
    from mpcache.cache.lmcache import kvevents
    from mpcache.shm import layout
    from mpcache.shm.intern import Interner
    from mpcache.shm.publish import Publisher
    from mpcache.shm.ring import RingWriter, format_event_segment
    from mpcache.shm.segment import Segment, shm_name

    capacity = 1 << 16  # nobody reads it: once full, its appends count drops (on both sides alike)
    name = shm_name(os.getpid(), "kvcost", "bench")
    segment = Segment.create(name, layout.event_segment_size(capacity, 64))
    try:
        format_event_segment(segment, capacity, 64)
        publisher = Publisher(RingWriter(segment), Interner(segment.buf, 64))
        l1 = L1Manager(np.zeros(SLOTS * CHUNK_BYTES, dtype=np.uint8), publisher, 0.01, CHUNK_BYTES)
        l1.feed = KVEventLog(LOG_RECORDS) if feed else None
        tokens = np.arange(BATCH * CHUNK_TOKENS, dtype="<i8").tobytes()
        key = SimpleNamespace(tokens=tokens, worker_id=0)
        chunks, group_ids = list(range(BATCH)), [0] * BATCH

        def store(_: None, number: int) -> None:
            hashes = [number * BATCH + chunk for chunk in range(BATCH)]
            reservation = l1.reserve_write("m", "", hashes)
            committed = [hashes[p] for p in reservation.positions]
            detail = None
            if l1.feed is not None:
                taken = kvevents.feed_of(key, CHUNK_TOKENS, 0, hashes, chunks, group_ids, 1, lambda *_: [])
                detail = kvevents.details(taken, [(len(committed), CHUNK_BYTES)])[0]
            l1.commit_write("m", "", committed, CHUNK_BYTES, detail)

        fill = LOG_RECORDS // (2 * BATCH) + 1  # a store adds BATCH stored and BATCH removed records
        for number in range(fill):  # not counted: L1 and the log fill, then every store evicts and overwrites
            store(None, number)
        functools.reduce(store, range(fill, fill + stores), None)  # counted (callgrind collects inside reduce)
    finally:
        segment.close()
        Segment.unlink(name)


def _instructions(stores: int, feed: bool, out_dir: str) -> int:
    from benchmarks.isolation import read_summary

    out = os.path.join(out_dir, f"callgrind.{stores}.{int(feed)}")
    program = "benchmarks.kvfeed_cost"
    subprocess.run(["valgrind", "--tool=callgrind", "--quiet", "--toggle-collect=functools_reduce",
                    f"--callgrind-out-file={out}", sys.executable, "-m", program, "--run", str(stores),
                    *(["--feed"] if feed else [])],
                   check=True, timeout=1800, env={**os.environ, "PYTHONHASHSEED": "0"})  # the same dict layouts
    return read_summary(out)["Ir"]


def measure(stores: int = STORES) -> dict[str, object]:
    """Instructions per stored chunk with the feed off and on, and the feed's own (on minus off)."""
    with tempfile.TemporaryDirectory(prefix="mpc-kvcost-") as tmp:
        per_chunk = {side: round(_instructions(stores, side == "on", tmp) / (stores * BATCH)) for side in ("off", "on")}
    per_chunk["feed"] = per_chunk["on"] - per_chunk["off"]
    return {"batch": BATCH, "stores": stores, "instructions_per_chunk": per_chunk}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kvfeed_cost", description=__doc__)
    parser.add_argument("--stores", type=int, default=STORES)
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the counted child
    parser.add_argument("--feed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run is not None:
        workload(args.run, args.feed)
        return 0
    print(json.dumps(measure(args.stores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
