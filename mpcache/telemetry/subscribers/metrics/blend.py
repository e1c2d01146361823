"""The ``lmcache_blend.*`` counters are table-driven: see :mod:`.counters` (kept for importers)."""

from mpcache.telemetry.subscribers.metrics.counters import BlendMetricsSubscriber

__all__ = ["BlendMetricsSubscriber"]
