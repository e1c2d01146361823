"""The telemetry process: rings → batches → subscribers → OpenTelemetry → /metrics and OTLP."""
