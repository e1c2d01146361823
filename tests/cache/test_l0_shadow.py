"""L0 shadow monitoring end to end: client reports → cache server → ring → L0 lifecycle subscriber → histograms.

The server's event clock is injected (``clock_ns``), and every client call returns only after the server
published, so each step's timestamp is exact and the recorded samples can be compared exactly.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from support.cache_harness import MODEL

from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.subscribers.metrics.l0_lifecycle import L0LifecycleSubscriber

T0 = 1_700_000_000 * 10**9
S = 10**9
INSTANCE = 42
NAMES = ("lmcache_mp.l0_block_lifetime", "lmcache_mp.l0_block_idle_before_evict", "lmcache_mp.l0_block_reuse_gap")
NONE = ((0, 0.0), (0, 0.0), (0, 0.0))
PROMPT = list(range(1000, 1016))  # one block's tokens
OTHER = list(range(2000, 2016))


class Shadow:
    """A server with a settable event clock, a client, and the L0 subscriber fed from the server's ring."""

    def __init__(self, cache) -> None:
        self.now_ns = T0
        self.harness = cache({"clock_ns": lambda: self.now_ns})
        self.client = self.harness.client()
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.subscriber = L0LifecycleSubscriber(self.provider.get_meter("test"))
        self.bus = EventBus()
        self.bus.subscribe(self.subscriber)

    def allocate(self, at_s: float, *records) -> None:
        """One scheduler step at T0 + at_s: records of (request id, new block ids, new token ids)."""
        self.now_ns = T0 + int(at_s * S)
        self.client.report_block_allocations(instance_id=INSTANCE, model_name=MODEL, records=records)

    def end(self, at_s: float, request_id: str) -> None:
        self.now_ns = T0 + int(at_s * S)
        self.client.end_session(request_id)

    def samples(self) -> tuple:
        """Deliver what the server published; (count, sum) of lifetime, idle-before-evict, reuse gap."""
        self.bus.dispatch(self.harness.events.take())
        points: dict[str, HistogramDataPoint] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        if dict(point.attributes) == {"instance_id": str(INSTANCE), "model_name": MODEL}:
                            points[metric.name] = point
        return tuple((points[n].count, points[n].sum) if n in points else (0, 0.0) for n in NAMES)

    def close(self) -> None:
        self.provider.shutdown()


@pytest.fixture
def shadow(cache):
    made = Shadow(cache)
    yield made
    made.close()


def test_a_new_block_is_tracked_and_records_nothing(shadow):
    """A first report of block 5 makes it active, owned by its request: no sample, one tracked block."""
    shadow.allocate(0, ("A", [5], PROMPT))
    assert (NONE, 1) == (shadow.samples(), shadow.subscriber.tracked)


def test_the_same_request_reporting_the_same_block_again_records_nothing(shadow):
    """Request A reporting block 5 with the same tokens at 0 and at 3 is a repeat, not a reuse."""
    shadow.allocate(0, ("A", [5], PROMPT))
    shadow.allocate(3, ("A", [5], PROMPT))
    assert (NONE, 1) == (shadow.samples(), shadow.subscriber.tracked)


def test_prefix_sharing_records_nothing_while_an_owner_remains(shadow):
    """B shares A's block (same tokens) while A owns it; after A ends, C shares it with B: no sample."""
    shadow.allocate(0, ("A", [5], PROMPT))
    shadow.allocate(2, ("B", [5], PROMPT))
    shadow.end(3, "A")
    shadow.allocate(4, ("C", [5], PROMPT))
    assert (NONE, 2) == (shadow.samples(), shadow.subscriber.requests_indexed)


def test_release_then_reuse_records_the_reuse_gap(shadow):
    """A allocates at 0 and ends at 3; C gets the same tokens in block 5 at 10: one reuse gap of 10 s."""
    shadow.allocate(0, ("A", [5], PROMPT))
    shadow.end(3, "A")
    shadow.allocate(10, ("C", [5], PROMPT))
    assert ((0, 0.0), (0, 0.0), (1, 10.0)) == shadow.samples()


def test_reallocation_with_other_tokens_records_lifetime_and_idle(shadow):
    """A allocates at 0 and ends at 4; D puts other tokens in block 5 at 10: lifetime 10 s, idle 6 s."""
    shadow.allocate(0, ("A", [5], PROMPT))
    shadow.end(4, "A")
    shadow.allocate(10, ("D", [5], OTHER))
    assert ((1, 10.0), (1, 6.0), (0, 0.0)) == shadow.samples()


def test_end_of_session_releases_only_that_requests_blocks(shadow):
    """A owns blocks 1-2 (one record, tokens split across them), B owns block 3; ending A (and an unknown
    request) at 1 releases 1 and 2 only, so C's same contents at 5 are two 5 s reuses and a share of 3."""
    shadow.allocate(0, ("A", [1, 2], PROMPT + OTHER), ("B", [3], OTHER))
    shadow.end(1, "A")
    shadow.end(1, "unknown-request")
    shadow.allocate(5, ("C", [1, 2], PROMPT + OTHER), ("C", [3], OTHER))
    assert (((0, 0.0), (0, 0.0), (2, 10.0)), 2) == (shadow.samples(), shadow.subscriber.requests_indexed)
