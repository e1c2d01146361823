"""A cache process raises its soft open-files limit toward the hard one (the two transports may hold more
connections than a default soft limit of 1,024 allows), and never lowers it; run in a child process so
this one's limit stays as it is."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
soft = int(sys.argv[1])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from mpcache.cache.__main__ import raise_descriptor_limit
returned = raise_descriptor_limit()
print(json.dumps([returned, *resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def _run(soft: int) -> list[int]:
    done = subprocess.run([sys.executable, "-c", PROBE, str(soft)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_low_soft_limit_is_raised_toward_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
    if expected <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    assert _run(256) == [expected, expected, hard]


def test_a_soft_limit_already_at_the_hard_one_or_above_the_wanted_one_is_kept() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = hard if hard != resource.RLIM_INFINITY and hard <= 1 << 16 else (1 << 16) + 1000
    assert _run(soft) == [soft, soft, hard]
