"""Label cardinality policy: per metric, at most ``cap`` distinct ``cache_salt`` values and at most
``series_cap`` attribute sets; values beyond either are reported as ``__overflow__``.

``cache_salt``, ``model_name``, the engine, instance and worker ids and the device (which names a worker's rank)
are chosen by clients, so a runaway tenant, model or engine population costs a bounded number of series per metric
(below the OpenTelemetry SDK's own 2000-series limit, which would fold them into ``otel_metric_overflow`` with no
attributes at all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mpcache.telemetry import statecheck

OVERFLOW_SALT = "__overflow__"
CLIENT_LABELS = frozenset({"cache_salt", "model_name", "engine_id", "instance_id", "worker_id", "device"})
DEFAULT_SERIES_CAP = 1500


class SaltCap:
    """The admitted salts of one metric."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"cache_salt cap must be >= 1, got {cap}")
        self._cap = cap
        self._admitted: set[str] = set()

    def __call__(self, salt: str) -> str:
        """``salt`` if this metric has admitted it (or has room for it), else ``__overflow__``."""
        if salt in self._admitted:
            return salt
        if len(self._admitted) < self._cap:
            self._admitted.add(salt)
            return salt
        return OVERFLOW_SALT

    def save_state(self) -> list[str]:
        """The admitted salts, for a checkpoint: a restart admits the same ones (and no more than the cap)."""
        return list(self._admitted)

    def load_state(self, state: object) -> Callable[[], None]:
        admitted = set(statecheck.items(state, "s", self._cap))
        return lambda: setattr(self, "_admitted", admitted)


class SeriesCap:
    """The admitted attribute sets of one metric: past ``cap``, a new set keeps its service-chosen values and
    reports its client-chosen ones (:data:`CLIENT_LABELS`) as ``__overflow__``."""

    def __init__(self, names: Sequence[str], cap: int = DEFAULT_SERIES_CAP) -> None:
        if cap < 1:
            raise ValueError(f"series cap must be >= 1, got {cap}")
        self._client = [name in CLIENT_LABELS for name in names]
        self._cap = cap
        self._admitted: set[tuple[str, ...]] = set()

    def __call__(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if values in self._admitted:
            return values
        if len(self._admitted) < self._cap:
            self._admitted.add(values)
            return values
        return tuple(OVERFLOW_SALT if client else value for value, client in zip(values, self._client))

    def save_state(self) -> list[list[str]]:
        """The admitted attribute sets, for a checkpoint."""
        return [list(values) for values in self._admitted]

    def load_state(self, state: object) -> Callable[[], None]:
        admitted = set(statecheck.rows(state, "s" * len(self._client)))
        if len(admitted) > self._cap:
            raise ValueError(f"{len(admitted)} attribute sets, the cap is {self._cap}")
        return lambda: setattr(self, "_admitted", admitted)
