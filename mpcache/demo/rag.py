"""The demo's RAG load: documents in random order, so cache blending finds their chunks at other positions;
with a fault mix for the blend failure counters, tallied to match ``/metrics``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

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
        # told before each operation what it may add to the compared L1 counters if its reply is lost
        # (mpcache.demo.run.Demo._doubt); the blend counters have no such bound
        self.doubt: Callable[..., None] = lambda salt="", **bounds: None
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

        self.doubt()
        lookup = client.cb_lookup(request_id=request_id, model_name=model, cache_salt=tenant, tokens=tokens)
        blend["lookup_requests"] += 1
        for name in ("requested_tokens", "hit_tokens", "fingerprint_hits", "storage_hits", "stale_chunks"):
            blend[f"lookup_{name}"] += getattr(lookup, name)
        blend["chunks_evicted"] += lookup.stale_chunks
        hits = lookup.hits
        if hits and lookup.lookup_id is not None:
            self._retrieve(client, buffer, request_id, lookup.lookup_id, hits, fps, tenant)

        # documents not wholly found: computed on their own, stored for blending
        start = 0
        statuses = lookup.chunks
        for doc in docs:
            n = len(self.documents[doc]) // self.chunk
            if any(s not in HITS for s in statuses[start : start + n]):
                self._store(client, buffer, "pre", request_id, model, tenant, self.documents[doc],
                            fault=m % PRE_FAULT_EVERY == 0)
            start += n
        self._store(client, buffer, "final", request_id, model, tenant, tokens, fault=m % FINAL_FAULT_EVERY == 0)
        self.doubt()
        client.end_session(request_id)

        if m % NO_GPU_EVERY == 0:
            bare = self._bare_client(worker)
            bare.cb_lookup(request_id=f"rag-bare-{os.getpid()}-{m}", model_name=model, cache_salt=tenant, tokens=tokens)
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
            self.doubt()
            try:
                client.cb_retrieve(MISSING_BUFFER_ID, request_id=request_id, lookup_id=lookup_id, chunk_indices=hits,
                                   block_ids=hits)
            except RequestError:
                blend["retrieve_failures"] += 1
                self.tally.injected["cb_retrieve_missing_buffer"] += 1
            else:
                raise RuntimeError("a cb_retrieve into a missing buffer succeeded")
            blend["retrieve_requests"] += 1
            blend["retrieve_chunks"] += len(hits)
        self.doubt(tenant, l1_read_failure=len(hits))
        result = client.cb_retrieve(buffer, request_id=request_id, lookup_id=lookup_id, chunk_indices=hits,
                                    block_ids=hits)
        blend["retrieve_requests"] += 1
        blend["retrieve_chunks"] += len(hits)
        if result.failed:  # evicted between lookup and retrieve: an L1 read failure, a failed retrieve
            blend["retrieve_failures"] += 1
            self.tally.expected_faults["l1_read_failed_chunks"] += result.failed
        else:
            self._verify(buffer, hits, fps)

    def _verify(self, buffer, hits: list[int], fps: list[int]) -> None:

        for index in hits:
            if not chunk_matches(buffer.blocks[index], fps[index]):
                raise RuntimeError(f"blended chunk {index} (fingerprint {fps[index]:#x}) does not match what was "
                                   "stored")
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
            self.doubt()
            try:
                if kind == "pre_computed":
                    store(MISSING_BUFFER_ID, request_id=request_id, model_name=model, cache_salt=tenant, tokens=tokens,
                          block_ids=block_ids)
                else:
                    store(buffer, request_id=request_id, model_name=model, cache_salt=tenant, tokens=tokens,
                          block_ids=block_ids[:-1])
            except RequestError:
                blend[f"store_{kind}_failures"] += 1
                self.tally.injected[f"cb_store_{kind}_rejected"] += 1
            else:
                raise RuntimeError(f"a faulty cb_store_{kind} succeeded")
            return
        self.doubt(tenant, l1_write=len(fps), l1_allocation_failure=len(fps))
        result = store(buffer, request_id=request_id, model_name=model, cache_salt=tenant, tokens=tokens,
                       block_ids=block_ids)
        self.tally.stored[tenant] += result.stored
        blend[f"store_{kind}_chunks"] += result.stored
        blend["fingerprints_registered"] += result.registered
        blend["chunks_evicted"] += result.replaced
        if result.failed:
            blend[f"store_{kind}_failures"] += 1
            self.tally.expected_faults["l1_allocation_failed_chunks"] += result.failed

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
