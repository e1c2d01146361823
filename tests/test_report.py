"""``mpcache-report`` against whatever an endpoint answers: a /mrc document it renders; anything it cannot use —
no server, an HTTP error, a broken or trickling answer, one too large, not JSON, nested too deeply, a field
missing or of the wrong type, NaN, a number beyond a float, points out of order — is one line on stderr and
exit status 2, never a traceback; names that hold control characters cannot break the table."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpcache.tools import report

POINTS = [{"capacity_bytes": 1 << (20 + k), "hit_ratio": round(0.1 * k, 1)} for k in range(6)]
VALID = {"sample_rate": 0.01, "configured_sample_rate": 0.01, "head_sample_rate": 1.0, "tracked_keys": 812,
         "max_keys": 8192, "curves": [{"tier": "l1", "model_name": "*", "cache_salt": "*",
                                       "capacity_bytes": 4 << 20, "sampled_accesses": 5120, "points": POINTS}]}


def _run(body: bytes, *argv: str) -> tuple[int, str, str]:
    """``mpcache-report`` whose endpoint answered ``body``: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(report, "fetch", lambda url, timeout_s: body), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        status = report.main(list(argv))
    return status, out.getvalue(), err.getvalue()


def _refused(status: int, stdout: str, stderr: str) -> str:
    """The one error line of a refusal (asserting it is one)."""
    lines = stderr.splitlines()
    assert (2, "", 1) == (status, stdout, len(lines)), stderr
    assert lines[0].startswith("mpcache-report: error: cannot read the curves from "), lines[0]
    return lines[0]


DELETE = object()


def _with(path: tuple, value) -> bytes:
    """VALID with the field at ``path`` set to ``value`` (``DELETE``: removed), as the endpoint's body."""
    document = copy.deepcopy(VALID)
    *parents, last = path
    target = document
    for key in parents:
        target = target[key]
    if value is DELETE and isinstance(target, dict):
        target.pop(last, None)  # a field an older server does not send either
    elif value is DELETE:
        del target[last]
    else:
        target[last] = value
    return json.dumps(document).encode()



def test_a_valid_document_is_rendered() -> None:
    """A server from before /mrc said its processes and measured ratios: one process, nothing measured."""
    status, stdout, stderr = _run(json.dumps(VALID).encode())
    assert (0, "") == (status, stderr)
    [row] = [line.split() for line in stdout.splitlines() if line.startswith("l1 ")]
    assert ["l1", "*", "*", "4.0", "MiB", "4.0", "MiB", "5120", "-", "0.200"] == row[:10]


def test_the_measured_hit_ratio_is_beside_the_prediction_and_capacities_are_per_service_and_per_process() -> None:
    """Two cache processes: each capacity is the whole service's and, beside it, one process's half (what
    --l1-size takes); the measured hit ratio is shown as the server gave it, next to the predicted now, ½×, 2×,
    4× (the points at 4, 2, 8, 16 MiB) and the capacity for the target (8 MiB: 0.3 in POINTS)."""
    document = copy.deepcopy(VALID)
    document["processes"] = 2
    document["curves"][0]["measured_hit_ratio"] = 0.428
    status, stdout, stderr = _run(json.dumps(document).encode(), "--target-hit-ratio", "0.3")
    assert (0, "") == (status, stderr)
    [row] = [line.split() for line in stdout.splitlines() if line.startswith("l1 ")]
    assert ["l1", "*", "*", "4.0", "MiB", "2.0", "MiB", "5120", "0.428", "0.200", "0.100", "0.300", "0.400",
            "8.0", "MiB", "4.0", "MiB"] == row
    assert "the whole service's (2 cache processes)" in stdout and "--l1-size" in stdout


@pytest.mark.parametrize(("body", "expected"), [
    (b"", "not a /mrc document: Expecting value"),  # was json's ValueError
    (b"\xff\xfe", "not a /mrc document:"),
    (b"[" * 100_000, "not a /mrc document: JSON nested too deeply"),  # was RecursionError
    (b"[]", "/mrc: expected an object, got list []"),  # was TypeError
    (_with(("curves",), DELETE), "/mrc: no 'curves'"),  # was KeyError
    (_with(("curves", 0, "points", 2), {"hit_ratio": 0.1}), "curves[0].points[2]: no 'capacity_bytes'"),
    (_with(("curves",), {"l1": 1}), "curves: expected a list, got dict"),
    (_with(("sample_rate",), "0.01"), "sample_rate: expected a number [0, 1], got str '0.01'"),
    (_with(("tracked_keys",), True), "tracked_keys: expected an integer >= 0, got bool True"),
    (_with(("processes",), 10**200), "processes: expected an integer in [0, 65535], got int"),  # was OverflowError
    (_with(("curves", 0, "points", 1, "hit_ratio"), float("nan")),
     "curves[0].points[1].hit_ratio: expected a number [0, 1], got float nan"),
    (_with(("curves", 0, "capacity_bytes"), 10 ** 400),
     f"curves[0].capacity_bytes: expected an integer in [0, {report.MAX_BYTES}], got int"),
    # bytes are whole: a subnormal or a float beyond any memory had made nan and inf of what-ifs
    (_with(("curves", 0, "points", 0, "capacity_bytes"), 5e-324),
     "curves[0].points[0].capacity_bytes: expected an integer in [0, 18446744073709551616], got float 5e-324"),
    (_with(("curves", 0, "capacity_bytes"), 1e300), "curves[0].capacity_bytes: expected an integer in"),
    (b'{"max_keys": ' + b"9" * 5000 + b"}", "not a /mrc document: Exceeds the limit (4300 digits)"),  # ValueError
    (_with(("curves", 0, "points", 3, "capacity_bytes"), 1), "curves[0].points[3].capacity_bytes: smaller than"),
    (_with(("curves", 0, "tier"), ["l1"]), "curves[0].tier: expected text, got list ['l1']"),
])
def test_an_answer_that_is_not_a_mrc_document_is_one_line_naming_what_is_wrong(body, expected) -> None:
    assert expected in _refused(*_run(body))
    assert expected in _refused(*_run(body, "--json"))


@pytest.mark.parametrize("policy", [None, "lru", "adaptive"])
def test_lru_curves_are_shown_as_a_prediction_only_for_an_lru_cache(policy) -> None:
    """The curves model LRU (``curves_model``); under another ``l1_policy`` no ratio or capacity is shown, and
    the report says why.  A document without the fields (an older server) is read as an LRU cache's."""
    document = dict(VALID) if policy is None else {**VALID, "curves_model": "lru", "l1_policy": policy}
    status, stdout, _ = _run(json.dumps(document).encode())
    row = stdout.splitlines()[-1].split()
    assert status == 0
    if policy == "adaptive":
        assert "the curves model --l1-policy lru; L1 runs --l1-policy adaptive" in stdout
        assert row[-6:] == ["-"] * 6
    else:
        assert "L1 runs" not in stdout
        # 4 MiB on POINTS: 0.2, ½× 0.1, 2× 0.3, 4× 0.4; 80 % beyond its last point, 32 MiB at 0.5 (one process)
        assert row[-10:] == ["0.200", "0.100", "0.300", "0.400", ">", "32.0", "MiB", ">", "32.0", "MiB"]


def test_points_at_capacity_zero_or_repeated_are_rendered_not_divided_by() -> None:
    """A tiny tier's first points round to 0 bytes and repeat (the service can send these): no division."""
    points = [{"capacity_bytes": c, "hit_ratio": h} for c, h in [(0, 0.0), (0, 0.0), (1, 0.5), (1, 0.5), (8, 0.9)]]
    status, stdout, stderr = _run(_with(("curves", 0, "points"), points), "--target-hit-ratio", "0.4")
    assert (0, "") == (status, stderr)
    assert "≤ 1 B" in stdout


def test_control_characters_in_names_are_escaped_and_cannot_add_lines() -> None:
    hostile = "evil\x1b[2J\nfake row\r"
    status, stdout, _ = _run(_with(("curves", 0, "cache_salt"), hostile))
    assert (0, 5, False) == (status, len(stdout.splitlines()), "\x1b" in stdout)  # 3 header lines, 2 rows
    assert "evil\\x1b[2J\\nfake row\\r" in stdout


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10 ** 300, max_value=10 ** 320)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["curves", "points", "tier", "model_name", "cache_salt", "capacity_bytes", "hit_ratio",
                         "sample_rate", "configured_sample_rate", "tracked_keys", "max_keys", "sampled_accesses",
                         "processes", "measured_hit_ratio", "x"]), children, max_size=6),
    max_leaves=30)
PATHS = st.sampled_from([("sample_rate",), ("configured_sample_rate",), ("tracked_keys",), ("max_keys",),
                         ("processes",), ("curves", 0, "measured_hit_ratio"),
                         ("curves",), ("curves", 0), ("curves", 0, "tier"), ("curves", 0, "capacity_bytes"),
                         ("curves", 0, "sampled_accesses"), ("curves", 0, "points"), ("curves", 0, "points", 0),
                         ("curves", 0, "points", 2, "capacity_bytes"), ("curves", 0, "points", 2, "hit_ratio")])


def _answers_in_one_line_or_renders(body: bytes) -> None:
    for argv in ((), ("--json",)):
        status, stdout, stderr = _run(body, *argv)
        if status == 0:
            assert stderr == "" and stdout
        else:
            _refused(status, stdout, stderr)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=JSON_VALUES)
def test_any_json_value_is_rendered_or_refused_in_one_line(document) -> None:
    _answers_in_one_line_or_renders(json.dumps(document).encode())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=PATHS, value=JSON_VALUES | st.just(DELETE), depth=st.integers(0, 3000))
def test_a_valid_document_with_any_field_replaced_removed_or_deeply_nested_is_rendered_or_refused(
        path, value, depth) -> None:
    if depth > 2000:
        value = json.loads("[" * 50 + "]" * 50)  # nested, within json's reach
        body = _with(path, value)[:-1] + b", \"deep\": " + b"[" * depth + b"]" * depth + b"}"
    else:
        body = _with(path, value)
    _answers_in_one_line_or_renders(body)


class _Endpoint(BaseHTTPRequestHandler):
    """/mrc answered as the test says: ``answer(handler)``."""

    answer = staticmethod(lambda handler: None)

    def do_GET(self) -> None:  # http.server calls it by this name
        type(self).answer(self)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def endpoint():
    """``serve(answer)`` → the URL of a local HTTP server answering every GET with ``answer(handler)``."""
    servers: list[ThreadingHTTPServer] = []

    def serve(answer) -> str:
        handler = type("Handler", (_Endpoint,), {"answer": staticmethod(answer)})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = report.main(list(argv))
    return status, out.getvalue(), err.getvalue()


def _status(code: int, body: bytes = b""):
    def answer(handler) -> None:
        handler.send_response(code)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


def _trickle(handler) -> None:
    handler.send_response(200)
    handler.end_headers()
    with contextlib.suppress(OSError):
        for _ in range(100):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            threading.Event().wait(0.1)  # a byte every 0.1 s: each read is quick, the whole never ends


def _garbage(handler) -> None:
    handler.wfile.write(b"SSH-2.0-not-http\r\n\r\n")


def test_an_endpoint_that_answers_with_an_http_error_is_one_line(endpoint) -> None:
    assert "HTTP 500" in _refused(*_main("--url", endpoint(_status(500, b"oops"))))


def test_an_answer_that_is_not_http_is_one_line(endpoint) -> None:
    _refused(*_main("--url", endpoint(_garbage)))


def test_an_answer_larger_than_the_bound_is_cut_off_in_one_line(endpoint, monkeypatch) -> None:
    monkeypatch.setattr(report, "MAX_DOCUMENT_BYTES", 1 << 16)
    assert f"larger than {1 << 16} bytes" in _refused(*_main("--url", endpoint(_status(200, b" " * (1 << 20)))))


def test_an_answer_that_trickles_is_cut_off_at_the_timeout(endpoint) -> None:
    assert "took longer than 0.5 s" in _refused(*_main("--url", endpoint(_trickle), "--timeout", "0.5"))


def test_no_server_and_a_url_that_is_not_http_are_one_line() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: refused
        assert "refused" in _refused(*_main("--url", f"http://127.0.0.1:{port}")).lower()
    assert "expected an http:// or https:// URL" in _refused(*_main("--url", "file:///dev/zero"))


def _trickled_head(handler) -> None:
    """A status line, then a header line every 0.1 s for 30 s: no single read waits long, the head never ends."""
    with contextlib.suppress(OSError):
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for number in range(300):
            handler.wfile.write(f"X-Slow-{number}: 1\r\n".encode())
            handler.wfile.flush()
            threading.Event().wait(0.1)


@pytest.mark.parametrize("answer", [_trickle, _trickled_head], ids=["body", "head"])
def test_the_timeout_bounds_the_whole_answer_head_included(endpoint, answer) -> None:
    """Cut off at the timeout, not when the server stops: reading per 64 KiB waited out the body's 10-second
    trickle, and the head, with only a per-read timeout, ran until http.client's 100-header limit, 10 s too."""
    started = time.monotonic()
    assert "took longer than 0.5 s" in _refused(*_main("--url", endpoint(answer), "--timeout", "0.5"))
    assert time.monotonic() - started < 5


def _mrc_only(handler) -> None:
    _status(200, json.dumps(VALID).encode())(handler) if handler.path == "/mrc" else _status(404)(handler)


@pytest.mark.parametrize("suffix", ["", "/", "/mrc", "/mrc/", "/metrics", "/metrics/", "/?"])
def test_the_endpoint_may_be_given_as_its_root_its_metrics_or_its_mrc(endpoint, suffix) -> None:
    status, stdout, stderr = _main("--url", endpoint(_mrc_only) + suffix)
    assert (0, "") == (status, stderr) and "l1" in stdout


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "http://", "http://127.0.0.1:x"])
def test_a_url_that_is_not_one_is_one_line(url) -> None:
    _refused(*_main("--url", url))


def test_a_proxy_in_the_environment_does_not_answer_for_a_loopback_endpoint(endpoint, monkeypatch) -> None:
    """The proxy would answer with a valid document; the endpoint itself refuses the connection."""
    proxy = endpoint(_status(200, json.dumps(VALID).encode()))
    monkeypatch.setenv("http_proxy", proxy)
    monkeypatch.setenv("HTTP_PROXY", proxy)
    for exempt in ("no_proxy", "NO_PROXY"):  # one naming loopback would pass this test with or without the fix
        monkeypatch.delenv(exempt, raising=False)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        assert "refused" in _refused(*_main("--url", f"http://127.0.0.1:{unused.getsockname()[1]}")).lower()


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf", str(report.MAX_TIMEOUT_S * 2)])
def test_a_timeout_that_is_not_seconds_in_range_is_a_usage_error(capsys, timeout) -> None:
    with pytest.raises(SystemExit) as exited:
        report.main(["--timeout", timeout])
    assert 2 == exited.value.code
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mpcache-report: error: --timeout: expected seconds in (0, {report.MAX_TIMEOUT_S:g}]")
