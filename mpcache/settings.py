"""Where ``start-cache``'s settings come from: a TOML file, ``MPCACHE_*`` environment variables, flags.

Later sources win: file < environment < command line.  Every setting is a flag's long name
(``--l1-size`` → ``l1-size`` in the file, ``MPCACHE_L1_SIZE`` in the environment) and goes through
the flag's own parser, so a bad value is one line naming the setting and where it came from.  L2
tiers are a list of tables in the file (``[[l2]]``) or a JSON list in ``MPCACHE_L2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from mpcache.errors import ConfigError

ENV_PREFIX = "MPCACHE_"
CONFIG_ENV = "MPCACHE_CONFIG"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NOT_SETTINGS = {"help", "version", "config"}


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``parser``'s flags, defaulted from ``--config FILE`` (or ``$MPCACHE_CONFIG``) and ``MPCACHE_*``."""
    environ = os.environ if environ is None else environ
    parser.add_argument("--config", metavar="FILE", default=environ.get(CONFIG_ENV, ""),
                        help="a TOML file of settings (flag names as keys, [[l2]] tables for L2 tiers); "
                        "MPCACHE_* environment variables override it, flags override both")
    actions = {action.dest: action for action in parser._actions if action.dest not in _NOT_SETTINGS}
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", default=environ.get(CONFIG_ENV, ""))
    known, _ = first.parse_known_args(argv)
    defaults: dict[str, tuple[Any, str]] = {}
    try:
        if known.config:
            defaults.update(_from_file(known.config, actions))
        defaults.update(_from_environment(environ, actions))
    except ConfigError as exc:
        parser.error(str(exc))
    parser.set_defaults(**{dest: value for dest, (value, _) in defaults.items()})
    args = parser.parse_args(argv)
    given = _given_on_command_line(parser, argv)
    args.setting_sources = {f"--{dest.replace('_', '-')}": source for dest, (_, source) in defaults.items()
                            if dest not in given}
    return args


def where(args: argparse.Namespace, message: str) -> str:
    """``message`` (which names a flag first) with where that flag's value came from, when not a flag."""
    flag = message.split(":", 1)[0].split("/", 1)[0]
    source = getattr(args, "setting_sources", {}).get(flag)
    return f"{message} (set in {source})" if source else message


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The settings the command line itself sets (they win over file and environment)."""
    words = sys.argv[1:] if argv is None else list(argv)
    given = set()
    for action in parser._actions:
        if any(word == option or word.startswith(option + "=") for option in action.option_strings
               for word in words):
            given.add(action.dest)
    return given


def _from_file(path: str, actions: Mapping[str, argparse.Action]) -> dict[str, tuple[Any, str]]:
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path!r} ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    values = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"{path}: unknown setting {key!r} (a flag name without its dashes)")
        values[dest] = (_value(action, value, f"{path}: {key}"), path)
    return values


def _from_environment(environ: Mapping[str, str],
                      actions: Mapping[str, argparse.Action]) -> dict[str, tuple[Any, str]]:
    values = {}
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            text = environ[name]
            value: Any = text
            if isinstance(action, argparse._AppendAction):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{name}: expected a JSON list ({exc.msg})") from None
            values[dest] = (_value(action, value, name), name)
    return values


def _value(action: argparse.Action, value: Any, source: str) -> Any:
    """``value`` as the flag's parser would give it; ConfigError naming ``source`` otherwise."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE + _FALSE:
            return text in _TRUE
        raise ConfigError(f"{source}: expected true or false, got {value!r}")
    if isinstance(action, argparse._AppendAction):  # a list: --l2's tables (or JSON texts), or typed items
        if not isinstance(value, list):
            raise ConfigError(f"{source}: expected a list")
        if action.type is None:
            return [item if isinstance(item, str) else json.dumps(item) for item in value]
        return [_typed(action, str(item), source) for item in value]
    text = value if isinstance(value, str) else str(value)
    if action.choices is not None and text not in action.choices:
        raise ConfigError(f"{source}: expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    if action.type is None:
        return text
    return _typed(action, text, source)


def _typed(action: argparse.Action, text: str, source: str) -> Any:
    try:
        return action.type(text)  # type: ignore[misc,operator]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
