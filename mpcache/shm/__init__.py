"""Shared memory between the processes: segments, the byte layout, the event ring, the gauge board."""
