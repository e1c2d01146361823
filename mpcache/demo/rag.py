"""The demo's retrieval-augmented (RAG) load: cache blending of document chunks at any position.

A corpus of documents (whole chunks of random tokens, Zipf popularity) is
shared by every tenant.  Each request is a few documents in random order
followed by a question, so the same document chunks come back at other
positions: a prefix cache misses them, cache blending finds them by
fingerprint.  Per request, as an engine with blending would:

1. ``cb_lookup`` the prompt;
2. ``cb_retrieve`` every hit (prefix or fingerprint) into its blocks and check
   the bytes (a chunk's content is derived from its fingerprint, so it is the
   same wherever it was stored from);
3. ``cb_store_pre_computed`` each document that was not wholly found (what an
   engine would compute on its own, independent of context);
4. ``cb_store_final`` the finished request, then ``end_session``.

A small fault mix keeps every ``lmcache_blend`` failure counter moving: now
and then a retrieve or a pre-computed store names a buffer id the server never
gave out, a final store names too few blocks, and a client with no KV buffer
looks up (``no_gpu_context``).  Stale fingerprints appear by themselves: L1
evicts blend objects like any other.

Everything the RAG load does to L1 is added to the demo's tally (chunks
stored per cache_salt, allocation and read failures), so the demo's L1
counters still agree with ``/metrics``; ``tally.blend`` holds its own counts, named as the
``lmcache_blend.*`` counters they must equal.
"""

from __future__ import annotations

import os
import time

import numpy as np

from mpcache.client import CacheClient
from mpcache.config import Config
from mpcache.contract.blending import HITS, chunk_fingerprints
from mpcache.demo.chunks import chunk_matches, fill_chunk
from mpcache.errors import RequestError

RAG_EVERY = 3  # demo requests per RAG request
DOCUMENTS = 32
DOCS_PER_REQUEST = (2, 4)  # inclusive range
ZIPF_EXPONENT = 1.2
RETRIEVE_FAULT_EVERY = 25  # RAG requests between retrieves into a missing buffer
PRE_FAULT_EVERY = 30  # ... pre-computed stores into a missing buffer
FINAL_FAULT_EVERY = 35  # ... final stores with too few block ids
NO_GPU_EVERY = 20  # ... lookups from a client without a KV buffer
PROGRESS_INTERVAL_S = 5.0
MISSING_BUFFER_ID = (1 << 62) + 1  # never handed out by a cache process


class _Missing:
    buffer_id = MISSING_BUFFER_ID


class RagWorkload:
    """RAG requests over the demo's clients and KV buffers (one per cache process)."""

    def __init__(self, config: Config, clients: list[CacheClient], buffers: list, tally, seed: int = 11) -> None:
        self.config = config
        self.clients = clients
        self.buffers = buffers
        self.tally = tally
        self.rng = np.random.default_rng(seed)
        self.chunk = config.chunk_size_tokens
        self.max_blocks = min(buffer.num_blocks for buffer in buffers)
        max_doc_chunks = max(1, (self.max_blocks - 2) // DOCS_PER_REQUEST[1])
        self.documents = [[int(t) for t in self.rng.integers(32000, 64000, size=int(self.rng.integers(
            1, min(3, max_doc_chunks) + 1)) * self.chunk)] for _ in range(DOCUMENTS)]
        self._bare: dict[int, CacheClient] = {}  # per worker: a client that never registers a buffer
        self.requests = 0
        self._last_report = time.monotonic()

    # -- one request ---------------------------------------------------------------------

    def one_request(self, worker: int, tenant: str, model: str) -> None:
        self.requests += 1
        m = self.requests
        blend = self.tally.blend
        client, buffer = self.clients[worker], self.buffers[worker]
        request_id = f"rag-{os.getpid()}-{m}"
        docs = self._pick_documents()
        question = [int(t) for t in self.rng.integers(32000, 64000, size=self.chunk + int(self.rng.integers(
            1, self.chunk)))]
        tokens = [t for doc in docs for t in self.documents[doc]] + question
        fps = chunk_fingerprints(tokens, self.chunk)
        if len(fps) > self.max_blocks:
            tokens = tokens[: self.max_blocks * self.chunk]
            fps = fps[: self.max_blocks]

        lookup = client.cb_lookup(request_id, model, tenant, tokens)
        blend["lookup_requests"] += 1
        for name in ("requested_tokens", "hit_tokens", "fingerprint_hits", "storage_hits", "stale_chunks"):
            blend[f"lookup_{name}"] += int(lookup[name])
        blend["chunks_evicted"] += int(lookup["stale_chunks"])
        hits = [i for i, status in enumerate(lookup["chunks"]) if status in HITS]
        if hits:
            self._retrieve(client, buffer, request_id, lookup["lookup_id"], hits, fps, tenant)

        # documents not wholly found: computed on their own, stored for blending
        start = 0
        statuses = lookup["chunks"]
        for doc in docs:
            n = len(self.documents[doc]) // self.chunk
            if any(s not in HITS for s in statuses[start : start + n]):
                self._store(client, buffer, "pre", request_id, model, tenant, self.documents[doc],
                            fault=m % PRE_FAULT_EVERY == 0)
            start += n
        self._store(client, buffer, "final", request_id, model, tenant, tokens, fault=m % FINAL_FAULT_EVERY == 0)
        client.end_session(request_id)

        if m % NO_GPU_EVERY == 0:
            bare = self._bare_client(worker)
            bare.cb_lookup(f"rag-bare-{os.getpid()}-{m}", model, tenant, tokens)
            bare.end_session(f"rag-bare-{os.getpid()}-{m}")
            blend["lookup_requests"] += 1
            blend["lookup_no_gpu_context_errors"] += 1
        self._progress()

    def _pick_documents(self) -> list[int]:
        count = int(self.rng.integers(DOCS_PER_REQUEST[0], DOCS_PER_REQUEST[1] + 1))
        chosen: list[int] = []
        while len(chosen) < count:
            doc = min(int(self.rng.zipf(ZIPF_EXPONENT)) - 1, DOCUMENTS - 1)
            if doc not in chosen:
                chosen.append(doc)
        self.rng.shuffle(chosen)  # the same documents, another order: another position for every chunk
        return chosen

    def _retrieve(self, client, buffer, request_id: str, lookup_id: int, hits: list[int], fps: list[int],
                  tenant: str) -> None:
        blend = self.tally.blend
        if self.requests % RETRIEVE_FAULT_EVERY == 0:
            try:
                client.cb_retrieve(MISSING_BUFFER_ID, request_id, lookup_id, hits, hits)
            except RequestError:
                blend["retrieve_failures"] += 1
            else:
                raise RuntimeError("a cb_retrieve into a missing buffer succeeded")
            blend["retrieve_requests"] += 1
            blend["retrieve_chunks"] += len(hits)
        reply = client.cb_retrieve(buffer, request_id, lookup_id, hits, hits)
        blend["retrieve_requests"] += 1
        blend["retrieve_chunks"] += len(hits)
        if reply["failed_count"]:  # evicted between lookup and retrieve: an L1 read failure, a failed retrieve
            blend["retrieve_failures"] += 1
            self.tally.expected_faults["l1_read_failed_chunks"] += reply["failed_count"]
        else:
            self._verify(buffer, hits, fps)

    def _verify(self, buffer, hits: list[int], fps: list[int]) -> None:

        for index in hits:
            if not chunk_matches(buffer.blocks[index], fps[index]):
                raise RuntimeError(
                    f"blended chunk {index} (fingerprint {fps[index]:#x}) does not match what was stored")
            self.tally.verified_chunks += 1

    def _store(self, client, buffer, kind: str, request_id: str, model: str, tenant: str, tokens: list[int],
               fault: bool) -> None:

        blend = self.tally.blend
        fps = chunk_fingerprints(tokens, self.chunk)
        block_ids = list(range(len(fps)))
        for block_id, fp in zip(block_ids, fps):
            fill_chunk(buffer.blocks[block_id], fp)
        store = client.cb_store_pre_computed if kind == "pre" else client.cb_store_final
        kind = "pre_computed" if kind == "pre" else kind
        blend[f"store_{kind}_requests"] += 1
        if fault:  # pre: a buffer id never handed out; final: fewer block ids than whole chunks
            try:
                if kind == "pre_computed":
                    store(_Missing(), request_id, model, tenant, tokens, block_ids)
                else:
                    store(buffer, request_id, model, tenant, tokens, block_ids[:-1])
            except RequestError:
                blend[f"store_{kind}_failures"] += 1
            else:
                raise RuntimeError(f"a faulty cb_store_{kind} succeeded")
            return
        reply = store(buffer, request_id, model, tenant, tokens, block_ids)
        self.tally.stored[tenant] += reply["stored_count"]
        blend[f"store_{kind}_chunks"] += reply["stored_count"]
        blend["fingerprints_registered"] += reply["registered_count"]
        blend["chunks_evicted"] += reply["replaced_count"]
        if reply["failed_count"]:
            blend[f"store_{kind}_failures"] += 1
            self.tally.expected_faults["l1_allocation_failed_chunks"] += reply["failed_count"]

    def _bare_client(self, worker: int) -> CacheClient:
        bare = self._bare.get(worker)
        if bare is None:
            bare = self._bare[worker] = CacheClient(self.config.socket_path(worker))
        return bare

    # -- reporting -----------------------------------------------------------------------

    def hit_rate(self) -> float:
        blend = self.tally.blend
        requested = blend["lookup_requested_tokens"]
        return blend["lookup_hit_tokens"] / requested if requested else 0.0

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._last_report < PROGRESS_INTERVAL_S:
            return
        self._last_report = now
        blend = self.tally.blend
        print(f"[demo-rag] {self.requests} RAG requests | blend hit rate {self.hit_rate():6.1%} | "
              f"{blend['lookup_fingerprint_hits']} fingerprint hits, {blend['lookup_storage_hits']} confirmed, "
              f"{blend['lookup_stale_chunks']} stale", flush=True)

    def close(self) -> None:
        for bare in self._bare.values():
            bare.close()
        self._bare.clear()
