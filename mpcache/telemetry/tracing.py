"""OpenTelemetry tracing set-up (``--enable-tracing``): a TracerProvider with the metrics' resource and a
batching OTLP span exporter; :meth:`TracingExport.shutdown` flushes what is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from mpcache.config import Config
from mpcache.telemetry import otlp
from mpcache.telemetry.otel import build_resource

_SHUTDOWN_TIMEOUT_MS = 10_000
# Explicit, so that no OTEL_BSP_* environment variable changes them behind the configuration.
_MAX_QUEUE_SIZE = 16_384
_MAX_EXPORT_BATCH_SIZE = 512
_SCHEDULE_DELAY_MS = 2_000


@dataclass
class TracingExport:
    """The TracerProvider and its span processor; :meth:`start` builds them, :meth:`shutdown` flushes and stops."""

    tracer_provider: TracerProvider
    processor: SpanProcessor

    @classmethod
    def start(cls, config: Config, processor: SpanProcessor | None = None) -> TracingExport:
        """Build the provider.  ``processor`` replaces the OTLP batch processor (tests use an in-memory one)."""
        if processor is None:
            processor = BatchSpanProcessor(
                otlp.build_exporter(config, otlp.TRACES),
                max_queue_size=_MAX_QUEUE_SIZE,
                schedule_delay_millis=_SCHEDULE_DELAY_MS,
                max_export_batch_size=_MAX_EXPORT_BATCH_SIZE,
                export_timeout_millis=otlp.EXPORT_TIMEOUT_S * 1000,
            )
        provider = TracerProvider(resource=build_resource(config), sampler=ALWAYS_ON)
        provider.add_span_processor(processor)
        return cls(provider, processor)

    def force_flush(self, timeout_millis: int = _SHUTDOWN_TIMEOUT_MS) -> bool:
        """Export every span ended so far; True when that finished within the timeout."""
        return self.tracer_provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Export what is still queued, then stop the processor and its exporter."""
        try:
            self.tracer_provider.force_flush(_SHUTDOWN_TIMEOUT_MS)
        finally:
            self.tracer_provider.shutdown()
