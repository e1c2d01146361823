"""Every optional C extension ``setup.py`` names is built where a C compiler and the Python headers exist (where
none exist, mpcache runs its pure-Python paths and the install only warns)."""

from __future__ import annotations

import importlib
import shutil
import sysconfig
from pathlib import Path

import pytest
from support.extensions import REPO, setup_extensions


def test_setup_names_the_extensions_its_sources_are():
    """Each name is its source's path (a name that matched no file would build nothing)."""
    names = setup_extensions()
    assert len(names) >= 6 and all((REPO / (name.replace(".", "/") + ".c")).is_file() for name in names)


@pytest.mark.parametrize("name", setup_extensions())
def test_the_extension_is_built_where_a_compiler_exists(name):
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not (shutil.which(compiler) and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()):
        pytest.skip("no C compiler or Python headers here: the pure-Python path is expected")
    importlib.import_module(name)  # ImportError fails the test
