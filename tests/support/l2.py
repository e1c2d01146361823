"""Keys, payloads and a bounded wait shared by the L2 tests (``support.l2``)."""

from __future__ import annotations

import pwd
import subprocess
from concurrent.futures import Future

from mpcache.contract.keys import ChunkKey

TIMEOUT_S = 10.0  # the most any future in these tests may take
MAC_KEY = bytes(range(32))  # the L2 record key the tests' adapters use (a deployment's, in production)


def key(index: int, model: str = "model-a", salt: str = "salt-a") -> ChunkKey:
    """The ``index``-th test key (chunk_hash = index)."""
    return ChunkKey(model, salt, index)


def payload(index: int, size: int = 1000) -> bytes:
    """``size`` bytes that differ for every index and at every position."""
    return bytes((index * 131 + position * 7 + (position >> 8)) & 0xFF for position in range(size))


def wait(future: Future):
    """The future's result, failing the test (not hanging it) after :data:`TIMEOUT_S`."""
    return future.result(timeout=TIMEOUT_S)


class OtherUser:
    """A second local user (the ``other_user`` fixture): runs commands as itself."""

    def __init__(self, entry: pwd.struct_passwd) -> None:
        self.name = entry.pw_name
        self.uid = entry.pw_uid
        self.gid = entry.pw_gid

    def run(self, *argv: str) -> str:
        """Run ``argv`` as this user (setpriv, from ``/``); its stdout.  Fails the test if it fails."""
        completed = subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", *argv],
                                   cwd="/", capture_output=True, text=True, timeout=30)
        assert 0 == completed.returncode, f"{argv} as {self.name}: {completed.stderr}"
        return completed.stdout
