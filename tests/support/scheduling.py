"""How ``pytest -n 2 --dist loadgroup`` shares the suite between its two workers.

Each test file is one group, so a module's fixtures are set up once and its tests run in order on one worker.
The files that start vLLM engines, Docker containers or LMCache's torch clients form one group, ENGINES: on
2 cores and a few GiB of memory two of them at once would slow each other past their start-up bounds, so they
run one after the other on one worker while the other takes the rest.  The groups are sent heaviest first
(ENGINES, then by how many `slow` tests a file has), so that no long file starts last and runs alone.
"""

from __future__ import annotations

from collections import Counter

import pytest

ENGINES = "engines"
# Path prefixes (from the repository root) of the files in ENGINES.
ENGINE_FILES = ("tests/vllm/", "tests/docker/", "tests/lmcache/", "tests/test_bench.py", "tests/test_bench_vllm.py",
                "tests/test_kv_feed_replay.py")


def group_of(nodeid: str) -> str:
    """The xdist group of a test: ENGINES, or its file."""
    path = nodeid.split("::", 1)[0]
    return ENGINES if path.startswith(ENGINE_FILES) else path


def group_and_order(items: list[pytest.Item]) -> None:
    """Mark every item with its group and sort ``items`` in place, group by group, heaviest first; the order
    within a group is the collection's (a stable sort), so every worker sorts the same collection alike."""
    groups = {id(item): group_of(item.nodeid) for item in items}
    slow = Counter(groups[id(item)] for item in items if item.get_closest_marker("slow"))
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(groups[id(item)], len(first_seen))
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    items.sort(key=lambda item: (groups[id(item)] != ENGINES, -slow[groups[id(item)]],
                                 first_seen[groups[id(item)]]))
