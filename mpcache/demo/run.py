"""``--demo``: engines' requests (lookup+prefetch, retrieve, store, end) over tenants and Zipf-popular
documents, with a fault mix; every chunk is verified and the tally is what tests compare with ``/metrics``.

A cache process killed under the demo costs it the request in flight (its client reconnects and
raises :class:`~mpcache.client.CacheConnectionLost`): the tally counts only what replies confirmed, and
what the lost operation may have added to ``/metrics`` goes to ``in_doubt`` (see :class:`Tally`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import threading
import time

import numpy as np

from mpcache.client import CacheClient, CacheConnectionLost
from mpcache.config import Config
from mpcache.contract.keys import chunk_hashes
from mpcache.demo.chunks import chunk_matches, fill_chunk
from mpcache.demo.rag import RAG_EVERY, RagWorkload
from mpcache.demo.scheduler import SchedulerFleet
from mpcache.logs import configure_logging
from mpcache.shm import layout
from mpcache.shm.ring_reader import read_counters
from mpcache.shm.segment import Segment

TENANTS = ("tenant-a", "tenant-b", "tenant-c")
MODELS = ("llama-3-8b", "qwen-2-7b")
DOCUMENTS = 48
ZIPF_EXPONENT = 1.3
PROGRESS_INTERVAL_S = 5.0
# The fault mix runs on a clock, not a request count, so a slow machine sees it too.
BIG_STORE_EVERY_S = 4.0  # a store larger than L1
TIMEOUT_EVERY_S = 2.0  # a retrieve with an impossible deadline
LATE_CLIENT_EVERY_S = 3.0  # a prefetch whose client comes back only after it expired
PER_SALT = ("l1_write", "num_chunks_loaded", "lookup_requested", "lookup_hit")  # in_doubt counters kept per salt
INJECTED_FAULTS = {
    "store_larger_than_l1": f"every {BIG_STORE_EVERY_S:g} s a store larger than L1 (L1 allocation failures)",
    "retrieve_timeout": f"every {TIMEOUT_EVERY_S:g} s a retrieve with a 1 ns deadline (timeouts)",
    "late_retrieve": f"every {LATE_CLIENT_EVERY_S:g} s a retrieve after its prefetch expired (L1 read failures)",
    "cb_*": "RAG blend stores and retrieves into a missing buffer or with too few blocks (blend failures)",
}


class Tally:
    """What the demo itself saw, per cache_salt, to compare with the metrics.

    Only what a reply confirmed is counted.  An operation lost with its cache process (the reply never
    came) may still have been counted by ``/metrics`` — the dead process published its events first —
    so its most is added to ``in_doubt``, per compared counter: a store, its chunks as L1 writes and as
    allocation failures; a retrieve, its chunks as loaded and as read failures; a lookup, its tokens as
    requested and as hits (and with L2, its chunks as L1 writes); the timeout fault, one timeout.
    ``/metrics`` then lies between the tally and the tally plus ``in_doubt`` (equal to the tally when
    nothing was lost).  ``lost_operations`` counts the lost operations by name.  The cache-blending
    counters have no such bound: a lost ``cb_*`` operation may or may not be in them.
    """

    def __init__(self) -> None:
        self.stored: collections.Counter[str] = collections.Counter()
        self.retrieved: collections.Counter[str] = collections.Counter()
        self.requested_tokens: collections.Counter[str] = collections.Counter()
        self.hit_tokens: collections.Counter[str] = collections.Counter()
        self.l2_hit_tokens: collections.Counter[str] = collections.Counter()
        # chunks prefetches wrote into L1 from L2 (L1 writes, too)
        self.prefetched: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.expected_faults: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()  # faults the demo caused on purpose
        self.verified_chunks = 0
        # the RAG load's cache-blending counts (mpcache.demo.rag)
        self.blend: collections.Counter[str] = collections.Counter()
        self.in_doubt: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.lost_operations: collections.Counter[str] = collections.Counter()

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "stored_chunks": dict(self.stored),
            "retrieved_chunks": dict(self.retrieved),
            "requested_tokens": dict(self.requested_tokens),
            "hit_tokens": dict(self.hit_tokens),
            "l2_hit_tokens": dict(self.l2_hit_tokens),
            "prefetched_chunks": dict(self.prefetched),
            "expected_faults": dict(self.expected_faults),
            "injected_faults": dict(self.injected),
            "verified_chunks": self.verified_chunks,
            "blend": dict(self.blend),
            "in_doubt": {counter: dict(by_salt) for counter, by_salt in self.in_doubt.items() if by_salt},
            "lost_operations": dict(self.lost_operations),
        }


class Workload:
    def __init__(self, config: Config, seed: int = 7) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)
        chunk = config.chunk_size_tokens
        self.system_prompts = {m: self.rng.integers(0, 32000, size=2 * chunk) for m in MODELS}
        self.documents = [self.rng.integers(0, 32000, size=int(self.rng.integers(4, 12)) * chunk)
                          for _ in range(DOCUMENTS)]

    def next_prompt(self) -> tuple[str, str, np.ndarray]:
        tenant = TENANTS[int(self.rng.integers(len(TENANTS)))]
        model = MODELS[int(self.rng.integers(len(MODELS)))]
        doc = min(int(self.rng.zipf(ZIPF_EXPONENT)) - 1, DOCUMENTS - 1)
        question = self.rng.integers(0, 32000, size=int(self.rng.integers(1, 3)) * self.config.chunk_size_tokens)
        return tenant, model, np.concatenate((self.system_prompts[model], self.documents[doc], question))


class Demo:
    def __init__(self, config: Config, log) -> None:
        self.config = config
        self.log = log
        self.workload = Workload(config)
        self.tally = Tally()
        self.clients = [CacheClient(config.socket_path(w)) for w in range(config.workers)]
        self.max_chunks = 20
        self.buffers = [c.register_buffer(self.max_chunks, config.chunk_bytes) for c in self.clients]
        # engine schedulers reporting their GPU KV block allocations (L0 lifecycle histograms)
        self.l0 = SchedulerFleet(self.clients, MODELS, max(1, config.chunk_size_tokens // 4))
        self.rings = [Segment.attach(config.ring_name(w), layout.HEADER_SIZE) for w in range(config.workers)]
        self.stop = threading.Event()
        # (worker, request_id, job, found, tenant, model, time, client generation): prefetches left to expire
        self.late: list[tuple] = []
        self.rag = RagWorkload(config, self.clients, self.buffers, self.tally)  # cache blending (mpcache.demo.rag)
        self.rag.doubt = self._doubt
        self._pending: tuple[str, dict[str, int]] = ("", {})  # the operation in flight: (cache_salt, bounds)
        first = time.monotonic() + 1.0
        self.due = {"big_store": first, "timeout": first, "late_client": first}

    def run(self, seconds: float) -> int:
        started = last_report = time.monotonic()
        last_requests, last_events = 0, self._events_published()
        while not self.stop.is_set() and (not seconds or time.monotonic() - started < seconds):
            try:
                self.one_request()
            except CacheConnectionLost as exc:  # its cache process died or restarted: abandon the request
                self._connection_lost(exc)
            now = time.monotonic()
            if now - last_report >= PROGRESS_INTERVAL_S:
                events = self._events_published()
                self._progress(now - started, (self.tally.requests - last_requests) / (now - last_report),
                               (events - last_events) / (now - last_report))
                last_report, last_requests, last_events = now, self.tally.requests, events
        return 0

    def _doubt(self, salt: str = "", **bounds: int) -> None:
        """Before each operation: the most it can add to each compared counter beyond what the tally will
        count from its reply (``salt``: the cache_salt of per-salt counters)."""
        self._pending = (salt, bounds)

    def _connection_lost(self, exc: CacheConnectionLost) -> None:
        salt, bounds = self._pending
        for counter, most in bounds.items():
            if most:
                self.tally.in_doubt[counter][salt if counter in PER_SALT else ""] += most
        self.tally.lost_operations[exc.op] += 1
        self._pending = ("", {})
        # prefetch jobs left for later on a process that is gone: the new one never heard of them
        self.late = [entry for entry in self.late if self.clients[entry[0]].generation == entry[-1]]
        self.log.warning("demo.connection_lost", op=exc.op, reconnected=exc.reconnected, error=str(exc))

    def one_request(self) -> None:
        tally = self.tally
        tally.requests += 1
        n = tally.requests
        worker = n % len(self.clients)
        client, buffer = self.clients[worker], self.buffers[worker]
        tenant, model, tokens = self.workload.next_prompt()
        if n % RAG_EVERY == 0:  # a RAG request that blends document chunks (mpcache.demo.rag)
            self.rag.one_request(worker, tenant, model)
        hashes = chunk_hashes(tokens, self.config.chunk_size_tokens)[: self.max_chunks]
        request_id = f"req-{os.getpid()}-{n}"
        self._doubt()
        self.l0.step(worker, model, tokens)  # the engine schedules it: its L0 blocks (mpcache.demo.scheduler)
        tokens_asked = len(hashes) * self.config.chunk_size_tokens
        self._doubt(tenant, lookup_requested=tokens_asked, lookup_hit=tokens_asked,
                    l1_write=len(hashes) if self.config.l2 else 0)
        job = client.lookup_prefetch(request_id=request_id, model_name=model, cache_salt=tenant, chunk_hashes=hashes)
        status = client.wait_prefetch(job)  # with L2, the job may need a moment to load chunks into L1
        found = status.found_count
        tally.requested_tokens[tenant] += len(hashes) * self.config.chunk_size_tokens
        tally.hit_tokens[tenant] += found * self.config.chunk_size_tokens
        tally.l2_hit_tokens[tenant] += status.l2_hit_tokens
        tally.prefetched[tenant] += status.l2_loaded_count
        if found and self._due("late_client", LATE_CLIENT_EVERY_S):
            self.late.append((worker, request_id, job, found, tenant, model, time.monotonic(), client.generation))
            return  # this client goes quiet; _late_retrieve comes back for it
        if found:
            if self._due("timeout", TIMEOUT_EVERY_S):
                self._doubt(tenant, timeouts=1)
                self._timeout_fault(client, buffer, request_id, job, found)
            else:
                self._doubt(tenant, num_chunks_loaded=found, l1_read_failure=found)
                got = client.retrieve(buffer, request_id=request_id, job_id=job, block_ids=range(found)).retrieved
                tally.retrieved[tenant] += got
                self._verify(buffer, hashes[:got])
        missing = hashes[found:]
        if missing:
            block_ids = list(range(found, found + len(missing)))
            for block_id, chunk_hash in zip(block_ids, missing):
                fill_chunk(buffer.blocks[block_id], chunk_hash)
            self._doubt(tenant, l1_write=len(missing), l1_allocation_failure=len(missing))
            result = client.store(buffer, request_id=request_id, model_name=model, cache_salt=tenant,
                                  chunk_hashes=missing, block_ids=block_ids)
            tally.stored[tenant] += result.stored
            # a full L1, or the eviction order refusing chunks seen once, fails them: the client is told
            tally.expected_faults["l1_allocation_failed_chunks"] += result.failed
        self._doubt()
        client.end_session(request_id)
        if self._due("big_store", BIG_STORE_EVERY_S):
            self._big_store_fault(client, worker, tenant, model)
        if self.late and time.monotonic() - self.late[0][-2] > self.config.prefetch_job_ttl_s + 0.5:
            self._late_retrieve(*self.late.pop(0)[:-2])

    def _due(self, fault: str, every_s: float) -> bool:
        """True (and rescheduled) when this fault's next turn has come."""
        now = time.monotonic()
        if now < self.due[fault]:
            return False
        self.due[fault] = now + every_s
        return True

    def _late_retrieve(self, worker: int, request_id: str, job, found: int, tenant: str, model: str) -> None:
        """Retrieve a prefetch after it expired, once a big store has evicted its chunks:
        what is gone is an L1 read failure (not_found), what is left is retrieved.  The big store is sent twice:
        the adaptive order refuses a store of chunks never seen whole where it would evict objects seen again,
        and admits the same store the second time."""
        client, buffer = self.clients[worker], self.buffers[worker]
        self._big_store_fault(client, worker, tenant, model, times=2)
        self.tally.injected["late_retrieve"] += 1
        self._doubt(tenant, num_chunks_loaded=found, l1_read_failure=found)
        got = client.retrieve(buffer, request_id=request_id, job_id=job, block_ids=range(found)).retrieved
        self.tally.retrieved[tenant] += got
        self.tally.expected_faults["l1_read_failed_chunks"] += found - got
        self._doubt()
        client.end_session(request_id)

    def _verify(self, buffer, hashes: list[int]) -> None:
        for block_id, chunk_hash in enumerate(hashes):
            if not chunk_matches(buffer.blocks[block_id][: self.config.chunk_bytes], chunk_hash):
                raise RuntimeError(f"retrieved chunk {chunk_hash:#x} does not match what was stored")
            self.tally.verified_chunks += 1

    def _timeout_fault(self, client, buffer, request_id: str, job, found: int) -> None:
        try:
            client.retrieve(buffer, request_id=request_id, job_id=job, block_ids=range(found), timeout_s=1e-9)
        except CacheConnectionLost:
            raise
        except Exception as exc:
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
            self.tally.expected_faults["timeout"] += 1
            self.tally.injected["retrieve_timeout"] += 1
        else:
            raise RuntimeError("a retrieve with a 1 ns deadline did not time out")

    def _big_store_fault(self, client, worker: int, tenant: str, model: str, times: int = 1) -> None:
        """A store of more chunks than L1 holds (the same one ``times`` times): the surplus must fail allocation."""
        n = self.config.l1_pool_bytes // self.config.chunk_bytes + 4
        self._doubt()
        with client.register_buffer(n, self.config.chunk_bytes) as big:
            hashes = [int(h) for h in self.workload.rng.integers(1, 2**62, size=n)]
            for attempt in range(times):
                self._doubt(tenant, l1_write=n, l1_allocation_failure=n)
                result = client.store(big, request_id=f"big-{os.getpid()}-{self.tally.requests}-{attempt}",
                                      model_name=model, cache_salt=tenant, chunk_hashes=hashes, block_ids=range(n))
                self._doubt()
                # counted before the buffer goes: losing the connection while unregistering it loses nothing
                self.tally.stored[tenant] += result.stored
                self.tally.expected_faults["l1_allocation_failed_chunks"] += result.failed
                self.tally.injected["store_larger_than_l1"] += 1

    def _events_published(self) -> int:
        return sum(read_counters(ring).head for ring in self.rings)

    def _dropped(self) -> int:
        return sum(c.dropped + c.torn + c.malformed for c in map(read_counters, self.rings))

    def _progress(self, elapsed: float, ops_per_s: float, cells_per_s: float) -> None:
        tally = self.tally
        requested = sum(tally.requested_tokens.values())
        hits = sum(tally.hit_tokens.values())
        hit_rate = hits / requested if requested else 0.0
        l2_share = sum(tally.l2_hit_tokens.values()) / hits if hits else 0.0
        l2_part = f" (L2 {l2_share:6.1%} of hits)" if self.config.l2 else ""
        dropped = self._dropped()
        faults = sum(tally.injected.values())
        print(f"[demo {elapsed:6.1f}s] {ops_per_s:7.1f} req/s | hit rate {hit_rate:6.1%}{l2_part} | "
              f"{cells_per_s:9,.0f} event cells/s | {dropped} dropped events | {faults} faults injected", flush=True)
        self.log.info("demo.progress", elapsed_s=round(elapsed, 1), requests_per_s=round(ops_per_s, 1),
                      hit_rate=round(hit_rate, 4), l2_hit_share=round(l2_share, 4),
                      event_cells_per_s=round(cells_per_s), dropped_events=dropped, faults_injected=faults)

    def close(self) -> None:
        try:
            self.l0.close()  # end the requests the schedulers still run
        except Exception:  # noqa: BLE001 - a cache process already gone must not stop the clean-up
            pass
        self.rag.close()
        for buffer in self.buffers:
            buffer.close()
        for client in self.clients:
            client.close()
        for ring in self.rings:
            ring.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache.demo")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    config = Config.load(args.config)
    log = configure_logging("demo", config.instance_id, config.log_level)
    demo = Demo(config, log)
    signal.signal(signal.SIGTERM, lambda *_: demo.stop.set())
    signal.signal(signal.SIGINT, lambda *_: demo.stop.set())
    log.info("demo.started", workers=config.workers, l1_bytes_per_worker=config.l1_pool_bytes,
             seconds=config.demo_seconds or None, injected_faults=INJECTED_FAULTS)
    print("[demo] injects faults on purpose, to move the failure metrics (counted in each progress line; each one is "
          "logged only at --log-level debug): " + "; ".join(INJECTED_FAULTS.values()), flush=True)
    try:
        status = demo.run(config.demo_seconds)
    except Exception:
        log.exception("demo.error", tally=demo.tally.as_dict())
        return 1
    finally:
        tally = demo.tally.as_dict()
        if config.demo_tally_file:
            with open(config.demo_tally_file + ".tmp", "w", encoding="utf-8") as handle:
                json.dump(tally, handle)
            os.replace(config.demo_tally_file + ".tmp", config.demo_tally_file)
        demo.close()
    log.info("demo.finished", tally=tally)
    return status


if __name__ == "__main__":
    sys.exit(main())
