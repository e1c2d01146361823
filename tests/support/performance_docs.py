"""The repository's performance pages, which tests compare with the raw results they were written from."""

from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# small counts as prose writes them
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def doc(page: str) -> str:
    """A page of the repository's docs/."""
    with open(os.path.join(REPO, "docs", page), encoding="utf-8") as handle:
        return handle.read()


def flattened(text: str) -> str:
    """``text`` with every run of whitespace one space: a page's sentences as tests look for them, whatever line
    breaks fall inside."""
    return " ".join(text.split())


def raw_results() -> dict:
    """docs/PERFORMANCE.json: the raw results the tables and prose of docs/PERFORMANCE.md are read from."""
    return json.loads(doc("PERFORMANCE.json"))


def history() -> str:
    """benchmarks/HISTORY.md, the lab notes."""
    with open(os.path.join(REPO, "benchmarks", "HISTORY.md"), encoding="utf-8") as handle:
        return handle.read()
