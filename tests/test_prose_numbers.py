"""Numbers and names the documents quote agree with the code they describe: the C extensions setup.py builds,
the key cache's candidates and bound, the pump's sleep bounds and batch target, and every code name
docs/ARCHITECTURE.md cites."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

from mpcache.cache.lmcache import keycache
from mpcache.telemetry import pump

REPO = Path(__file__).resolve().parents[1]
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
# Names ARCHITECTURE.md cites that are not ours: the CUDA driver call it explains avoiding.
FOREIGN_NAMES = {"cudaLaunchHostFunc"}


def _text(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def test_the_readme_and_development_guide_count_the_c_extensions_setup_py_builds():
    built = len(re.findall(r"\bExtension\(", _text("setup.py")))
    claims = [re.search(r"compiles (\w+) small C extensions", _text(name)) for name in ("README.md",
                                                                                       "docs/DEVELOPMENT.md")]
    assert [NUMBER_WORDS[built]] * 2 == [claim.group(1) if claim else None for claim in claims]


def _duration(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"ms": 1e-3, "s": 1.0}[unit]


def test_the_architecture_gives_the_pumps_sleep_bounds_and_batch_target_of_the_code():
    defaults = inspect.signature(pump.Pump.run).parameters
    expected = (defaults["min_sleep_s"].default, pump.MAX_SLEEP_S, defaults["target_batch"].default)
    claims = re.findall(r"about (\d+) Ki records to\s+accumulate at the rate it just saw \((\d+ m?s) … (\d+ m?s)\)",
                        _text("docs/ARCHITECTURE.md"))
    assert len(claims) == 2
    assert all((_duration(low), _duration(high), int(target) * 1024) == expected for target, low, high in claims)


def test_every_code_name_the_architecture_cites_exists_in_the_repository():
    """A backticked snake_case or CamelCase name in docs/ARCHITECTURE.md is a word of some tracked source file."""
    names = {name.removesuffix("()").rsplit(".", 1)[-1]
             for name in re.findall(r"`([A-Za-z_][A-Za-z_0-9.]*(?:\(\))?)`", _text("docs/ARCHITECTURE.md"))}
    code_like = {name for name in names if "_" in name.strip("_") or re.search(r"[a-z][A-Z]", name)}
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.c", "*.pyi", "*.sh", "*.toml", "*.yaml", "*.yml"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    words = set()
    for path in tracked:
        words |= set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", (REPO / path).read_text(encoding="utf-8",
                                                                                    errors="replace")))
    assert sorted(code_like - words - FOREIGN_NAMES) == []


def test_the_key_caches_candidates_and_bound_are_the_codes_where_the_docs_give_them():
    """ARCHITECTURE.md and SECURITY.md give how many token lists the scanner is handed and the one bound."""
    for name in ("docs/ARCHITECTURE.md", "docs/SECURITY.md"):
        text = " ".join(_text(name).split())
        assert re.findall(r"the (\w+) most recently used token lists", text) == [NUMBER_WORDS[keycache.CANDIDATES]]
        assert re.findall(r"(\d+) MiB[,.]? (?:charged|in all)", text) == [str(keycache.MAX_BYTES >> 20)]
