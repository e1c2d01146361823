"""``bin/start-cache --demo`` with its RAG load: every lmcache_blend counter is served and equals the demo's count."""

from __future__ import annotations

import pytest
from support.waiting import wait_for

pytestmark = pytest.mark.slow

BLEND_COUNTERS = [
    "lookup_requests", "lookup_requested_tokens", "lookup_hit_tokens", "lookup_fingerprint_hits",
    "lookup_storage_hits", "lookup_stale_chunks", "lookup_no_gpu_context_errors", "retrieve_requests",
    "retrieve_chunks", "retrieve_failures", "store_pre_computed_requests", "store_pre_computed_chunks",
    "store_pre_computed_failures", "store_final_requests", "store_final_chunks", "store_final_failures",
    "fingerprints_registered", "chunks_evicted",
]


def test_demo_serves_every_blend_counter_equal_to_its_tally(start_service) -> None:
    """After a 12 s demo, each of the 18 lmcache_blend_*_total samples equals the RAG load's own count, the
    lookup/store/registration counters moved, and the blend hit rate (hit / requested tokens) is in (0, 1)."""
    service = start_service("--demo", "--demo-seconds", "12")
    tally = wait_for(lambda: service.tally_path.exists() and service.tally(), 120, "the demo tally")
    expected = {f"lmcache_blend_{name}_total": float(tally["blend"].get(name, 0)) for name in BLEND_COUNTERS}

    def agreeing():
        scrape = service.scrape()
        served = {name: scrape.total(name) for name in expected if name in scrape.samples}
        return scrape if served == expected else None

    scrape = wait_for(agreeing, 60, "/metrics to agree with the demo's blend tally")
    moved = [name for name in ("lookup_requests", "lookup_fingerprint_hits", "lookup_storage_hits",
                               "store_pre_computed_chunks", "store_final_chunks", "fingerprints_registered")
             if scrape.total(f"lmcache_blend_{name}_total") > 0]
    hit_rate = (scrape.total("lmcache_blend_lookup_hit_tokens_total")
                / scrape.total("lmcache_blend_lookup_requested_tokens_total"))
    assert (6, True) == (len(moved), 0 < hit_rate < 1)
    assert 0 == service.stop()
