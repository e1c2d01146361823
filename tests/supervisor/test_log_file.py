"""The --log-file's writer: it appends to a log file it created (or proves its own), rotates its own copies,
and never renames, replaces or writes a file it did not create — a rotation that would is refused, the
file sink stops saying why on stderr, and the service's other logging goes on."""

from __future__ import annotations

import io
import json
import os

import pytest

from mpcache.errors import ConfigError
from mpcache.supervisor.logfile import HEADER_EVENT, LogFile
from mpcache.supervisor.logforward import LineForwarder

LINE = json.dumps({"event": "l1.keys.evicted", "level": "info", "pad": "x" * 100})


def _events(path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


def test_a_new_log_file_is_private_and_begins_with_the_header_and_is_appended_to_again(tmp_path) -> None:
    """Created 0600 with the header line first; a second LogFile on the same path (a restart) appends to it."""
    path = tmp_path / "mpcache.log"
    first = LogFile(str(path), 0, 5)
    first.write(LINE)
    first.close()
    again = LogFile(str(path), 0, 5)
    again.write(LINE)
    again.close()
    assert (0o600, [HEADER_EVENT, "l1.keys.evicted", "l1.keys.evicted"]) == (
        os.stat(path).st_mode & 0o777, _events(path))


def _written(tmp_path, backup_count: int) -> list[str]:
    """Write 40 lines (~5 KiB) rotating at 1 KiB; the names in ``tmp_path`` afterwards."""
    log = LogFile(str(tmp_path / "mpcache.log"), 1024, backup_count)
    for _ in range(40):
        log.write(LINE)
    log.close()
    return sorted(p.name for p in tmp_path.iterdir())


def test_rotation_keeps_n_copies_of_its_own_each_beginning_with_the_header(tmp_path) -> None:
    """At max_bytes the file moves to .1 (.1 to .2, the oldest replaced); every file begins with the header."""
    names = _written(tmp_path, 2)
    assert ["mpcache.log", "mpcache.log.1", "mpcache.log.2"] == names
    assert all(_events(tmp_path / name)[0] == HEADER_EVENT for name in names)
    assert all(os.path.getsize(tmp_path / name) < 1024 for name in names)


def test_rotation_with_no_copies_starts_the_file_afresh(tmp_path) -> None:
    """--log-backups 0: the full file is removed and a new one begun, header first."""
    path = tmp_path / "mpcache.log"
    assert (["mpcache.log"], HEADER_EVENT) == (_written(tmp_path, 0), _events(path)[0])
    assert os.path.getsize(path) < 1024


def _fill_to_rotation(log: LogFile) -> None:
    """Write until the next line rotates."""
    while log._size + len(LINE) + 1 < log.max_bytes:
        log.write(LINE)


def test_a_rotation_that_would_replace_a_file_not_ours_is_refused_and_touches_nothing(tmp_path) -> None:
    """A file planted at .2 while the service runs (here one without the header; another user's is refused
    the same way): the rotation that would replace it raises naming it, and every file keeps its bytes."""
    path = tmp_path / "mpcache.log"
    log = LogFile(str(path), 1024, 2)
    _fill_to_rotation(log)
    log.write(LINE)  # .1 now exists
    _fill_to_rotation(log)
    planted = tmp_path / "mpcache.log.2"
    planted.write_text("someone else's\n")
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with pytest.raises(ConfigError, match=f"refusing to write '{planted}': it does not begin with the header"):
        log.write(LINE)
    assert before == {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}


def test_a_rotation_of_a_file_swapped_in_under_the_log_files_name_is_refused(tmp_path) -> None:
    """The log file was moved away and another file put in its place: that file is not renamed."""
    path = tmp_path / "mpcache.log"
    log = LogFile(str(path), 1024, 2)
    _fill_to_rotation(log)
    os.rename(path, tmp_path / "moved.log")
    path.write_text("not the service's\n")
    with pytest.raises(ConfigError, match="it is no longer the file the service opened"):
        log.write(LINE)
    assert "not the service's\n" == path.read_text()


def test_a_refused_rotation_stops_the_file_sink_with_one_line_and_stderr_goes_on(tmp_path) -> None:
    """Through the forwarder: stderr says log.sink_failed naming the planted file, and later lines still
    reach stderr."""
    path = tmp_path / "mpcache.log"
    read_end, write_end = os.pipe()
    stderr = io.TextIOWrapper(io.FileIO(write_end, "w"))
    forwarder = LineForwarder(str(path), 1024, 1, stderr=stderr)
    (tmp_path / "mpcache.log.1").write_text("someone else's\n")
    for _ in range(12):
        forwarder.write(LINE)
    assert forwarder.file is not None and forwarder.file.flush(10)  # the rotation was refused by now
    forwarder.write(json.dumps({"event": "after"}))
    assert forwarder.close(10)
    stderr.close()
    with open(read_end, encoding="utf-8") as reader:
        lines = [json.loads(line) for line in reader.read().splitlines()]
    failed = [line for line in lines if line["event"] == "log.sink_failed"]
    assert [("log-file", True)] == [(line["sink"], "mpcache.log.1'" in line["error"]) for line in failed]
    assert "after" == lines[-1]["event"]
    assert "someone else's\n" == (tmp_path / "mpcache.log.1").read_text()
