"""How ``pytest -n 2`` shares the suite between its two workers (pytest-xdist; tests/conftest.py's hooks).

Each test file is one unit of work, so a module's fixtures are set up once and its tests run in order on one
worker.  The files that start vLLM engines or Docker containers form one unit, ENGINES: on 2 cores two engines at
once would slow each other past their start-up bounds, so they run one after the other on one worker while the
other takes the rest.  The units are sent heaviest first
(ENGINES, then by how many `slow` tests a file has), so that no long file starts last and runs alone.

The units are xdist's scopes (a scope scheduler whose scope is :func:`group_of`), not ``xdist_group`` marks: with
pytest 9.2 xdist 3.8's ``--dist loadgroup`` silently ignores them (pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

ENGINES = "engines"
# Path prefixes (from the repository root) of the files in ENGINES.
ENGINE_FILES = ("tests/vllm/", "tests/docker/")


def group_of(nodeid: str) -> str:
    """The unit of work of a test: ENGINES, or its file."""
    path = nodeid.split("::", 1)[0]
    return ENGINES if path.startswith(ENGINE_FILES) else path


def order(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place unit by unit, heaviest first; the order within a unit is the collection's (a stable
    sort), so every worker sorts the same collection alike and each unit's tests stay together."""
    groups = {id(item): group_of(item.nodeid) for item in items}
    slow = Counter(groups[id(item)] for item in items if item.get_closest_marker("slow"))
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(groups[id(item)], len(first_seen))
    items.sort(key=lambda item: (groups[id(item)] != ENGINES, -slow[groups[id(item)]],
                                 first_seen[groups[id(item)]]))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with :func:`group_of` as the scope (xdist is imported only when it runs)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)
