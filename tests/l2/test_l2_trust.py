"""L2 trust: records are MAC'd with the deployment's key, so another writer cannot forge them; the fs tier
refuses directories others control and never follows links; the key comes from a checked secret file.

Forged records are built here by hand from the documented layout (not with the code under test): magic,
version, name lengths, chunk hash, payload length, a 16-byte check value, names, payload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from support.l2 import MAC_KEY, key, payload, wait

from mpcache.cache.l2.base import LoadResult, key_digest
from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.cache.l2.trust import FS_SECRET_NAME, SECRET_FILE_ENV, resolve_l2_key
from mpcache.config import Config
from mpcache.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
ATTACKER_KEY = b"\xa5" * 32
EVIL = b"EVIL" * 250  # what the attacker wants the victim to load (1000 bytes, a chunk's size here)


def forged_record(chunk_key, data: bytes, *, version: int = 2, mac_key: bytes | None = None) -> bytes:
    """A well-formed record of ``chunk_key``: its check value blake2b-128 unkeyed (the old checksum), or keyed
    with ``mac_key`` (someone else's key)."""
    model, salt = chunk_key.model_name.encode(), chunk_key.cache_salt.encode()
    fixed = struct.pack("<4sHHHxxQQ", b"MPL2", version, len(model), len(salt), chunk_key.chunk_hash, len(data))
    check = hashlib.blake2b(fixed + model + salt + data, digest_size=16, key=mac_key or b"").digest()
    return fixed + check + model + salt + data


FORGERIES = {
    "v1_unkeyed_checksum": dict(version=1),  # a record as the previous release wrote it
    "v2_unkeyed_checksum": dict(version=2),  # today's layout, checksum computed without the key
    "v2_another_key": dict(version=2, mac_key=ATTACKER_KEY),  # a writer with its own key
}


def our_record_bytes(chunk_key, data: bytes) -> bytes:
    """What our adapters write (the documented layout, keyed with MAC_KEY), built independently."""
    return forged_record(chunk_key, data, version=2, mac_key=MAC_KEY)


# -- forged records: redis -------------------------------------------------------------------------------


def plant_in_redis(client: redis.Redis, prefix: str, chunk_key, record: bytes) -> None:
    """What a second client of the server can do: write a value and the index entries that make it a hit."""
    digest = key_digest(chunk_key)
    client.set(f"{prefix}c:{digest}", record)
    client.zadd(f"{prefix}lru", {digest: 1})
    client.hset(f"{prefix}size", digest, 1000)
    client.hincrby(f"{prefix}stats", "used", 1000)


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_forged_redis_record_is_a_miss_not_the_attackers_bytes(make_redis, redis_server, redis_prefix, forgery):
    """A second writer plants a well-formed record (valid unkeyed checksum, or MAC'd with its own key) for a
    key the victim looks up: the load fails (rejected, counted as an integrity failure), the destination keeps
    its bytes, and the value is gone from the server."""
    victim = make_redis()
    attacker = redis.Redis.from_url(redis_server)
    plant_in_redis(attacker, redis_prefix, key(1), forged_record(key(1), EVIL, **forgery))

    destination = bytearray(b"\xee" * 1000)
    result = wait(victim.submit_load([key(1)], [memoryview(destination)]))

    assert (LoadResult([], [key(1)], [key(1)]), b"\xee" * 1000) == (result, bytes(destination))
    assert {"integrity": 1} == victim.failures.totals()
    assert (None, [False]) == (attacker.get(f"{redis_prefix}c:{key_digest(key(1))}"), wait(victim.lookup([key(1)])))


def test_a_writer_with_another_key_on_the_same_prefix_cannot_feed_the_victim(make_redis):
    """Two deployments share a server and prefix but not the key: what the other stores is a miss for us
    (its record is rejected and dropped), and our own store of the chunk afterwards loads our bytes."""
    victim, other = make_redis(), make_redis(mac_key=ATTACKER_KEY)
    wait(other.submit_store([(key(1), EVIL)]))

    first = wait(victim.submit_load([key(1)], [memoryview(bytearray(1000))]))
    wait(victim.submit_store([(key(1), payload(1))]))
    mine = bytearray(1000)
    second = wait(victim.submit_load([key(1)], [memoryview(mine)]))

    assert (LoadResult([], [key(1)], [key(1)]), LoadResult([key(1)]), payload(1)) == (first, second, bytes(mine))


def test_redis_values_are_records_keyed_with_the_deployments_key(make_redis, redis_server, redis_prefix):
    """The bytes on the server are exactly the documented record MAC'd with our key (computed here)."""
    wait(make_redis().submit_store([(key(1), payload(1))]))

    value = redis.Redis.from_url(redis_server).get(f"{redis_prefix}c:{key_digest(key(1))}")

    assert our_record_bytes(key(1), payload(1)) == value


# -- forged records: fs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_planted_fs_file_is_a_miss_not_the_attackers_bytes(make_fs, forgery):
    """A record planted at a chunk's path (a writer without the key, or one from before the key) is never
    loaded: planted before start-up it fails its load and is removed; planted while running it is not even
    indexed."""
    first = make_fs()
    early, late = first.file_path(key(1)), first.file_path(key(2))
    first.close()
    os.makedirs(os.path.dirname(early), exist_ok=True)
    Path(early).write_bytes(forged_record(key(1), EVIL, **forgery))

    adapter = make_fs()
    os.makedirs(os.path.dirname(late), exist_ok=True)
    Path(late).write_bytes(forged_record(key(2), EVIL, **forgery))
    buffers = [bytearray(b"\xee" * 1000) for _ in range(2)]
    result = wait(adapter.submit_load([key(1), key(2)], [memoryview(b) for b in buffers]))

    assert [b"\xee" * 1000] * 2 == [bytes(b) for b in buffers]
    assert LoadResult([], [key(1), key(2)], [key(1)] if forgery["version"] == 2 else []) == result
    assert (False, [False, False]) == (os.path.exists(early), wait(adapter.lookup([key(1), key(2)])))


def test_fs_files_are_records_keyed_with_the_deployments_key(make_fs):
    """A chunk file holds exactly the documented record MAC'd with our key (computed here)."""
    adapter = make_fs()
    wait(adapter.submit_store([(key(1), payload(1))]))

    assert our_record_bytes(key(1), payload(1)) == Path(adapter.file_path(key(1))).read_bytes()


# -- the fs directory and files ----------------------------------------------------------------------------


@pytest.fixture
def shared_dir():
    """A directory anyone may create entries in (mode 0777, outside pytest's private temp dirs)."""
    path = tempfile.mkdtemp(prefix="mpcache-l2-shared-")
    os.chmod(path, 0o777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def start_cache(*flags: str) -> subprocess.CompletedProcess:
    """``bin/start-cache`` with ``flags``, expected to exit on its own (a bad flag) within 60 s."""
    return subprocess.run([sys.executable, str(REPO / "bin" / "start-cache"), "--prometheus-port", "0", *flags],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def fs_flag(path) -> str:
    return json.dumps({"type": "fs", "path": str(path), "capacity_gb": 1})


def test_fs_refuses_a_directory_another_user_created(other_user, shared_dir):
    """A directory made by another local user is refused, by the adapter and by start-cache (exit 2, one
    line naming the path and the owner); nothing is written into it."""
    theirs = shared_dir / "theirs"
    other_user.run("mkdir", "-m", "0755", str(theirs))

    with pytest.raises(ConfigError) as caught:
        FsL2Adapter(str(theirs), 4000, mac_key=MAC_KEY)
    completed = start_cache("--l2", fs_flag(theirs))

    assert f"is owned by uid {other_user.uid}" in str(caught.value)
    assert (2, 1, [], "") == (completed.returncode, len(completed.stderr.splitlines()), os.listdir(theirs),
                              completed.stdout)
    assert f"--l2: fs path '{theirs}' is owned by uid {other_user.uid}" in completed.stderr


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=["0777", "group_writable", "other_writable"])
def test_fs_refuses_a_directory_group_or_others_can_write(tmp_path, mode):
    """A directory of ours that group or others may write is refused, naming the path and its mode."""
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(mode)

    with pytest.raises(ConfigError, match=f"^--l2: fs path '{directory}' is writable by group or others "
                                          f"\\(mode {mode:04o}\\)"):
        FsL2Adapter(str(directory), 4000, mac_key=MAC_KEY)


def test_start_cache_refuses_a_world_writable_directory_in_one_line(tmp_path):
    """start-cache names the path in one line and exits 2 before starting anything."""
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)

    completed = start_cache("--l2", fs_flag(directory))

    assert (2, [f"start-cache: error: --l2: fs path '{directory}' is writable by group or others (mode 0777); "
                f"refusing it (use a directory of uid {os.geteuid()}, not a symlink, mode 0700)"]) == (
        completed.returncode, completed.stderr.splitlines())


def test_fs_refuses_a_symlinked_directory(tmp_path):
    """A path that is a symlink (even to a private directory of ours) is refused."""
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")

    with pytest.raises(ConfigError, match=f"^--l2: fs path '{tmp_path / 'link'}' is a symbolic link"):
        FsL2Adapter(str(tmp_path / "link"), 4000, mac_key=MAC_KEY)


def test_fs_creates_a_missing_directory_private(tmp_path):
    """A directory that does not exist yet is created mode 0700 and used."""
    adapter = FsL2Adapter(str(tmp_path / "new" / "l2"), 4000, mac_key=MAC_KEY)
    adapter.close()

    assert 0o700 == stat.S_IMODE(os.stat(tmp_path / "new" / "l2").st_mode)


def test_fs_never_follows_a_symlink_at_a_chunk_path(make_fs, tmp_path):
    """A symlink at a chunk's path, pointing at a valid record of that very chunk elsewhere, is not read:
    at start-up it is dropped (not indexed); while running its load is rejected.  The target survives."""
    outside = tmp_path / "outside.chunk"
    outside.write_bytes(our_record_bytes(key(1), payload(1)))
    first = make_fs()
    wait(first.submit_store([(key(2), payload(2))]))
    early, late = first.file_path(key(1)), first.file_path(key(2))
    first.close()
    os.makedirs(os.path.dirname(early), exist_ok=True)
    os.symlink(outside, early)

    adapter = make_fs()
    indexed = wait(adapter.lookup([key(1)]))
    os.unlink(late)
    os.symlink(outside, late)
    result = wait(adapter.submit_load([key(2)], [memoryview(bytearray(1000))]))

    assert ([False], LoadResult([], [key(2)], [key(2)])) == (indexed, result)
    assert (False, False, True) == (os.path.lexists(early), os.path.lexists(late), outside.exists())


def test_a_fifo_at_a_chunk_path_does_not_hang_start_up(make_fs, tmp_path):
    """A FIFO where a chunk file belongs would block a plain open() for reading forever; start-up skips and
    removes it within a second."""
    first = make_fs()
    path = first.file_path(key(1))
    first.close()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path, 0o600)
    made: list = []

    opener = threading.Thread(target=lambda: made.append(FsL2Adapter(str(tmp_path / "l2"), 4000, mac_key=MAC_KEY)),
                              daemon=True)
    opener.start()
    opener.join(5)
    if opener.is_alive():  # unblock the stuck open() so the thread can end, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        opener.join(5)
        pytest.fail("start-up blocked on a FIFO at a chunk path")
    made[0].close()

    assert not os.path.lexists(path)


# -- the secret and the key ---------------------------------------------------------------------------------


def expected_key(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=32, person=b"mpcache-l2-key").digest()


def write_secret(path: Path, content: bytes, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, content)
    os.close(fd)
    os.chmod(path, mode)
    return path


REDIS_SPEC = {"type": "redis", "url": "redis://127.0.0.1:1/0", "capacity_gb": 1}


def test_a_secret_file_gives_the_same_key_every_time(tmp_path):
    """The key is blake2b(secret, person=mpcache-l2-key); a trailing newline does not change it."""
    secret = b"0123456789abcdef0123456789abcdef-deployment-7"
    plain = write_secret(tmp_path / "plain", secret)
    with_newline = write_secret(tmp_path / "newline", secret + b"\n")

    keys = {resolve_l2_key([REDIS_SPEC], str(path)).key for path in (plain, with_newline, plain)}

    assert {expected_key(secret)} == keys


SECRET_PROBLEMS = {
    "missing": (lambda d, other: d / "absent", "cannot be opened"),
    "too_short": (lambda d, other: write_secret(d / "short", b"x" * 31), "holds 31 bytes; at least 32"),
    "group_readable": (lambda d, other: write_secret(d / "g", b"x" * 32, 0o640), "accessible by group or others"),
    "other_readable": (lambda d, other: write_secret(d / "o", b"x" * 32, 0o604), "accessible by group or others"),
    "a_directory": (lambda d, other: (d / "dir").mkdir() or d / "dir", "is not a regular file"),
    "a_symlink": (lambda d, other: (d / "link").symlink_to(write_secret(d / "real", b"x" * 32)) or d / "link",
                  "is a symbolic link"),
}


@pytest.mark.parametrize("problem", SECRET_PROBLEMS.values(), ids=SECRET_PROBLEMS.keys())
def test_a_bad_secret_file_is_one_line_naming_it(tmp_path, problem):
    """Each unusable --l2-secret-file is a one-line ConfigError naming the flag, the path and the problem."""
    make, wanted = problem
    path = make(tmp_path, None)

    with pytest.raises(ConfigError) as caught:
        resolve_l2_key([REDIS_SPEC], str(path))

    message = str(caught.value)
    assert (1, True, True) == (len(message.splitlines()), message.startswith(f"--l2-secret-file '{path}' "),
                               wanted in message), message


def test_a_secret_file_another_user_owns_is_refused(other_user, shared_dir):
    """A secret file created by another local user (mode 0600, long enough) is refused: they could change it."""
    path = shared_dir / "their-secret"
    other_user.run("sh", "-c", f"umask 077 && head -c 48 /dev/urandom > '{path}'")

    with pytest.raises(ConfigError, match=f"^--l2-secret-file '{path}' is owned by uid {other_user.uid}, "):
        resolve_l2_key([REDIS_SPEC], str(path))


def test_start_cache_reads_the_secret_file_from_the_flag_or_the_environment(tmp_path):
    """--l2-secret-file and, without it, $MPCACHE_L2_SECRET_FILE are checked at start: a bad one is exit 2
    with one line naming it."""
    short = write_secret(tmp_path / "short", b"too short")
    redis_flag = '{"type": "redis", "url": "redis://127.0.0.1:1/0", "capacity_gb": 1}'

    by_flag = start_cache("--l2", redis_flag, "--l2-secret-file", str(short))
    os.environ[SECRET_FILE_ENV] = str(short)
    try:
        by_env = start_cache("--l2", redis_flag)
    finally:
        del os.environ[SECRET_FILE_ENV]

    wanted = [f"start-cache: error: --l2-secret-file '{short}' holds 9 bytes; at least 32 are needed "
              "(e.g. openssl rand -hex 32)"]
    assert [(2, wanted), (2, wanted)] == [(c.returncode, c.stderr.splitlines()) for c in (by_flag, by_env)]


def test_an_fs_tier_keeps_its_secret_and_stays_warm_across_restarts(tmp_path):
    """Without --l2-secret-file the first fs tier's secret is created once (0600, 32 random bytes written as
    64 hex digits and a newline, which reading strips) and reused, so what one run stored, the next run
    (another resolution) loads."""
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    spec = {"type": "fs", "path": str(root), "capacity_gb": 1}

    first = resolve_l2_key([spec, REDIS_SPEC])
    secret_path = root / FS_SECRET_NAME
    info = secret_path.stat()
    writer = FsL2Adapter(str(root / "worker-0"), 4000, mac_key=first.key)
    wait(writer.submit_store([(key(1), payload(1))]))
    writer.close()
    second = resolve_l2_key([spec, REDIS_SPEC])
    reader = FsL2Adapter(str(root / "worker-0"), 4000, mac_key=second.key)
    loaded = bytearray(1000)
    result = wait(reader.submit_load([key(1)], [memoryview(loaded)]))
    reader.close()

    text = secret_path.read_bytes()
    assert (0o600, 65, expected_key(text.rstrip())) == (stat.S_IMODE(info.st_mode), info.st_size, first.key)
    assert len(bytes.fromhex(text.decode("ascii"))) == 32
    assert (first, f"fs {secret_path}") == (second, second.source)
    assert (LoadResult([key(1)]), payload(1)) == (result, bytes(loaded))
    assert [FS_SECRET_NAME, "worker-0"] == sorted(os.listdir(root))  # no temp file left behind


def test_a_symlink_planted_as_the_fs_secret_is_not_followed(tmp_path):
    """A symlink at <fs path>/.mpcache-l2-secret (to a file that would pass every check) is refused."""
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    (root / FS_SECRET_NAME).symlink_to(write_secret(tmp_path / "elsewhere", b"s" * 32))

    with pytest.raises(ConfigError, match=f"'{root / FS_SECRET_NAME}' is a symbolic link"):
        resolve_l2_key([{"type": "fs", "path": str(root), "capacity_gb": 1}])


def test_redis_only_gets_a_new_key_per_run_and_mock_only_none():
    """With no secret file and no fs tier the key is random per resolution (the supervisor warns); a mock-only
    deployment keeps no records and needs no key."""
    first, second = resolve_l2_key([REDIS_SPEC]), resolve_l2_key([REDIS_SPEC])

    assert ("per-run", True, 32) == (first.source, first.per_run, len(first.key))
    assert first.key != second.key
    assert None is resolve_l2_key([{"type": "mock", "capacity_gb": 1}])


def test_the_key_is_not_in_the_configs_repr():
    """Config carries the key (hex) for the children's 0600 file, but its repr (what a log line would show)
    leaves it out."""
    secret = "ab" * 32
    config = Config(instance_id="i", supervisor_pid=1, runtime_dir="/tmp/x", l2_secret=secret,
                    l2_secret_source="per-run")

    assert (False, True) == (secret in repr(config), secret in config.to_json())


def test_a_secret_check_takes_no_time_to_fail(tmp_path):
    """A FIFO given as the secret file is refused at once (opened non-blocking), not waited on: a blocking open
    would wait for a writer forever, so the check runs on a thread and must be refused within TIMEOUT_S."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)

    with ThreadPoolExecutor(1) as pool:
        check = pool.submit(resolve_l2_key, [REDIS_SPEC], str(fifo))
        try:
            with pytest.raises(ConfigError, match="is not a regular file"):
                wait(check)  # TimeoutError after TIMEOUT_S: it waited on the FIFO
        finally:
            if not check.done():  # blocked opening the FIFO: be its writer, so that the thread ends
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
