"""A second local user for tests that need a peer of another uid: a throwaway system account, and a way to
run a Python module of tests/ as that user (its own uid and gid, no supplementary groups, cwd ``/``) with
this venv's packages importable.

``throwaway_user()`` needs root and ``useradd``; otherwise it raises :class:`Unavailable` with the reason,
which a fixture turns into ``pytest.skip``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: support.* importable


class Unavailable(Exception):
    """No second user can be made here (not root, or no useradd); the message says why."""


def _others_can_run(path: str) -> bool:
    """Every directory above ``path`` searchable and the file executable by any user (mode bits only)."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for depth in range(1, len(parts)):
        directory = os.sep.join(parts[:depth]) or os.sep
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(real).st_mode & stat.S_IXOTH)


def interpreter_for_others() -> tuple[str, list[str]]:
    """A Python another user can run with this venv's packages: this interpreter if it can, else the
    system's of the same minor version with this venv's site-packages on ``PYTHONPATH`` (a pyenv Python
    under a 0700 ``/root`` cannot be run by anyone else); :class:`Unavailable` if neither."""
    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    if _others_can_run(sys.executable):
        return sys.executable, []
    version = sysconfig.get_python_version()
    for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.path.exists(candidate) and _others_can_run(candidate):
            return candidate, paths
    raise Unavailable(f"no Python {version} that another user can run: {os.path.realpath(sys.executable)} "
                      "is not reachable for others and there is no system python of that version")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def popen(self, module: str, *args: str, **kwargs) -> subprocess.Popen:
        """``python -m module args…`` from this interpreter's venv, as this user, with tests/ importable."""
        python, packages = interpreter_for_others()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/",
               "PYTHONPATH": os.pathsep.join([TESTS_DIR, *packages]), "PYTHONDONTWRITEBYTECODE": "1",
               "LANG": "C.UTF-8"}
        options = dict(cwd="/", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
        options.update(kwargs)
        return subprocess.Popen([python, "-m", module, *args], user=self.uid, group=self.gid,
                                extra_groups=[], **options)


@contextmanager
def throwaway_user() -> Iterator[User]:
    """Create ``mpcache-test-<random>`` (system account, no home, nologin shell); remove it afterwards."""
    if os.geteuid() != 0:
        raise Unavailable(f"a second local user needs root (useradd); running as uid {os.geteuid()}")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if useradd is None or userdel is None:
        raise Unavailable("useradd/userdel are not installed")
    interpreter_for_others()  # or Unavailable, before an account is made
    name = f"mpcache-test-{secrets.token_hex(4)}"
    made = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise Unavailable(f"useradd {name} failed: {made.stderr.strip()}")
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run([userdel, name], capture_output=True)
