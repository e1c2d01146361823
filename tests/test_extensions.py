"""Every optional C extension ``setup.py`` names is built where a C compiler and the Python headers exist (where
none exist, mpcache runs its pure-Python paths and the install only warns)."""

from __future__ import annotations

import ast
import importlib
import shutil
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _extensions() -> list[str]:
    """The module names of ``setup.py``'s ``Extension(...)`` calls."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    return [call.args[0].value for call in ast.walk(tree)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Extension"
            and isinstance(call.args[0], ast.Constant)]


def test_setup_names_the_extensions_its_sources_are():
    """Each name is its source's path (a name that matched no file would build nothing)."""
    names = _extensions()
    assert len(names) >= 6 and all((REPO / (name.replace(".", "/") + ".c")).is_file() for name in names)


@pytest.mark.parametrize("name", _extensions())
def test_the_extension_is_built_where_a_compiler_exists(name):
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not (shutil.which(compiler) and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()):
        pytest.skip("no C compiler or Python headers here: the pure-Python path is expected")
    importlib.import_module(name)  # ImportError fails the test
