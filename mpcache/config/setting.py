"""One setting of ``start-cache``, declared once on its :class:`~mpcache.config.Config` field: its name (which
gives the flag ``--<name>``, the variable ``MPCACHE_<NAME>`` and the TOML key ``<name>``), its kind (type and
validation), default, help text and help group, and how its default is derived when that depends on others.

Also the ``MPCACHE_*`` variables that are not settings: anything else of that prefix in start-cache's
environment is a misspelt setting, refused naming the nearest valid one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mpcache.config.kinds import Kind, Repeated, Size, Switch

ENV_PREFIX = "MPCACHE_"

# (value, explicit, every setting's value so far, the environment) → (value, where it came from), or None to
# keep the value: the defaults that depend on --demo, or on OpenTelemetry's own OTEL_* variables
Derivation = Callable[[Any, bool, Mapping[str, Any], Mapping[str, str]], "tuple[Any, str] | None"]

# the project's tests and CI name their own variables under these prefixes, which no setting takes: start-cache
# passes over them by prefix, so the product holds no list of its tests' knobs
FOREIGN_PREFIXES = ("MPCACHE_TEST_", "MPCACHE_CI_")

# MPCACHE_* variables that start-cache accepts in its environment although they are not settings
OTHER_VARIABLES = {
    "MPCACHE_CONFIG": "the TOML file of settings (--config)",
    "MPCACHE_LAUNCHER_REEXEC": "bin/start-cache's one re-exec into the checkout's .venv",
    "MPCACHE_PURE_PYTHON": "publish through the pure-Python ring writer (mpcache/shm/ring.py)",
    "MPCACHE_IMAGE": "deploy/docker/compose.yaml: the image's name",
    "MPCACHE_BASE_IMAGE": "deploy/docker/compose.yaml: the image's base",
    "MPCACHE_METRICS_PORT": "deploy/docker/compose.yaml: the host port of /metrics",
    "MPCACHE_PROMETHEUS_UI_PORT": "deploy/docker/compose.yaml: the host port of Prometheus",
    "MPCACHE_COLLECTOR_PORT": "deploy/docker/compose.yaml: the host port of the collector",
    "MPCACHE_VLLM_IMAGE": "deploy/docker/compose.yaml: the vLLM engine image's name",
    "MPCACHE_VLLM_PORT": "deploy/docker/compose.yaml: the host port of vLLM's OpenAI server",
}


@dataclass(frozen=True)
class Setting:
    name: str  # --<name>, MPCACHE_<NAME> (upper case, "_" for "-"), <name> in a TOML file
    field: str  # its Config field
    kind: Kind
    default: Any
    help: str
    group: str
    metavar: str | None = None
    derive: Derivation | None = None

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def repeated(self) -> bool:
        return isinstance(self.kind, Repeated)


def shown(kind: Kind, value: Any) -> str:
    """A value as --help and the reference table write it: a switch off or on, a size in its largest whole binary
    unit (256MiB), a whole number without its ``.0``, an empty value as none."""
    if isinstance(kind, Switch):
        return "on" if value else "off"
    if isinstance(kind, Size):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value and value % size == 0:
                return f"{value // size}{unit}"
    if value in ("", []):
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def setting(kind: Kind, default: Any, help: str, *, group: str, name: str = "", metavar: str | None = None,
            derive: Derivation | None = None) -> Any:
    """A Config field that is a setting (``name``: its flag without dashes; default: the field's name).  A
    ``{default}`` in ``help`` is the declared default as :func:`shown` writes it, so --help cannot drift from it."""
    declared = Setting(name, "", kind, default, help.replace("{default}", shown(kind, default)), group, metavar,
                       derive)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={"setting": declared})
    return dataclasses.field(default=default, metadata={"setting": declared})


def settings_of(cls: type) -> tuple[Setting, ...]:
    """Every setting declared on ``cls``'s fields, in declaration order (the order of --help)."""
    found = []
    for item in dataclasses.fields(cls):
        declared = item.metadata.get("setting")
        if declared is not None:
            found.append(dataclasses.replace(declared, field=item.name,
                                             name=declared.name or item.name.replace("_", "-")))
    return tuple(found)
