"""Eviction orders (``--l1-policy``): shared by L1 and by the telemetry process's miniature simulations of it."""
