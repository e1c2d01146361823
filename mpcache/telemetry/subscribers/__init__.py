"""What the telemetry process runs on event batches: metrics, logging and tracing subscribers."""
