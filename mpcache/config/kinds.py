"""The kinds of value a setting takes: each turns what a flag, an ``MPCACHE_*`` variable or a TOML key gives
(text, or a TOML scalar) into the setting's value, and says what it expects when it cannot.

One kind checks a setting everywhere: while a flag, variable or file is read (``value``) and again when a
:class:`~mpcache.config.Config` is built from JSON or by code (``problem``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from mpcache.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_size(text: str, flag: str) -> int:
    """'256MiB', '1GB', '4096' → bytes; ConfigError naming ``flag`` otherwise."""
    match = _SIZE_RE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    number = float(match.group(1)) * _UNITS[unit] if match and unit in _UNITS else math.inf
    if not math.isfinite(number):  # no such text, or more digits than a float holds
        raise ConfigError(f"{flag}: expected a size such as 512MiB, 2GB or 1048576, got {text!r}")
    return int(number)


def _text(raw: object) -> str:
    """A TOML scalar as the flag's text would be (``workers = 4`` reads as ``--workers 4``)."""
    return raw if isinstance(raw, str) else str(raw)


SHOWN_CHARACTERS = 80  # of a refused value, in its error line: a value of any length keeps the line short


def _shown(raw: object) -> str:
    """``raw`` as its error line quotes it: repr, cut to SHOWN_CHARACTERS with how long it was."""
    value = raw if isinstance(raw, (dict, list)) else _text(raw)
    shown = repr(value)
    if len(shown) <= SHOWN_CHARACTERS:
        return shown
    return f"{shown[:SHOWN_CHARACTERS - 3]}... ({len(value if isinstance(value, str) else shown):,} characters)"


class Kind:
    """What a setting's values are; subclasses say how text becomes one and which ones are acceptable."""

    expected = "a value"
    blank_is_default = False  # an empty text means "not given": the default (or its derivation) applies

    def convert(self, raw: object) -> Any:
        """``raw`` (text or a TOML value) → a value; ValueError when it is not one at all."""
        return _text(raw)

    def problem(self, value: Any) -> str | None:
        """None when ``value`` is acceptable, else what is expected ("expected ...")."""
        return None

    def value(self, raw: object) -> Any:
        """``raw`` → an acceptable value; ValueError("expected ..., got ...") otherwise."""
        if self.blank_is_default and raw == "":
            return ""
        try:
            value = self.convert(raw)
        except (TypeError, ValueError):  # ConfigError (a bad size) is a ValueError too
            raise ValueError(f"expected {self.expected}, got {_shown(raw)}") from None
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(f"{problem}, got {_shown(raw)}")
        return value


@dataclass(frozen=True)
class Text(Kind):
    pattern: str = ""
    description: str = "text"
    blank_is_default: bool = False

    @property
    def expected(self) -> str:  # type: ignore[override]
        return self.description

    def convert(self, raw: object) -> Any:
        """Text, or a TOML number as its digits (``instance-id = 12``); an array, table, boolean or date is
        refused, not turned into its Python repr."""
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise ValueError(raw)
        return _text(raw)

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, str) or (self.pattern and not re.fullmatch(self.pattern, value)):
            return f"expected {self.description}"
        return None


@dataclass(frozen=True)
class Choice(Kind):
    options: tuple[str, ...]

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(self.options)

    def problem(self, value: Any) -> str | None:
        return None if value in self.options else f"expected {self.expected}"


class Switch(Kind):
    """On or off: a flag without a value; true/false, yes/no, on/off or 1/0 in the environment or a file."""

    expected = "true or false"

    def convert(self, raw: object) -> Any:
        if isinstance(raw, bool):
            return raw
        text = _text(raw).strip().lower()
        if text not in _TRUE + _FALSE:
            raise ValueError(text)
        return text in _TRUE

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, bool) else f"expected {self.expected}"


@dataclass(frozen=True)
class Integer(Kind):
    low: int = 0
    high: int | None = None
    power_of_two: bool = False

    @property
    def expected(self) -> str:  # type: ignore[override]
        noun = "a power of two" if self.power_of_two else "an integer"
        return f"{noun} >= {self.low}" if self.high is None else f"{noun} {self.low}..{self.high}"

    def convert(self, raw: object) -> Any:
        return int(_text(raw))

    def problem(self, value: Any) -> str | None:
        ok = (type(value) is int and value >= self.low and (self.high is None or value <= self.high)
              and (not self.power_of_two or not value & (value - 1)))
        return None if ok else f"expected {self.expected}"


@dataclass(frozen=True)
class Number(Kind):
    """A float between ``low`` and ``high`` (each bound open or closed; ``high`` may be infinity)."""

    low: float = 0.0
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    noun: str = "a number"

    @property
    def expected(self) -> str:  # type: ignore[override]
        bound = f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high == math.inf:
            return f"{self.noun} {bound}" if not self.high_open else f"finite {self.noun.removeprefix('a ')} {bound}"
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{self.noun} in {opening}{self.low:g}, {self.high:g}{closing}"

    def convert(self, raw: object) -> Any:
        return float(_text(raw))

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected {self.expected}"
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return None if above and below else f"expected {self.expected}"


@dataclass(frozen=True)
class Seconds(Number):
    noun: str = "seconds"


@dataclass(frozen=True)
class OffOrSeconds(Seconds):
    """0 (off), or seconds within the bounds: a value just above 0 would be a mistake, not a setting."""

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"0 (off) or {super().expected}"

    def problem(self, value: Any) -> str | None:
        off = type(value) in (int, float) and value == 0
        return None if off else super().problem(value)


@dataclass(frozen=True)
class Size(Kind):
    """Bytes, given as 512MiB, 2GB or 1048576."""

    low: int = 0
    blank_is_default: bool = False

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"a {'positive ' if self.low == 1 else ''}size such as 512MiB, 2GB or 1048576" + (
            f" (at least {self.low} bytes)" if self.low > 1 else "")

    def convert(self, raw: object) -> Any:
        return parse_size(_text(raw), "")

    def problem(self, value: Any) -> str | None:
        return None if type(value) is int and value >= self.low else f"expected {self.expected}"


class Port(Integer):
    def __init__(self) -> None:
        super().__init__(0, 65535)

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "a port number 0..65535"


class JsonObject(Kind):
    """A JSON object: one flag value's text, or a TOML table; what its keys mean is its reader's business.
    A bad one is not echoed in the error: it may hold a password (a redis URL's)."""

    expected = "a JSON object"

    def value(self, raw: object) -> Any:
        try:
            value = raw if isinstance(raw, dict) else json.loads(_text(raw))
        except json.JSONDecodeError as exc:
            raise ValueError(f"expected {self.expected}, got text that is not JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"expected {self.expected}, got JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise ValueError(f"expected {self.expected}, got a JSON {type(value).__name__}")
        return value

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, dict) else f"expected {self.expected}"


@dataclass(frozen=True)
class Repeated(Kind):
    """A list: the flag repeated, a TOML array, or a JSON list in the environment; each entry one ``item``."""

    item: Kind

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"a list, each entry {self.item.expected}"

    def value(self, raw: object) -> list[Any]:
        """A TOML array or an environment variable's JSON list → the checked entries."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"expected a JSON list ({exc.msg})") from None
            except RecursionError:
                raise ValueError("expected a JSON list, got one nested too deeply") from None
        if not isinstance(raw, list):
            raise ValueError("expected a list")
        return [self.item.value(entry) for entry in raw]

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, list) or any(self.item.problem(entry) for entry in value):
            return f"expected {self.expected}"
        return None
