"""Wrong types anywhere in an LMCache request: every request is answered (the operation's failure value),
no handler fails internally (no traceback), the log stays bounded, and the process serves on."""

from __future__ import annotations

import itertools
import time

import pytest
from support.lmcache_client import NO_RESULT, LMClient, key, registration

OBJECT = 2 * 2 * 256 * 64 * 2
WRONG = [None, True, -1, 2**64 - 1, 1.5, "x", b"\x00", [], [1, "a"], {}, {"a": {"b": []}}]
KEY_OPS = ["lookup", "free_lookup_locks"]
KEY_INSTANCE_OPS = ["prepare_store", "prepare_retrieve", "commit_retrieve"]


class Lines:
    """A structlog-like logger keeping every line, by level."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, *args, **fields: self.lines.append((level, event, fields))


def _requests() -> list[tuple[str, list]]:
    """Well-formed requests with one field or argument replaced by a value of a wrong type."""
    good_key = key(list(range(512)), "r1", worker_id=0)
    requests: list[tuple[str, list]] = []
    for field, value in itertools.product(list(good_key), WRONG):
        bad = dict(good_key, **{field: value})
        requests += [(op, [bad]) for op in KEY_OPS]
        requests += [(op, [bad, 1]) for op in KEY_INSTANCE_OPS]
        requests.append(("commit_store", [bad, 1, b""]))
    for value in WRONG:
        requests += [(op, [good_key, value]) for op in KEY_INSTANCE_OPS]
        requests += [("commit_store", [good_key, value, b""]), ("commit_store", [good_key, 1, value]),
                     ("query_prefetch_status", [value]), ("end_session", [value]), ("ping", [value]),
                     ("unregister", [value]), ("wait_prefetch_status", [value, 1.0]),
                     ("wait_prefetch_status", ["r1", value]), ("report_block_allocation", [value, "m", []]),
                     ("report_block_allocation", [1, value, []]), ("report_block_allocation", [1, "m", value]),
                     ("report_block_allocation", [1, "m", [value]]), ("lookup", [good_key]), ("lookup", [])]
    for field, value in itertools.product(list(registration(1)), WRONG):
        requests.append(("register", [dict(registration(1), **{field: value})]))
    return requests


@pytest.fixture
def served(cache):
    log = Lines()
    harness = cache(server_kwargs={"logger": log}, chunk_size_tokens=256, chunk_bytes=OBJECT,
                    l1_size_bytes=8 * OBJECT, lmcache_ipc=True)
    client = LMClient(harness.config.lmcache_urls(0)[0])
    yield harness, client, log
    client.close()


def test_every_wrongly_typed_field_gets_an_answer_and_no_internal_error(served) -> None:
    """Each of ~1,000 malformed requests is answered; none is an internal error (a handler that raised
    something other than a client error); the process still registers and looks up afterwards."""
    _, client, log = served
    requests = _requests()
    assert len(requests) > 900
    for op, args in requests:
        client.call(op, *args)  # LMClient asserts that a reply came, echoing uid and op
    internal = [fields for level, event, fields in log.lines if fields.get("error_type") == "internal"
                or event in ("lmcache.request_failed", "request.failed") or level == "exception"]
    assert internal == []
    assert client.call("register", registration(2))["pool_size"] > 0
    assert client.call("lookup", key(list(range(512)), "r2", readers=1), 0) is NO_RESULT


def test_the_log_of_a_malformed_flood_is_bounded(served) -> None:
    """One client's ~1,000 malformed requests log at most one client.error line per operation and second (the
    per-client budget), each naming the client."""
    _, client, log = served
    requests = _requests()
    started = time.monotonic()
    for op, args in requests:
        client.call(op, *args)
    seconds = int(time.monotonic() - started) + 1
    errors = [fields for _, event, fields in log.lines if event == "client.error"]
    assert 1 <= len(errors) <= len({op for op, _ in requests}) * seconds
    assert all(fields["client"] for fields in errors)


@pytest.mark.parametrize("start, end", [(600, 700), (512, 10_000), (0, 10_000)])
def test_a_store_whose_range_lies_past_its_tokens_is_answered_with_nothing_to_write(served, start, end) -> None:
    """A key of 300 tokens (one whole chunk) whose ``[start, end)`` begins or ends past them: the store covers
    at most that one chunk, and nothing past it is named, hashed or failed internally."""
    _, client, log = served
    client.call("register", registration(1))
    tokens = list(range(300))
    context = client.call("prepare_store", key(tokens, "r", worker_id=0, start=start, end=end), 1)["context"]
    assert (0 if start else 1) == len(context.get("slots", []))
    assert [] == [fields for level, event, fields in log.lines if fields.get("error_type") == "internal"
                  or event in ("lmcache.request_failed", "request.failed") or level == "exception"]
