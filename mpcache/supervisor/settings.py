"""``start-cache``'s command line, built from the table of settings (:data:`mpcache.config.SETTINGS`): the
flags, where each setting's value comes from (:mod:`mpcache.supervisor.sources`), the Config they make, and
``--check-config``, which prints every resolved setting with its source and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpcache import __version__
from mpcache.cache.l2.spec import check_l2_spec
from mpcache.cache.l2.trust import ensure_private_dir, resolve_l2_key
from mpcache.config import L2_GB, SETTINGS, Config
from mpcache.config.kinds import Choice, Kind, Repeated, Switch
from mpcache.errors import ConfigError
from mpcache.supervisor import logfile
from mpcache.supervisor.checks import check_endpoints, check_socket_path_length
from mpcache.supervisor.provision import check_shm_space
from mpcache.supervisor.sources import Resolved, describe, resolve, where
from mpcache.systemd import error_line

CONFIG_ENV = "MPCACHE_CONFIG"

__all__ = ["build_parser", "check_config", "config_from_settings", "deprecated_given", "parse", "where"]

# settings still accepted (and checked) but ignored: name → what replaced them, for the one warning at start
DEPRECATED = {
    "l1-watermark": "L1 evicts on demand: a store that needs room evicts just what it needs, in --l1-policy's "
                    "order, so no loop trims L1 below a watermark; the value is ignored",
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments"):
            message += f" (run {self.prog} --help for the accepted flags)"
        sys.stderr.write(error_line(f"{self.prog}: error: {message}"))
        sys.exit(2)


def _flag_type(kind: Kind) -> Callable[[str], Any]:
    """A flag's text → its setting's value, or argparse's one-line error saying what is expected."""
    def parse(text: str) -> Any:
        try:
            return kind.value(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Every setting as a flag (only the flags given end up in the result: the other sources fill the rest)."""
    environ = os.environ if environ is None else environ
    parser = _OneLineParser(
        prog="start-cache",
        description="Run mpcache: cache processes serving KV chunks, plus a telemetry process "
        "exporting their metrics (Prometheus /metrics and/or OTLP).",
    )
    parser.add_argument("--version", action="version", version=f"start-cache (mpcache) {__version__}")
    groups: dict[str, Any] = {}
    for item in SETTINGS:
        group = groups.get(item.group) or groups.setdefault(item.group, parser.add_argument_group(item.group))
        options: dict[str, Any] = {"dest": item.field, "default": argparse.SUPPRESS, "help": item.help}
        metavar = item.metavar or item.name.upper().replace("-", "_")
        if isinstance(item.kind, Switch):
            options["action"] = "store_true"
        elif isinstance(item.kind, Repeated):
            options.update(action="append", type=_flag_type(item.kind.item), metavar=metavar)
        elif isinstance(item.kind, Choice):
            options.update(type=_flag_type(item.kind), choices=item.kind.options)
        else:
            options.update(type=_flag_type(item.kind), metavar=metavar)
        group.add_argument(item.flag, **options)
    parser.add_argument("--config", metavar="FILE", default=environ.get(CONFIG_ENV, ""),
                        help="a TOML file of settings (flag names as keys, [[l2]] tables for L2 tiers); "
                        "MPCACHE_* environment variables override it, flags override both")
    parser.add_argument("--check-config", action="store_true",
                        help="print every setting as resolved, with where its value came from (flag, "
                        "environment, file or default), after the checks a start makes first (ports free, "
                        "room in /dev/shm), and exit: 0, or 2 with the error; starts nothing")
    return parser


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Resolved:
    """Every setting from the command line, ``environ`` (default: ours) and the ``--config`` file; a bad
    value or an unknown key or variable is one line on stderr and exit status 2."""
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    flags = {item.name: getattr(args, item.field) for item in SETTINGS if hasattr(args, item.field)}
    try:
        resolved = resolve(flags, args.config, environ)
    except ConfigError as exc:
        parser.error(str(exc))
    return Resolved(resolved.values, resolved.sources, check_only=args.check_config)


def deprecated_given(resolved: Resolved) -> list[dict[str, str]]:
    """One warning's fields for each deprecated setting given by flag, environment or file (not by default)."""
    return [{"setting": name, "source": resolved.sources[name], "message": message}
            for name, message in DEPRECATED.items() if resolved.sources.get(name, "default") != "default"]


def _l2_specs(specs: list[dict], chunk_bytes: int) -> list[dict]:
    """Every ``--l2`` tier, checked (ConfigError naming --l2 on the first bad one)."""
    for spec in specs:
        check_l2_spec(spec)
        if int(spec["capacity_gb"] * L2_GB) < chunk_bytes:
            raise ConfigError(f"--l2: {spec['type']} capacity_gb {spec['capacity_gb']!r} is smaller than one chunk "
                              f"(--chunk-bytes, {chunk_bytes} bytes)")
    return specs


def config_from_settings(resolved: Resolved, supervisor_pid: int, runtime_dir: str, *,
                         l2_key: bool = True) -> Config:
    """The run's Config: the settings, checked together, in ``runtime_dir``; with ``l2_key``, the fs tiers'
    directories made private and the L2 record key resolved (which may create the fs tier's secret file)."""
    fields = resolved.config_fields()
    l2 = _l2_specs(fields["l2"], fields["chunk_bytes"])
    key = None
    if l2_key:
        for spec in l2:
            if spec["type"] == "fs":  # ours, not a symlink, not writable by others: before its secret is read
                ensure_private_dir(spec["path"], "--l2: fs path")
        key = resolve_l2_key(l2, fields["l2_secret_file"])
    return Config(**{**fields, "supervisor_pid": supervisor_pid, "runtime_dir": runtime_dir, "l2": l2,
                     "l2_secret": key.key.hex() if key else "", "l2_secret_source": key.source if key else ""})


def check_config(resolved: Resolved, supervisor_pid: int, runtime_dir: str) -> int:
    """``--check-config``: every setting and its source on stdout, exit 0; or the error on stderr, exit 2.
    The settings are checked together and against this machine as at a start — the ports are free and
    resolve, /dev/shm has room for every segment — creating nothing (no L2 secret is read or made, no
    segment or file created; an existing --log-file is read, not written)."""
    try:
        config = config_from_settings(resolved, supervisor_pid, runtime_dir, l2_key=False)
        check_socket_path_length(config)
        check_endpoints(config)
        check_shm_space(config)
        if config.log_file:
            logfile.check(os.path.abspath(config.log_file), config.log_backups)
    except ConfigError as exc:
        sys.stderr.write(error_line(f"start-cache: error: {where(resolved, str(exc))}"))
        return 2
    sys.stdout.write("".join(f"{line}\n" for line in describe(resolved)))
    return 0
