"""Shared-memory segments: ownership, permissions, cross-process bytes, leftovers."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import posix_ipc
import pytest

from mpcache.errors import LayoutMismatchError
from mpcache.shm.segment import Segment, shm_name

REPO = Path(__file__).resolve().parents[2]


def shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def test_created_with_mode_0600_even_under_permissive_umask(segment_factory):
    """A segment is private to its user (mode 0600) whatever the umask."""
    old = os.umask(0)
    try:
        segment = segment_factory(4096)
    finally:
        os.umask(old)

    assert 0o600 == stat.S_IMODE(os.stat(shm_path(segment.name)).st_mode)


def test_created_zero_filled_with_requested_size(segment_factory):
    """A new segment has exactly the requested size and holds only zeros."""
    segment = segment_factory(8192)

    assert (8192, bytes(8192)) == (segment.size, bytes(segment.buf))


def test_create_refuses_an_existing_name(segment_factory):
    """Creating a segment whose name exists fails instead of adopting someone else's memory."""
    segment = segment_factory(4096)

    with pytest.raises(posix_ipc.ExistentialError):
        Segment.create(segment.name, 4096)


def test_attach_missing_segment_is_a_layout_mismatch(segment_factory):
    """Attaching a name that does not exist raises LayoutMismatchError naming it."""
    name = segment_factory(4096).name + ".missing"

    with pytest.raises(LayoutMismatchError, match="does not exist"):
        Segment.attach(name)


def test_attach_too_small_is_a_layout_mismatch(segment_factory):
    """Attaching a segment smaller than the caller needs names both sizes."""
    segment = segment_factory(4096)

    with pytest.raises(LayoutMismatchError, match="is 4096 bytes, expected at least 8192"):
        Segment.attach(segment.name, 8192)


def test_attached_mapping_shares_bytes(segment_factory):
    """A second mapping of the same name sees the owner's writes and vice versa."""
    owner = segment_factory(4096)
    other = Segment.attach(owner.name)
    owner.buf[:5] = b"hello"
    other.buf[100:105] = b"world"
    seen = (bytes(other.buf[:5]), bytes(owner.buf[100:105]))
    other.close()

    assert (b"hello", b"world") == seen


def test_child_process_writes_parent_reads_exact_bytes(segment_factory):
    """A child process that attaches by name writes bytes the parent then reads exactly."""
    segment = segment_factory(4096)
    script = (
        "import sys\n"
        "from mpcache.shm.segment import Segment\n"
        "s = Segment.attach(sys.argv[1])\n"
        "s.buf[10:16] = bytes([1, 2, 3, 250, 251, 252])\n"
        "s.close()\n"
    )
    subprocess.run([sys.executable, "-c", script, segment.name], cwd=REPO, check=True, timeout=60)

    assert bytes([0, 1, 2, 3, 250, 251, 252, 0]) == bytes(segment.buf[9:17])


def test_unlink_reports_whether_the_name_existed(segment_factory):
    """unlink returns True the first time and False once the name is gone."""
    segment = segment_factory(4096)

    assert [True, False] == [Segment.unlink(segment.name), Segment.unlink(segment.name)]
    assert not os.path.exists(shm_path(segment.name))


def test_close_keeps_the_segment(segment_factory):
    """Closing a mapping leaves the segment for other processes; only unlink removes it."""
    segment = segment_factory(4096)
    segment.buf[:3] = b"abc"
    segment.close()
    again = Segment.attach(segment.name)
    content = bytes(again.buf[:3])
    again.close()

    assert b"abc" == content


def test_shm_name_starts_with_owner_pid():
    """Segment names are /mpcache.<owner pid>.<instance id, 8 chars>.<what>."""
    assert "/mpcache.4242.0123abcd.ring3" == shm_name(4242, "0123abcd-ffff-4444", "ring3")
