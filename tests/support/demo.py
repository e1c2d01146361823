"""What the demo's own tally (``bin/start-cache --demo``'s JSON count of its traffic) implies for the metrics."""

from __future__ import annotations


def l1_writes(tally: dict) -> dict[str, float]:
    """L1 writes per cache_salt the demo caused: its stores plus chunks its prefetches landed from L2."""
    out: dict[str, float] = {}
    for part in ("stored_chunks", "prefetched_chunks"):
        for salt, count in tally.get(part, {}).items():
            out[salt] = out.get(salt, 0.0) + float(count)
    return out
