"""The per-metric cache_salt cap."""

from __future__ import annotations

import pytest

from mpcache.telemetry.salts import OVERFLOW_SALT, SaltCap


def test_salts_beyond_the_cap_become_overflow_and_admitted_ones_stay():
    """The first ``cap`` distinct salts pass through, later ones map to __overflow__, admitted ones keep passing."""
    cap = SaltCap(2)
    assert ["a", "b", OVERFLOW_SALT, "a", OVERFLOW_SALT] == [cap(s) for s in ("a", "b", "c", "a", "d")]


def test_cap_below_one_is_rejected():
    """A cap of 0 would send everything to __overflow__, so it is refused."""
    with pytest.raises(ValueError):
        SaltCap(0)
