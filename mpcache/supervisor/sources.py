"""Where start-cache's settings come from: a TOML file, ``MPCACHE_*`` environment variables, flags, the
defaults; later sources win (default < file < environment < command line), then the derived defaults apply.

Every value goes through its setting's kind, so a bad one is one line naming the setting and where it came
from; an unknown TOML key or ``MPCACHE_*`` variable is one line naming the nearest valid one.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from mpcache.config import ENV_PREFIX, FOREIGN_PREFIXES, OTHER_VARIABLES, SETTINGS, Setting
from mpcache.errors import ConfigError

BY_NAME = {item.name: item for item in SETTINGS}
_BY_ENV = {item.env: item for item in SETTINGS}
# a URL's password: up to the last "@" before the path, as redis-py reads it ("redis://:p@ss@host" is "p@ss")
_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/\s]*@")
MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few kB: more is not one


@dataclass(frozen=True)
class Resolved:
    """Every setting's value (by name) and where it came from: "flag --NAME", "environment NAME",
    "file PATH", "default", or the label a derived default gives."""

    values: dict[str, Any]
    sources: dict[str, str]
    check_only: bool = False  # --check-config: print them, start nothing

    def config_fields(self) -> dict[str, Any]:
        """The values as :class:`~mpcache.config.Config`'s keyword arguments."""
        return {BY_NAME[name].field: value for name, value in self.values.items()}


def _suggestion(word: str, choices: list[str], quote: bool) -> str:
    """"did you mean X?" for the nearest of ``choices``, or where to look when none is near."""
    near = difflib.get_close_matches(word, choices, n=1)
    if not near:
        return "none is close: start-cache --help lists them"
    return f"did you mean {near[0]!r}?" if quote else f"did you mean {near[0]}?"


def _given(item: Setting, raw: object, where: str) -> Any:
    """``raw`` as ``item``'s value; ConfigError naming ``where`` otherwise."""
    try:
        return item.kind.value(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _why_untrusted(path: str, info: os.stat_result) -> str | None:
    """Why ``path`` (a settings file or a directory above it, as ``info`` describes it) could have been
    written by someone other than root and the service's uid, or None.  As sshd's StrictModes: owned by
    root or the service's uid and writable by no one else; a directory writable by others passes only
    with the sticky bit (like /tmp: no one else can replace what is in it), and anything on a read-only
    mount passes (no one can change it: a Kubernetes ConfigMap's 0777 volume directory)."""
    uid = os.geteuid()
    if info.st_uid not in (0, uid):
        return f"{path} belongs to uid {info.st_uid}, not to root or the service's uid {uid}"
    if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return None
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return None
    return f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"


def _check_trusted(path: str, real: str, fd: int) -> None:
    """ConfigError naming the first of the file (open as ``fd``, at ``real``, ``path`` resolved) and the
    directories above it that someone other than root and the service's uid could have written."""
    reason = _why_untrusted(real, os.fstat(fd))
    directory = real
    while reason is None and directory != os.sep:
        directory = os.path.dirname(directory)
        reason = _why_untrusted(directory, os.stat(directory))
    if reason is not None:
        raise ConfigError(f"--config: refusing {path!r}: {reason} (a settings file and every directory above "
                          "it must belong to root or the service's uid and be writable by no one else: fix "
                          "their owner and mode, or move the file)")


def _read_settings_file(path: str) -> str:
    """The text of the regular file ``path`` (a symlink resolved, the target checked): opened without
    blocking (a FIFO waits for a writer for ever), trusted only as :func:`_check_trusted` says, at most
    MAX_CONFIG_BYTES read (/dev/zero never ends), UTF-8 as TOML requires; ConfigError otherwise."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path!r} ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory itself
        os.close(fd)
        raise ConfigError(f"--config: cannot read {path!r} (not a regular file)")
    with os.fdopen(fd, "rb") as handle:
        _check_trusted(path, real, fd)
        try:
            data = handle.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"--config: cannot read {path!r} ({exc.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config: cannot read {path!r} (larger than {MAX_CONFIG_BYTES} bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config: cannot read {path!r} (not UTF-8: byte {exc.start})") from None


def from_file(path: str) -> dict[str, Any]:
    """The settings a TOML file gives, by name (its keys are the names; "_" for "-" is accepted too)."""
    text = _read_settings_file(path)  # its ConfigError is a ValueError: read outside the parse's handlers
    shown = path if path.isprintable() else repr(path)  # as the errors below name it: no terminal escape in it
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {shown}: not valid TOML ({exc})") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"--config {shown}: not valid TOML ({str(exc).partition(';')[0]})") from None
    except RecursionError:
        raise ConfigError(f"--config {shown}: not valid TOML (arrays or tables nested too deeply)") from None
    values = {}
    for key, raw in table.items():
        item = BY_NAME.get(key.replace("_", "-"))
        if item is None:
            raise ConfigError(f"{shown}: unknown setting {key!r} (a flag name without its dashes; "
                              f"{_suggestion(key, list(BY_NAME), quote=True)})")
        if item.name in values:  # l1_size and l1-size: TOML sees two keys, the file one setting twice
            raise ConfigError(f"{shown}: {key!r} sets {item.name!r} a second time")
        values[item.name] = _given(item, raw, f"{shown}: {key}")
    return values


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``MPCACHE_*`` variables give, by name (a repeatable setting's: a JSON list)."""
    values = {}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in OTHER_VARIABLES or name.startswith(FOREIGN_PREFIXES):
            continue
        item = _BY_ENV.get(name)
        if item is None:
            raise ConfigError(f"{name}: not a setting of start-cache "
                              f"({_suggestion(name, [*_BY_ENV, *OTHER_VARIABLES], quote=False)})")
        values[item.name] = _given(item, environ[name], name)
    return values


def resolve(flags: Mapping[str, Any], config_file: str, environ: Mapping[str, str]) -> Resolved:
    """Every setting from ``flags`` (the command line's checked values, by name), ``environ`` and the TOML
    file ``config_file`` (none: ""), else its default; then the derived defaults."""
    layers = [("default", {item.name: item.default for item in SETTINGS})]
    if config_file:
        layers.append((f"file {config_file}", from_file(config_file)))
    layers.append(("environment", from_environment(environ)))
    layers.append(("flag", dict(flags)))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for origin, layer in layers:
        for name, value in layer.items():
            if origin != "default" and value == "" and BY_NAME[name].kind.blank_is_default:
                continue  # an empty value: the default applies
            values[name] = value
            sources[name] = {"environment": f"environment {BY_NAME[name].env}",
                             "flag": f"flag {BY_NAME[name].flag}"}.get(origin, origin)
    for item in SETTINGS:
        if item.derive is not None:
            derived = item.derive(values[item.name], sources[item.name] != "default", values, environ)
            if derived is not None:
                values[item.name], sources[item.name] = derived
    return Resolved(values, sources)


def where(resolved: Resolved | None, message: str) -> str:
    """``message`` (which names a flag first) with where that setting came from, when not a flag or default."""
    flag = message.split(":", 1)[0].split("/", 1)[0]
    source = resolved.sources.get(flag.removeprefix("--"), "") if resolved is not None else ""
    return message if source.startswith(("flag", "default")) or not source else f"{message} (set in {source})"


def _toml(value: Any) -> str:
    """``value`` as a TOML value (strings with any password in a URL hidden)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(_URL_PASSWORD.sub(r"\1(hidden)@", value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml(entry) for entry in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(str(key))} = {_toml(entry)}" for key, entry in value.items()) + "}"
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string in ASCII (JSON's escapes would write a character beyond U+FFFF as a
    surrogate pair, which TOML refuses)."""
    return '"' + "".join(_toml_char(char) for char in text) + '"'


def _toml_char(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if " " <= char <= "~":
        return char
    return f"\\u{ord(char):04X}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08X}"


def describe(resolved: Resolved) -> list[str]:
    """One line per setting, as TOML a file could hold, each with where its value came from."""
    lines = [(f"{name} = {_toml(resolved.values[name])}", resolved.sources[name]) for name in BY_NAME]
    width = max(len(text) for text, _ in lines)
    return [f"{text.ljust(width)}  # {source}" for text, source in lines]
