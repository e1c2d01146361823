"""mpcache: a multi-process KV-cache service whose observability runs out of the data path."""
