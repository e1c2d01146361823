"""Packaging: the ``bin/`` launchers pick an interpreter that has mpcache's dependencies (or say how to get
one), and the sdist and wheel carry the license, the entry points, every module and the C source.

The launcher tests run copies of the real ``bin/`` scripts in a throwaway checkout whose ``mpcache`` package
is a stub: its ``supervisor``/``logtail`` import a module that only the "good" interpreters have (standing in
for numpy, psutil, ...) and print the interpreter they run on, so every test sees which Python ran.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"start-cache": "supervisor", "mpcache-logs": "tools/logtail"}
INSTALL_HINT = "python3 -m venv .venv && .venv/bin/pip install -e ."
DEP = "mpcache_launcher_test_dependency"
STUB = f"""import os
import sys

import {DEP}


def main():
    print(sys.prefix)
    print(sys.argv[1:])
    print(sorted(name for name in os.environ if name.startswith("MPCACHE_")))
    return 0
"""


def make_venv(path: Path, with_dependency: bool) -> Path:
    """A pip-less venv (fast); with the stand-in dependency in its site-packages when asked."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True)
    if with_dependency:
        query = "import sysconfig; print(sysconfig.get_path('purelib'))"
        purelib = subprocess.run([str(path / "bin" / "python"), "-c", query],
                                 check=True, capture_output=True, text=True).stdout.strip()
        Path(purelib, f"{DEP}.py").write_text("")
    return path


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("venvs")
    return {"bare": make_venv(base / "bare", False), "good": make_venv(base / "good", True),
            "other": make_venv(base / "other", True)}


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A checkout with the real launchers and a stub package."""
    root = tmp_path / "checkout"
    (root / "bin").mkdir(parents=True)
    (root / "mpcache").mkdir()
    (root / "mpcache" / "__init__.py").write_text("")
    for script, module in SCRIPTS.items():
        shutil.copy2(REPO / "bin" / script, root / "bin" / script)
        (root / "mpcache" / module).parent.mkdir(exist_ok=True)
        (root / "mpcache" / module).parent.joinpath("__init__.py").write_text("")
        (root / "mpcache" / f"{module}.py").write_text(STUB)
    return root


def run(command: list[str], python3_on_path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run from a directory outside the checkout, with only ``python3_on_path``'s bin/ ahead of the system's."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "MPCACHE_"))}
    env["PATH"] = f"{python3_on_path / 'bin'}:/usr/bin:/bin"
    return subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)


def ran_on(result: subprocess.CompletedProcess) -> tuple[int, str, str, str]:
    """(exit status, the interpreter's sys.prefix resolved, argv, MPCACHE_* variables) as the stub printed them
    (stderr in their place when it printed nothing)."""
    lines = result.stdout.splitlines()
    if len(lines) != 3:
        return result.returncode, result.stderr, result.stdout, ""
    return result.returncode, os.path.realpath(lines[0]), lines[1], lines[2]


@pytest.mark.parametrize("script", SCRIPTS)
def test_launcher_run_as_a_program_prefers_the_checkouts_venv(script, venvs, checkout, tmp_path):
    """``bin/X`` run as a program uses the checkout's .venv/bin/python when it exists, although python3 on
    PATH is another interpreter, and passes the arguments on."""
    (checkout / ".venv").symlink_to(venvs["good"])
    result = run([str(checkout / "bin" / script), "--flag", "a b"], venvs["other"], tmp_path)
    assert (0, os.path.realpath(venvs["good"]), "['--flag', 'a b']", "[]") == ran_on(result)


@pytest.mark.parametrize("script", SCRIPTS)
def test_launcher_run_as_a_program_without_a_venv_uses_python3_on_path(script, venvs, checkout, tmp_path):
    """Without .venv, ``bin/X`` runs on python3 from PATH."""
    result = run([str(checkout / "bin" / script)], venvs["other"], tmp_path)
    assert (0, os.path.realpath(venvs["other"]), "[]", "[]") == ran_on(result)


@pytest.mark.parametrize("script", SCRIPTS)
def test_launcher_given_an_interpreter_with_the_dependencies_keeps_it(script, venvs, checkout, tmp_path):
    """``PYTHON bin/X`` keeps PYTHON when it can import the dependencies (a venv of pinned floors, say), even
    when the checkout's .venv exists (here a broken one)."""
    (checkout / ".venv").symlink_to(venvs["bare"])
    other = str(venvs["other"] / "bin" / "python")
    result = run([other, str(checkout / "bin" / script), "-x"], venvs["bare"], tmp_path)
    assert (0, os.path.realpath(venvs["other"]), "['-x']", "[]") == ran_on(result)


@pytest.mark.parametrize("script", SCRIPTS)
def test_launcher_given_an_interpreter_without_the_dependencies_moves_to_the_venv(script, venvs, checkout, tmp_path):
    """``PYTHON bin/X`` with a PYTHON that lacks a dependency re-executes on the checkout's .venv/bin/python,
    with the same arguments, and does not leave its re-exec marker in the environment."""
    (checkout / ".venv").symlink_to(venvs["good"])
    bare = str(venvs["bare"] / "bin" / "python")
    result = run([bare, str(checkout / "bin" / script), "-y"], venvs["bare"], tmp_path)
    assert (0, os.path.realpath(venvs["good"]), "['-y']", "[]") == ran_on(result)


@pytest.mark.parametrize("how", ["as a program", "with an interpreter"])
@pytest.mark.parametrize("venv", ["no .venv", "a broken .venv"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_launcher_without_any_interpreter_with_the_dependencies_says_how_to_install_them(
        script, venv, how, venvs, checkout, tmp_path):
    """No interpreter at hand can import the dependencies: one line on stderr, naming the missing module and
    the install command, nothing on stdout, exit status 2 (and no re-exec loop through a broken .venv)."""
    if venv == "a broken .venv":
        (checkout / ".venv").symlink_to(venvs["bare"])
    launcher = str(checkout / "bin" / script)
    result = run([launcher] if how == "as a program" else [str(venvs["bare"] / "bin" / "python"), launcher],
                 venvs["bare"], tmp_path)
    lines = result.stderr.splitlines()
    assert (2, "", 1, True, True) == (
        result.returncode, result.stdout, len(lines), lines[0].startswith(f"{script}: error: ") if lines else False,
        f"cannot import {DEP}" in result.stderr and f"cd {checkout} && {INSTALL_HINT}" in result.stderr), result.stderr


def test_launcher_does_not_hide_a_missing_module_of_mpcache_itself(venvs, checkout, tmp_path):
    """A module of mpcache that cannot be imported is a broken checkout, not a missing dependency: the
    ModuleNotFoundError propagates (traceback, exit status 1) instead of the install hint."""
    (checkout / ".venv").symlink_to(venvs["good"])
    (checkout / "mpcache" / "supervisor.py").write_text("import mpcache.no_such_module\n")
    result = run([str(checkout / "bin" / "start-cache")], venvs["other"], tmp_path)
    assert (1, True, False) == (result.returncode, "No module named 'mpcache.no_such_module'" in result.stderr,
                                INSTALL_HINT in result.stderr)


@pytest.mark.parametrize("script", SCRIPTS)
def test_real_launchers_answer_help_from_another_directory(script, tmp_path):
    """The real ``bin/start-cache`` and ``bin/mpcache-logs``, run with this interpreter from outside the
    checkout, print their usage."""
    result = subprocess.run([sys.executable, str(REPO / "bin" / script), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert (0, f"usage: {script}") == (result.returncode, result.stdout[:len(f"usage: {script}")]), result.stderr


# --- the sdist and the wheel -------------------------------------------------------------------------------------

def setuptools_floor() -> str:
    match = re.search(r'requires\s*=\s*\[[^\]]*"setuptools>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert match, "[build-system] requires names no setuptools>= floor"
    return match.group(1)


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def compiler_and_headers() -> bool:
    """Whether this interpreter can build the C extension: its C compiler and its Python.h exist."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.join(sysconfig.get_path("include"), "Python.h")
    return shutil.which(compiler) is not None and os.path.exists(headers)


def source_files() -> list[str]:
    """The files a build sees: tracked and untracked-but-not-ignored (git), else the tree minus the usual junk."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.split("\0")
        return [name for name in listed if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        junk = {"__pycache__", ".venv", "build", "dist", ".git", ".hypothesis", ".pytest_cache"}
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                and not junk & set(p.relative_to(REPO).parts) and not p.name.endswith((".so", ".egg-info"))]


# The first test to use `built` builds it: a backend install, the sdist and the wheel, 300 s each at most.
BUILT_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """An sdist built from a copy of the source tree, and a wheel built by ``pip wheel --no-deps`` from that
    sdist, unpacked (so the sdist alone must be enough to build, C extension included)."""
    work = tmp_path_factory.mktemp("build")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    floor = setuptools_floor()
    if version_tuple(version("setuptools")) < version_tuple(floor):
        # The build backend pip would put in an isolated build environment, installed once for both builds.
        backend = work / "backend"
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--target", str(backend), f"setuptools>={floor}"],
                             capture_output=True, text=True, timeout=300)
        if pip.returncode != 0:
            pytest.skip(f"could not install the build backend setuptools>={floor} (no network or package "
                        f"index?): {pip.stderr.strip().splitlines()[-1:]}")
        env["PYTHONPATH"] = str(backend)
    tree = work / "tree"
    for name in source_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tree / name)
    sdist_dir = work / "sdist"
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            "print(b.build_sdist(sys.argv[1]))", str(sdist_dir)],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    sdist_path = sdist_dir / sdist.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist_path) as archive:
        sdist_names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
        if hasattr(tarfile, "data_filter"):  # 3.12, and 3.10.12 / 3.11.4 on
            archive.extractall(work / "unpacked", filter="data")
        else:
            archive.extractall(work / "unpacked")
    unpacked = next((work / "unpacked").iterdir())
    wheel_dir = work / "wheel"
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                            "--no-build-isolation", "-w", str(wheel_dir), str(unpacked)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stdout[-3000:] + wheel.stderr[-3000:]
    (wheel_path,) = wheel_dir.glob("mpcache-*.whl")
    return {"sdist": sdist_names, "wheel": wheel_path, "work": work}


@pytest.mark.slow
@pytest.mark.timeout(BUILT_TIMEOUT_S)
def test_sdist_holds_what_a_build_needs(built):
    """The sdist holds pyproject.toml, setup.py, README.md (the long description), LICENSE, every file of
    the package (the C extension's source among them) and PKG-INFO."""
    package = {name for name in source_files() if name.startswith("mpcache/")}
    needed = {"pyproject.toml", "setup.py", "README.md", "LICENSE", "PKG-INFO", "mpcache/shm/_ringfast.c"} | package
    assert set() == needed - set(built["sdist"])


@pytest.mark.slow
@pytest.mark.timeout(BUILT_TIMEOUT_S)
def test_wheel_holds_license_entry_points_and_every_module(built):
    """The wheel's metadata says License-Expression Apache-2.0 and carries LICENSE byte for byte; its
    console scripts are start-cache, mpcache-logs and mpcache-report; it holds every module and data file of the package
    (py.typed, stubs, ... whatever the source has), and the compiled ring writer where a compiler and the
    Python headers exist."""
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        (dist_info,) = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
        scripts = configparser.ConfigParser()
        scripts.read_string(wheel.read(f"{dist_info}/entry_points.txt").decode())
        license_text = wheel.read(f"{dist_info}/licenses/LICENSE") if f"{dist_info}/licenses/LICENSE" in names else b""
    package = {name for name in source_files() if name.startswith("mpcache/") and not name.endswith(".c")}
    compiled = any(re.fullmatch(r"mpcache/shm/_ringfast\..*\.so", name) for name in names)
    assert ("Apache-2.0", (REPO / "LICENSE").read_bytes(), set(), True) == (
        dict(re.findall(r"^([\w-]+): (.*)$", metadata, re.M)).get("License-Expression"), license_text,
        package - names, compiled or not compiler_and_headers())
    assert {"start-cache": "mpcache.supervisor:main", "mpcache-logs": "mpcache.tools.logtail:main",
            "mpcache-report": "mpcache.tools.report:main"} == dict(scripts["console_scripts"])


@pytest.fixture(scope="module")
def installed(built) -> Path:
    """The wheel installed without its dependencies (they come from this interpreter) into a target directory."""
    target = built["work"] / "target"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--no-deps", "--no-index", "--target", str(target), str(built["wheel"])],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    return target


@pytest.mark.slow
@pytest.mark.timeout(BUILT_TIMEOUT_S)
def test_wheel_installed_elsewhere_runs_its_console_scripts(built, installed):
    """Installed into a target directory, the wheel's start-cache and mpcache-logs print their usage from outside
    the checkout, importing mpcache from the target."""
    target = installed
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import mpcache.supervisor as s; print(s.__file__)"],
                           cwd=target.parent, env=env, capture_output=True, text=True, timeout=60)
    helps = [subprocess.run([str(target / "bin" / script), "--help"], cwd=target.parent, env=env,
                            capture_output=True, text=True, timeout=60) for script in SCRIPTS]
    assert (str(target / "mpcache" / "supervisor" / "__init__.py"), [(0, f"usage: {s}") for s in SCRIPTS]) == (
        where.stdout.strip(), [(h.returncode, h.stdout[:len(f"usage: {s}")]) for h, s in zip(helps, SCRIPTS)])


# Imports every module of the installed package with the benchmarks made unimportable; a ``__main__`` (a program,
# run by importing it) is held to the modules it imports instead.
IMPORT_WITHOUT_BENCHMARKS = r'''
import ast, importlib, json, pathlib, sys
sys.modules["benchmarks"] = None  # absent, wherever it might be found: importing it raises ImportError
root = pathlib.Path(sys.argv[1])
failed, count = {}, 0
for path in sorted((root / "mpcache").rglob("*")):
    if path.suffix not in (".py", ".so"):
        continue
    name = ".".join(path.relative_to(root).parts).split(".cpython-")[0].removesuffix(".py").removesuffix(".__init__")
    names = [name]
    if path.name == "__main__.py":
        names = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0)
                 for a in (n.names if isinstance(n, ast.Import) else [None])]
    for module in names:
        count += 1
        try:
            loaded = importlib.import_module(module)
            assert not module.startswith("mpcache") or loaded.__file__.startswith(str(root)), loaded.__file__
        except BaseException as exc:
            failed[f"{name}: {module}"] = repr(exc)
print(json.dumps({"imported": count, "failed": failed}))
'''


@pytest.mark.slow
@pytest.mark.timeout(BUILT_TIMEOUT_S)
def test_wheel_holds_no_benchmark_and_every_module_imports_without_them(built, installed, tmp_path):
    """The benchmarks (top-level ``benchmarks/``) stay in the checkout: the wheel's only package is mpcache, nothing
    in it named bench; installed, every module of it imports (from the target, not the checkout) with the
    benchmarks absent."""
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    result = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_BENCHMARKS, str(installed)], cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=str(installed)), capture_output=True, text=True,
                            timeout=300)
    assert 0 == result.returncode, result.stderr[-3000:]
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert ({"mpcache"}, [], {}) == (top, [name for name in names if "bench" in name], imported["failed"])
    assert imported["imported"] >= len([n for n in names if n.endswith((".py", ".so")) and "__main__" not in n])


def test_changelog_newest_release_is_the_packages_version():
    """CHANGELOG.md (Keep a Changelog): an Unreleased section first, then the newest release, whose version is
    pyproject.toml's and whose date is an ISO date."""
    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\S+))?$", text, re.MULTILINE)
    project = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml")
                        .read_text(), re.MULTILINE).group(1)
    assert ("Unreleased", project, True) == (
        headings[0][0], headings[1][0], bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", headings[1][1])))
