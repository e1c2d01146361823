"""The optional C extensions ``setup.py`` builds, read from it (the tests that count or import them agree on one
reading)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def setup_extensions() -> list[str]:
    """The module names of ``setup.py``'s ``Extension(...)`` calls, in its order."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    return [call.args[0].value for call in ast.walk(tree)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Extension"
            and isinstance(call.args[0], ast.Constant)]
