"""The cache process: serves engines on a Unix socket, keeps chunks in L1 (and L2), publishes events."""
