"""docs/PROTOCOL.md is generated from the operation table and kept current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mpcache.cache.native.ops import OPERATIONS, doc

REPO = Path(__file__).resolve().parents[2]


def test_committed_protocol_reference_is_current():
    """docs/PROTOCOL.md is exactly what ``python -m mpcache.cache.native.ops.doc --markdown`` prints (regenerate
    it after changing an operation's fields, replies, events or docstring)."""
    assert doc.render_markdown() == (REPO / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")


def test_every_operation_and_field_is_described():
    """Every operation has a section, and every field type and field name has an entry in PROTOCOL.md."""
    text = doc.render_markdown()
    fields = [(name, check) for op in OPERATIONS.values() for name, check, _ in op.fields]

    assert [op for op in OPERATIONS if f"### `{op}`" not in text] == []
    assert [name for name, check in fields if name not in doc.FIELDS or check not in doc.TYPES] == []
    assert [op for op in OPERATIONS.values() if not (op.handler.__doc__ or "").strip()] == []


def test_the_command_prints_the_reference():
    """The module's command line prints the same text (what the file is regenerated with)."""
    result = subprocess.run([sys.executable, "-m", "mpcache.cache.native.ops.doc", "--markdown"], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert (0, doc.render_markdown()) == (result.returncode, result.stdout)
