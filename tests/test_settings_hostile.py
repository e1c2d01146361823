"""start-cache's settings under hostile or careless input: a --config that is not a regular UTF-8 file, a size
too large for a float, TOML values of the wrong type for a text setting, passwords holding "@", names outside
the Basic Multilingual Plane, and what a start would refuse: each is one line and exit status 2 (never a
traceback, never a hang), --check-config refuses what a start refuses, and its output reads back the same."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mpcache.shm.segment import shm_free_bytes
from mpcache.supervisor.logfile import header

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
START_CACHE = [sys.executable, str(REPO / "bin" / "start-cache")]


def _check_config(tmp_path, *argv: str, **environ: str) -> subprocess.CompletedProcess:
    """``start-cache --check-config`` in a clean environment; its port probe on a port nothing else can hold
    (port 0) unless the test names one: 9090 may be taken on a shared machine."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MPCACHE_", "OTEL_"))}
    return subprocess.run([*START_CACHE, "--check-config", *argv], capture_output=True, text=True, timeout=60,
                          env={**env, "MPCACHE_PROMETHEUS_PORT": "0", **environ}, cwd=tmp_path)


def _start(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """``start-cache`` with one small worker for 1 s (refusals come before anything starts)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MPCACHE_", "OTEL_"))}
    return subprocess.run([*START_CACHE, *argv, "--workers", "1", "--prometheus-port", "0", "--duration", "1"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


def _one_line_exit_2(result: subprocess.CompletedProcess, expected: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert (2, 1, "") == (result.returncode, len(lines), result.stdout), result.stderr
    assert lines[0].startswith("start-cache: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("kind", ["fifo", "char-device", "directory", "invalid-utf8"])
def test_a_config_that_is_not_a_regular_utf8_file_is_one_line(tmp_path, kind):
    if kind == "fifo":  # open() of a FIFO without a writer blocks for ever: the start must not hang
        path = tmp_path / "settings.toml"
        os.mkfifo(path)
        expected = "not a regular file"
    elif kind == "directory":  # os.fdopen refuses one itself: that was a traceback
        path = tmp_path / "settings.d"
        path.mkdir()
        expected = "not a regular file"
    elif kind == "char-device":  # /dev/zero never ends: the start must not read it for ever
        path = Path("/dev/zero")
        expected = "not a regular file"
    else:
        path = tmp_path / "settings.toml"
        path.write_bytes(b'log-file = "\xff.log"\n')
        expected = "not UTF-8"
    result = _check_config(tmp_path, "--config", str(path))
    _one_line_exit_2(result, f"--config: cannot read '{path}' ({expected}")
    assert "not valid TOML" not in result.stderr  # a file that cannot be read is not said to be bad TOML as well


@pytest.mark.parametrize("where", ["flag", "environment", "file"])
def test_a_size_beyond_a_float_is_one_line(tmp_path, where):
    huge = "1" + "0" * 400  # float() gives inf: int(inf) raises OverflowError
    if where == "flag":
        result = _check_config(tmp_path, "--l1-size", huge)
    elif where == "environment":
        result = _check_config(tmp_path, MPCACHE_LOG_MAX_BYTES=huge)
    else:
        (tmp_path / "settings.toml").write_text(f'chunk-bytes = "{huge}"\n')
        result = _check_config(tmp_path, "--config", str(tmp_path / "settings.toml"))
    _one_line_exit_2(result, "expected a")


def test_a_config_integer_of_more_digits_than_python_converts_is_one_line(tmp_path):
    (tmp_path / "settings.toml").write_text("workers = " + "9" * 5000 + "\n")  # tomllib raises ValueError
    _one_line_exit_2(_check_config(tmp_path, "--config", str(tmp_path / "settings.toml")),
                     "settings.toml: not valid TOML (Exceeds the limit (4300 digits)")


@pytest.mark.parametrize("value", ["[1, 2]", '["a.log"]', "{a = 1}", "true", "1979-05-27", "07:32:00"])
def test_a_text_setting_refuses_a_toml_value_that_is_not_text(tmp_path, value):
    """log-file = ["a.log"] used to start, writing the log to a file named "['a.log']"."""
    (tmp_path / "settings.toml").write_text(f"log-file = {value}\n")
    _one_line_exit_2(_check_config(tmp_path, "--config", str(tmp_path / "settings.toml")),
                     "settings.toml: log-file: expected text, got ")


def test_check_config_hides_a_redis_password_that_holds_an_at_sign(tmp_path):
    """redis-py reads redis://user:hunter@two@host/0's password as "hunter@two" (the last "@" ends it)."""
    tier = {"type": "redis", "url": "redis://mpcache:hunter@two@127.0.0.1:6379/0", "capacity_gb": 1}
    shown = _check_config(tmp_path, "--l2", json.dumps(tier))
    assert (0, False, False, True) == (shown.returncode, "hunter" in shown.stdout, "two@" in shown.stdout,
                                       "redis://mpcache:(hidden)@127.0.0.1:6379/0" in shown.stdout), shown.stdout


def test_check_config_output_reads_back_with_names_beyond_the_basic_plane(tmp_path):
    log_file = str(tmp_path / "caf\u00e9-\U0001f600\x7f.log")
    first = _check_config(tmp_path, MPCACHE_LOG_FILE=log_file, MPCACHE_DEMO_TALLY='a"b\\c\t.json')
    assert (0, "") == (first.returncode, first.stderr)
    printed = tomllib.loads(first.stdout)
    assert (log_file, 'a"b\\c\t.json') == (printed["log-file"], printed["demo-tally"])
    (tmp_path / "printed.toml").write_text(first.stdout, encoding="utf-8")
    again = _check_config(tmp_path, "--config", str(tmp_path / "printed.toml"))
    assert (0, printed) == (again.returncode, tomllib.loads(again.stdout))


@pytest.mark.parametrize(("argv", "expected"), [
    (["--otlp-endpoint", "ftp://127.0.0.1:4317"], "--otlp-endpoint: expected host:port or http(s)://host:port"),
    (["--otlp-endpoint", "ftp://otel:hunter2@127.0.0.1:4317"], "got (hidden: it holds user information)"),
    # the gRPC exporter takes user info for a host name and logs it with every failed export
    (["--otlp-endpoint", "http://otel:hunter2@127.0.0.1:4317"], "--otlp-endpoint: user information in the URL"),
    (["--runtime-dir", "/tmp/" + "r" * 120], "--runtime-dir: too long for Unix socket paths under it"),
])
def test_check_config_refuses_what_a_start_refuses(tmp_path, argv, expected):
    """Both say so in the same line, which shows no password."""
    _one_line_exit_2(_check_config(tmp_path, *argv), expected)
    started = _start(tmp_path, *argv)
    _one_line_exit_2(started, expected)
    assert "hunter2" not in started.stderr


def test_check_config_refuses_a_taken_port_and_an_l1_that_dev_shm_cannot_hold(tmp_path):
    """What a start probes, --check-config probes too: a port something listens on, and an L1 larger than
    /dev/shm's free space, are each the start's own line and exit status 2 (they used to pass the check)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        _one_line_exit_2(_check_config(tmp_path, "--prometheus-port", str(port)),
                         f"--prometheus-port: port {port} on 127.0.0.1 is not available")
    too_big = shm_free_bytes() + 2**30
    _one_line_exit_2(_check_config(tmp_path, "--workers", "1", "--prometheus-port", "0", "--l1-size", str(too_big)),
                     "/dev/shm has ")


@pytest.mark.parametrize(("tier", "expected"), [
    ({"type": ["fs"], "capacity_gb": 1}, "--l2: unknown or missing type ['fs']"),  # was TypeError: unhashable
    ({"type": "mock", "capacity_gb": 1e308}, "--l2: mock 'capacity_gb' must be a number > 0"),  # was OverflowError
])
def test_an_l2_tier_of_the_wrong_shape_is_one_line(tmp_path, tier, expected):
    _one_line_exit_2(_check_config(tmp_path, "--l2", json.dumps(tier)), expected)


@pytest.mark.parametrize("where", ["flag", "environment", "file"])
def test_a_value_nested_too_deeply_is_one_line(tmp_path, where):
    """json.loads and tomllib raise RecursionError on 100000 nested arrays: it was a traceback."""
    deep = "[" * 100_000
    if where == "flag":
        result, expected = _check_config(tmp_path, "--l2", deep), "argument --l2: expected a JSON object, got JSON"
    elif where == "environment":
        result, expected = _check_config(tmp_path, MPCACHE_LMCACHE_ALLOW_UID=deep), "MPCACHE_LMCACHE_ALLOW_UID:"
    else:
        (tmp_path / "settings.toml").write_text(f"l2 = {deep}\n")
        result = _check_config(tmp_path, "--config", str(tmp_path / "settings.toml"))
        expected = "settings.toml: not valid TOML (arrays or tables nested too deeply)"
    _one_line_exit_2(result, expected)


def test_a_setting_given_twice_in_one_file_is_one_line(tmp_path):
    """l1_size and l1-size are two keys to TOML and one setting: the second used to win silently."""
    (tmp_path / "settings.toml").write_text('l1_size = "1MiB"\nl1-size = "2MiB"\n')
    _one_line_exit_2(_check_config(tmp_path, "--config", str(tmp_path / "settings.toml")),
                     "settings.toml: 'l1-size' sets 'l1-size' a second time")


def test_a_log_file_that_is_a_fifo_nobody_reads_is_one_line_not_a_hang(tmp_path):
    """A FIFO is not a log file the service created: refused before it is opened, so never waited on."""
    os.mkfifo(tmp_path / "log.fifo")
    _one_line_exit_2(_start(tmp_path, "--log-file", str(tmp_path / "log.fifo")),
                     f"--log-file: refusing to write '{tmp_path / 'log.fifo'}': it is not a regular file")


def _plant(path: Path, case: str, second_user_uid: int | None) -> Path:
    """Put at ``path`` what ``case`` names; the path whose bytes, owner and mode must stay as they are."""
    ours = header().decode() + '{"event": "cache.started"}\n'  # a log file of this service's, as it writes one
    if case == "symlink":
        target = path.with_name("target.log")
        target.write_text(ours)
        path.symlink_to(target)
        return target
    if case == "a_rotated_copy_not_ours":
        path = path.with_name(path.name + ".1")
    path.write_text(ours if case in ("hard_link", "world_writable", "another_users") else "root:x:0:0::/root:/bin/sh\n")
    if case == "hard_link":
        os.link(path, path.with_name("elsewhere.txt"))
    elif case == "world_writable":
        os.chmod(path, 0o666)
    elif case == "another_users":
        os.chown(path, second_user_uid, -1)
        os.chmod(path, 0o600)
    return path


def _state(path: Path) -> tuple[bytes, int, int, int, int]:
    """What writing, renaming or re-owning a file would change: its bytes, mode, owner, links, mtime."""
    info = os.lstat(path)
    return path.read_bytes(), info.st_mode, info.st_uid, info.st_nlink, info.st_mtime_ns


LOG_FILE_CASES = {
    "without_the_header": "it does not begin with the header line of a log file the service created",
    "a_rotated_copy_not_ours": "it does not begin with the header line of a log file the service created",
    "hard_link": "it has 2 hard links",
    "world_writable": "it is writable by group or others (mode 0666)",
    "symlink": "it is a symbolic link",
    "another_users": "it belongs to uid ",
}


@pytest.mark.parametrize("case", sorted(LOG_FILE_CASES))
def test_a_log_file_the_service_did_not_create_is_refused_before_anything_is_written(tmp_path, case, request):
    """An existing --log-file (or a rotated copy that rotation would move) that the service cannot prove its
    own — no header line of its own (as root: any root-owned file, /etc/passwd among them), a second hard link,
    group/world-writable, a symlink, another user's 0600 file — is one line naming it and why, exit 2, before
    a byte is written: its bytes, owner and mode stay, and no log file is created.  --check-config says the
    same."""
    uid = request.getfixturevalue("second_user").uid if case == "another_users" else None
    path = tmp_path / "mpcache.log"
    planted = _plant(path, case, uid)
    before = _state(planted)
    named = path if case == "symlink" else planted
    expected = f"--log-file: refusing to write '{named}': {LOG_FILE_CASES[case]}"
    _one_line_exit_2(_start(tmp_path, "--log-file", str(path)), expected)
    _one_line_exit_2(_check_config(tmp_path, "--log-file", str(path)), expected)
    assert before == _state(planted)
    assert os.path.lexists(path) == (case != "a_rotated_copy_not_ours")


def _settings_in(directory: Path, mode: int = 0o700) -> Path:
    directory.mkdir(exist_ok=True)
    os.chmod(directory, mode)
    path = directory / "settings.toml"
    path.write_text('log-level = "debug"\n')
    return path


@pytest.mark.parametrize("case", ["world_writable", "group_writable", "in_a_0777_directory", "another_users",
                                  "in_another_users_directory", "a_symlink_to_one_in_a_0777_directory"])
def test_a_config_file_someone_else_could_have_written_is_refused_naming_it_and_the_fix(tmp_path, case, request):
    """As sshd's StrictModes: a settings file (or a directory above it) owned by neither root nor the service's
    uid, or writable by group or others, is one line naming it, why, and what to fix — at a start and in
    --check-config — and the service starts nothing; a symlink is resolved and its target checked."""
    path = _settings_in(tmp_path / "conf")
    named, reason = path, "is writable by group or others (mode 0666)"
    if case == "world_writable":
        os.chmod(path, 0o666)
    elif case == "group_writable":
        os.chmod(path, 0o620)
        reason = "is writable by group or others (mode 0620)"
    elif case in ("in_a_0777_directory", "a_symlink_to_one_in_a_0777_directory"):
        os.chmod(path.parent, 0o777)
        named, reason = path.parent, "is writable by group or others (mode 0777)"
    else:
        uid = request.getfixturevalue("second_user").uid
        os.chown(path if case == "another_users" else path.parent, uid, -1)
        named = path if case == "another_users" else path.parent
        reason = f"belongs to uid {uid}, not to root or the service's uid {os.geteuid()}"
    given = path
    if case.startswith("a_symlink"):
        given = tmp_path / "link.toml"
        given.symlink_to(path)
    expected = f"--config: refusing '{given}': {named} {reason} (a settings file and every directory above it"
    _one_line_exit_2(_check_config(tmp_path, "--config", str(given)), expected)
    _one_line_exit_2(_start(tmp_path, "--config", str(given)), expected)


@pytest.mark.parametrize("case", ["private", "in_a_sticky_world_writable_directory", "a_symlink_to_a_trusted_one"])
def test_a_config_file_only_root_or_the_service_could_write_is_read(tmp_path, case):
    """A private file, one in a sticky world-writable directory (like /tmp: no one else can replace it) and a
    symlink whose target passes are read: --check-config shows the file as the setting's source."""
    path = _settings_in(tmp_path / "conf", 0o1777 if case == "in_a_sticky_world_writable_directory" else 0o700)
    given = path
    if case == "a_symlink_to_a_trusted_one":
        given = tmp_path / "link.toml"
        given.symlink_to(path)
    shown = _check_config(tmp_path, "--config", str(given))
    assert (0, "") == (shown.returncode, shown.stderr)
    assert [f"# file {given}"] == [line.split(None, 3)[-1] for line in shown.stdout.splitlines()
                                   if line.startswith("log-level =")]


READ_ONLY_MOUNT = '''
mount -t tmpfs -o mode=0777 mpcache-test "$1" || exit 97
printf 'log-level = "debug"\\n' > "$1/settings.toml"
mount -o remount,ro "$1" || exit 97
shift
exec "$@"
'''


def test_a_config_file_in_a_0777_directory_on_a_read_only_mount_is_read(tmp_path):
    """No one can change what is on a read-only mount: a Kubernetes ConfigMap's volume directory is 0777, the
    volume mounted read-only, and its settings file is read (here: a tmpfs remounted read-only in a private
    mount namespace)."""
    directory = tmp_path / "configmap"
    directory.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MPCACHE_", "OTEL_"))}
    try:
        shown = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT,
                                "sh", str(directory), *START_CACHE, "--check-config", "--config",
                                str(directory / "settings.toml")], capture_output=True, text=True, timeout=60,
                               env=env, cwd=tmp_path)
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if shown.returncode == 97 or "unshare failed" in shown.stderr:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {shown.stderr.strip()}")
    assert (0, "") == (shown.returncode, shown.stderr)
    assert 'log-level = "debug"' in shown.stdout


@pytest.mark.parametrize("where", ["flag", "environment"])
def test_a_refused_value_of_any_length_is_quoted_cut_short_with_its_length(tmp_path, where):
    """5,000 digits for --mrc-max-keys: the line quotes the first of them and says how many there were (it had
    echoed all 5,000)."""
    from mpcache.config.kinds import SHOWN_CHARACTERS

    digits = "9" * 5000
    result = (_check_config(tmp_path, "--mrc-max-keys", digits) if where == "flag" else
              _check_config(tmp_path, MPCACHE_MRC_MAX_KEYS=digits))
    quoted = repr(digits)[:SHOWN_CHARACTERS - 3]
    _one_line_exit_2(result, f"expected an integer 64..4194304, got {quoted}... (5,000 characters)")
    assert len(result.stderr) < 300


def test_a_config_file_named_with_a_terminal_escape_is_named_escaped(tmp_path):
    """The file's name reaches the error line as a quoted, escaped string, not as an escape the terminal runs."""
    path = tmp_path / "e\x1b]0;T\x07.toml"
    path.write_text("bogus = 1\n")
    os.chmod(path, 0o600)
    result = _check_config(tmp_path, "--config", str(path))
    _one_line_exit_2(result, f"{str(path)!r}: unknown setting 'bogus'")
    assert "\x1b" not in result.stderr
