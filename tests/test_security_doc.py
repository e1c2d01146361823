"""docs/SECURITY.md's promises each name the tests that hold them, and those tests exist: every promise (a
paragraph of the model, a bullet) ends with ``Held by `tests/…py::test_name`, …``, and each named file defines
that test.  The budgets it states are the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mpcache.cache import buffers
from mpcache.cache.lmcache import transfers

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "docs" / "SECURITY.md").read_text(encoding="utf-8")
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def _promises() -> list[str]:
    """Each bullet (``* **…**`` with its indented lines) and each paragraph of prose, past the overview; not
    headings, tables or one-line lead-ins (``…:``)."""
    blocks = [block for paragraph in re.split(r"\n\s*\n", DOC) for block in re.split(r"\n(?=\* )", paragraph.strip())]
    return [block for block in blocks if block and not block.startswith(("#", "|", "What mpcache protects"))
            and not ("\n" not in block and block.endswith(":"))]


def _defined(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_promise_names_the_tests_that_hold_it() -> None:
    promises = _promises()
    assert len(promises) >= 19, f"only {len(promises)} promises found: the parser lost some"
    unheld = [promise.splitlines()[0][:80] for promise in promises if "Held by" not in promise]
    assert [] == unheld


def test_every_named_test_exists() -> None:
    named = REFERENCE.findall(DOC)
    assert len(named) >= 40
    missing = [f"{path}::{name}" for path, name in named
               if not (REPO / path).is_file() or name not in _defined(path)]
    assert [] == missing


def test_the_budgets_it_states_are_the_codes() -> None:
    tib = 2**40
    stated = (f"registers at most {buffers.MAX_BUFFERS_PER_PEER} buffers of {buffers.MAX_PEER_BYTES // tib} TiB "
              f"together, and all connections of a cache process at most {buffers.MAX_BUFFERS:,}\n  buffers of "
              f"{buffers.MAX_BYTES // tib} TiB together")
    assert stated in DOC
    assert 4 == transfers.CONNECTION_SHARE
    assert "one\n  connection holds at most a quarter of L1's bytes" in DOC
