"""The fs adapter: file layout, crash safety, restart, and storage errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.l2 import MAC_KEY, key, payload, wait

from mpcache.cache.l2.base import LoadResult, Usage, encode_record

REPO = Path(__file__).resolve().parents[2]
NS = 1_000_000_000  # nanoseconds per second


def chunk_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


def load_one(adapter, index, size=1000) -> tuple[LoadResult, bytes]:
    buffer = bytearray(b"\xee" * size)
    result = wait(adapter.submit_load([key(index)], [memoryview(buffer)]))
    return result, bytes(buffer)


def test_paths_are_hashes_never_user_strings(make_fs, tmp_path):
    """A chunk's file lives under the adapter's directory and its path contains no model or salt text."""
    adapter = make_fs()
    hostile = key(5, model="../../etc/passwd", salt="/tmp/salt")
    wait(adapter.submit_store([(hostile, payload(5))]))

    files = chunk_files(tmp_path / "l2")

    assert [os.path.relpath(adapter.file_path(hostile), tmp_path / "l2")] == files
    assert [] == [f for f in files if "passwd" in f or "salt" in f or ".." in f]


def directories(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_dir())


def test_a_directory_goes_with_its_last_chunk_and_a_restart_clears_empty_ones(make_fs, tmp_path):
    """Each (model, salt) has its directory, each of its hash prefixes another: a tier of 4 chunks storing under 200
    salts keeps the directories of the chunks it holds, not of every salt ever stored (they filled the disk's inodes,
    which evicting chunks then freed nothing of); a restart removes empty ones left behind (by an older version, or
    a crash between an eviction and its directory's removal)."""
    adapter = make_fs(capacity_bytes=4000)
    for number in range(200):
        wait(adapter.submit_store([(key(number, salt=f"tenant-{number}"), payload(number))]))
    held = chunk_files(tmp_path / "l2")
    assert 4 == len(held)
    expected = sorted({str(Path(path).parent) for path in held} | {str(Path(path).parent.parent) for path in held})
    assert expected == directories(tmp_path / "l2")
    adapter.close()
    left = tmp_path / "l2" / ("0" * 16) / "ab"
    left.mkdir(parents=True)
    make_fs(capacity_bytes=4000)
    assert expected == directories(tmp_path / "l2")


def test_a_truncated_file_is_never_loaded_and_is_removed(make_fs):
    """A chunk file cut short fails to load, is deleted, and is no longer reported present."""
    adapter = make_fs()
    wait(adapter.submit_store([(key(1), payload(1))]))
    path = adapter.file_path(key(1))
    os.truncate(path, os.path.getsize(path) - 300)

    result, destination = load_one(adapter, 1)

    assert (LoadResult([], [key(1)], [key(1)]), b"\xee" * 1000) == (result, destination)
    assert (False, [False]) == (os.path.exists(path), wait(adapter.lookup([key(1)])))
    assert (Usage(0, 4000, 0), {"integrity": 1}) == (adapter.get_usage(), adapter.failures.totals())


@pytest.mark.parametrize("position", [0, 20, 50, -1], ids=["magic", "payload_len", "name", "payload"])
def test_a_flipped_byte_is_never_loaded(make_fs, position):
    """A chunk file with one byte changed (header, name or payload) fails to load and is removed."""
    adapter = make_fs()
    wait(adapter.submit_store([(key(1), payload(1))]))
    path = adapter.file_path(key(1))
    data = bytearray(Path(path).read_bytes())
    data[position] ^= 0x40
    Path(path).write_bytes(data)

    result, destination = load_one(adapter, 1)

    assert (LoadResult([], [key(1)], [key(1)]), b"\xee" * 1000, False, {"integrity": 1}) == (
        result, destination, os.path.exists(path), adapter.failures.totals())


def test_another_chunks_record_at_a_keys_path_is_not_loaded(make_fs):
    """An intact record for another key, found at this key's path, is not loaded as this key."""
    adapter = make_fs()
    wait(adapter.submit_store([(key(1), payload(1)), (key(2), payload(2))]))
    shutil.copyfile(adapter.file_path(key(1)), adapter.file_path(key(2)))

    result, _ = load_one(adapter, 2)

    assert (LoadResult([], [key(2)], [key(2)]), {"integrity": 1}) == (result, adapter.failures.totals())


def test_a_stray_temp_file_is_ignored(make_fs, tmp_path):
    """A complete record left in a temp file (a crash before the rename) is neither indexed nor loaded."""
    first = make_fs()
    path = first.file_path(key(1))
    first.close()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(os.path.dirname(path), f".{os.path.basename(path)[:-6]}.deadbeef.tmp").write_bytes(
        encode_record(key(1), payload(1), MAC_KEY))

    adapter = make_fs()
    result, _ = load_one(adapter, 1)

    assert ([False], LoadResult([], [key(1)]), Usage(0, 4000, 0)) == (
        wait(adapter.lookup([key(1)])), result, adapter.get_usage())


def test_stale_temp_files_are_removed_at_start_and_fresh_ones_kept(make_fs, tmp_path):
    """Start-up deletes temp files older than stale_temp_s and leaves younger ones (a write may be in flight)."""
    root = tmp_path / "l2"
    (root / "ab").mkdir(parents=True)
    old, young = root / "ab" / ".old.1.tmp", root / "ab" / ".young.2.tmp"
    old.write_bytes(b"partial")
    young.write_bytes(b"partial")
    os.utime(old, ns=(0, 0))

    make_fs(stale_temp_s=60)

    assert ["ab/.young.2.tmp"] == chunk_files(root)


def test_restart_rebuilds_the_index_and_serves_hits(make_fs):
    """Re-opening the directory finds every chunk stored before: hits, byte-exact loads, same usage."""
    first = make_fs()
    wait(first.submit_store([(key(i), payload(i)) for i in (1, 2, 3)]))
    first.close()

    adapter = make_fs()
    buffers = [bytearray(1000) for _ in range(3)]
    result = wait(adapter.submit_load([key(1), key(2), key(3)], [memoryview(b) for b in buffers]))

    assert [True, True, True] == wait(adapter.lookup([key(1), key(2), key(3)]))
    assert LoadResult([key(1), key(2), key(3)], []) == result
    assert [payload(1), payload(2), payload(3)] == [bytes(b) for b in buffers]
    assert Usage(3000, 4000, 3) == adapter.get_usage()


def test_restart_orders_lru_by_mtime(make_fs):
    """After a restart the chunk with the oldest mtime is evicted first."""
    first = make_fs(capacity_bytes=3000)
    wait(first.submit_store([(key(i), payload(i)) for i in (1, 2, 3)]))
    for index, seconds in ((1, 300), (2, 100), (3, 200)):
        os.utime(first.file_path(key(index)), ns=(seconds * NS, seconds * NS))
    first.close()

    adapter = make_fs(capacity_bytes=3000)
    result = wait(adapter.submit_store([(key(4), payload(4)), (key(5), payload(5))]))

    assert [key(2), key(3)] == result.evicted


def test_restart_skips_files_cut_short(make_fs):
    """A chunk file whose size does not match its header is dropped by the start-up scan."""
    first = make_fs()
    wait(first.submit_store([(key(1), payload(1)), (key(2), payload(2))]))
    os.truncate(first.file_path(key(2)), 100)
    first.close()

    adapter = make_fs()

    assert ([True, False], Usage(1000, 4000, 1)) == (wait(adapter.lookup([key(1), key(2)])), adapter.get_usage())


def test_restart_with_a_smaller_capacity_drops_the_oldest(make_fs):
    """Re-opening with less capacity than the files found removes the least recently used ones."""
    first = make_fs(capacity_bytes=4000)
    wait(first.submit_store([(key(i), payload(i)) for i in (1, 2, 3)]))
    for index, seconds in ((1, 300), (2, 100), (3, 200)):
        os.utime(first.file_path(key(index)), ns=(seconds * NS, seconds * NS))
    first.close()

    adapter = make_fs(capacity_bytes=2000)

    assert [True, False, True] == wait(adapter.lookup([key(1), key(2), key(3)]))
    assert (False, Usage(2000, 2000, 2)) == (os.path.exists(adapter.file_path(key(2))), adapter.get_usage())


# -- storage errors, in a child process (root ignores file modes unless it drops its capabilities) ----

CHILD = r'''
import ctypes, json, os, resource, signal, sys
from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.contract.keys import ChunkKey

path, mode, old_hex, new_hex = sys.argv[1:5]
if mode == "unwritable" and os.geteuid() == 0:
    # capset(v3 header for this process, all-zero sets): no CAP_DAC_OVERRIDE, so file modes apply to root
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    if ctypes.CDLL(None, use_errno=True).capset(header, data) != 0:
        print(json.dumps({"skip": "cannot drop capabilities: " + os.strerror(ctypes.get_errno())}))
        sys.exit(0)
if mode == "unwritable":
    try:
        open(os.path.join(path, "probe"), "wb").close()
        print(json.dumps({"skip": "directory still writable after chmod"}))
        sys.exit(0)
    except OSError:
        pass
if mode == "full":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (500, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

adapter = FsL2Adapter(path, 10_000, mac_key=bytes(range(32)))
old, new = ChunkKey("model-a", "salt-a", 1), ChunkKey("model-a", "salt-a", 2)
stored = adapter.submit_store([(new, bytes.fromhex(new_hex)), (old, bytes.fromhex(old_hex))]).result(10)
again = adapter.submit_store([(new, bytes.fromhex(new_hex))]).result(10)
buffer = bytearray(len(bytes.fromhex(old_hex)))
loaded = adapter.submit_load([old, new], [memoryview(buffer), memoryview(bytearray(len(buffer)))]).result(10)
found = adapter.lookup([old, new]).result(10)
adapter.close()
names = lambda keys: [k.chunk_hash for k in keys]
print(json.dumps({"failed": names(stored.failed), "skipped": names(stored.skipped), "bytes": stored.bytes_written,
                  "failed_again": names(again.failed), "loaded": names(loaded.loaded),
                  "load_failed": names(loaded.failed), "data_ok": buffer.hex() == old_hex, "found": found}))
'''


def run_child(directory, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), mode, payload(1).hex(), payload(2).hex()],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert 0 == completed.returncode, completed.stderr[-3000:]
    outcome = json.loads(completed.stdout)
    if "skip" in outcome:
        pytest.skip(outcome["skip"])
    return outcome


EXPECTED_WHEN_WRITES_FAIL = {
    "failed": [2], "skipped": [1], "bytes": 0, "failed_again": [2],
    "loaded": [1], "load_failed": [2], "data_ok": True, "found": [True, False],
}


def test_an_unwritable_directory_fails_stores_and_still_serves_loads(make_fs, tmp_path):
    """In a read-only directory new chunks land in ``failed`` (no exception), present ones still load."""
    root = tmp_path / "l2"
    first = make_fs()
    wait(first.submit_store([(key(1), payload(1))]))
    first.close()
    directories = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for directory in directories:
        directory.chmod(0o555)
    try:
        outcome = run_child(root, "unwritable")
    finally:
        for directory in directories:
            directory.chmod(0o755)

    assert EXPECTED_WHEN_WRITES_FAIL == outcome


def test_a_full_disk_fails_stores_and_leaves_no_temp_files(make_fs, tmp_path):
    """When writes fail part-way (EFBIG standing in for ENOSPC), keys fail, no partial file remains, loads work."""
    root = tmp_path / "l2"
    first = make_fs()
    wait(first.submit_store([(key(1), payload(1))]))
    first.close()

    outcome = run_child(root, "full")

    assert EXPECTED_WHEN_WRITES_FAIL == outcome
    assert [os.path.relpath(first.file_path(key(1)), root)] == chunk_files(root)
