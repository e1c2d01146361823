"""Whom the LMCache front end trusts: a peer of another local uid is refused at the ZeroMQ handshake (no
poisoning, no membership oracle, no wipe), request state belongs to the uid that made it, ``clear`` needs
``lmcache_allow_clear``, one client cannot reserve more than a quarter of L1, one request cannot stop or
stall the process, a client cannot flood the log, and a non-loopback host needs ``lmcache_allow_remote``.

The service is the in-process harness (this process's uid) on ``tcp://127.0.0.1:P``; the foreign peer is
``tests/support/lmcache_attacker.py`` run as a throwaway system user (``tests/support/second_user.py``).  Log
lines are the harness's ``logger=`` (a recorder), so every front-end line must go through the cache process's
logger.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import queue
import subprocess
import threading
import time
from typing import Any

import msgpack
import pytest
import zmq
from support import zmq_sockets
from support.lmcache_client import NO_RESULT, OPS, LMClient, key, read_slots, registration, write_slots
from support.ports import free_port
from support.second_user import User
from support.waiting import wait_for
from zmq.utils.monitor import recv_monitor_message

from mpcache.cache.lmcache import groups, inline
from mpcache.cache.process import CacheProcess
from mpcache.contract.keys import ChunkKey, chunk_hashes, rank_hashes
from mpcache.errors import ConfigError
from mpcache.shm import layout

CHUNK = 256
LAYERS, HIDDEN = 2, 64
OBJECT = 2 * LAYERS * CHUNK * HIDDEN * 2  # fp16
MODEL = "org/model"
SALT = "tenant-a"
ATTACKER_INSTANCE = 666
REFUSAL_WAIT_S = 5.0


# -- the log, as the cache process writes it ------------------------------------------------------


class RecordingLog:
    """Stands in for the cache process's structlog logger: keeps (level, event, fields) of every call,
    from any thread; ``bind`` returns a logger that adds its fields and records into the same list."""

    _LEVELS = {"debug": "debug", "info": "info", "msg": "info", "warning": "warning", "warn": "warning",
               "error": "error", "exception": "error", "critical": "critical", "fatal": "critical"}

    def __init__(self, lines: list | None = None, lock: threading.Lock | None = None,
                 context: dict | None = None) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = [] if lines is None else lines
        self._lock = lock or threading.Lock()
        self._context = context or {}

    def bind(self, **fields: Any) -> RecordingLog:
        return RecordingLog(self.lines, self._lock, {**self._context, **fields})

    def new(self, **fields: Any) -> RecordingLog:
        return RecordingLog(self.lines, self._lock, fields)

    def __getattr__(self, name: str) -> Any:
        level = self._LEVELS.get(name)
        if level is None:
            raise AttributeError(name)

        def record(event: str = "", *args: Any, **fields: Any) -> None:
            if name == "exception":
                fields.setdefault("exc_info", True)
            with self._lock:
                self.lines.append((level, event, {**self._context, **fields}))

        return record

    def mark(self) -> int:
        with self._lock:
            return len(self.lines)

    def since(self, mark: int) -> list[tuple[str, str, dict[str, Any]]]:
        with self._lock:
            return list(self.lines[mark:])

    def events(self, event: str, level: str | None = None, since: int = 0, **match: Any) -> list[dict[str, Any]]:
        return [fields for lvl, name, fields in self.since(since)
                if name == event and (level is None or lvl == level)
                and all(fields.get(k) == v for k, v in match.items())]


# -- the service, a victim that maps the pool, and the foreign peer -------------------------------


class Served:
    """A harness serving LMCache's protocol on tcp://127.0.0.1:port, its log, and a victim (this uid) whose
    instance 1 is registered and whose pool is mapped as a worker maps it."""

    def __init__(self, harness: Any, log: RecordingLog, port: int) -> None:
        self.harness = harness
        self.log = log
        self.url = f"tcp://127.0.0.1:{port}"
        self._clients: list[LMClient] = []
        self.victim = self.client()
        reply = self.victim.call("register", registration(1, layers=LAYERS, hidden=HIDDEN))
        fd = os.open(os.path.join("/dev/shm", reply["shm_name"]), os.O_RDWR)
        self.pool = mmap.mmap(fd, reply["pool_size"])
        os.close(fd)

    def client(self, timeout_s: float = 5.0) -> LMClient:
        client = LMClient(self.url, timeout_s=timeout_s)
        self._clients.append(client)
        return client

    @property
    def heartbeat(self) -> int:
        return self.harness.board.word(0, layout.G_HEARTBEAT)

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.pool.close()


@pytest.fixture
def served(cache):
    """Factory: ``served(**config_overrides)`` → :class:`Served`; heartbeat every 0.1 s unless told."""
    made: list[Served] = []

    def start(heartbeat_interval_s: float = 0.1, **overrides: Any) -> Served:
        port = free_port()
        log = RecordingLog()
        values: dict[str, Any] = dict(chunk_size_tokens=CHUNK, chunk_bytes=OBJECT, l1_size_bytes=16 * OBJECT,
                                      lmcache_port=port)
        values.update(overrides)
        harness = cache(server_kwargs={"logger": log, "heartbeat_interval_s": heartbeat_interval_s}, **values)
        served = Served(harness, log, port)
        made.append(served)
        return served

    yield start
    for served in made:
        served.close()


class Attacker:
    """``tests/support/lmcache_attacker.py`` running as another user, driven one job at a time."""

    def __init__(self, user: User, url: str) -> None:
        self.user = user
        self.process = user.popen("support.lmcache_attacker", url, stderr=subprocess.STDOUT)
        self._lines: queue.Queue[str] = queue.Queue()
        self.noise: list[str] = []  # anything it printed that is not one of its JSON lines (a traceback)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def _next(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the attacker (uid {self.user.uid}) printed nothing within {timeout_s} s; "
                            f"its other output: {''.join(self.noise)[-2000:]!r}")
            try:
                value = json.loads(line)
            except ValueError:
                value = None
            if isinstance(value, dict):
                return value
            self.noise.append(line)

    def send(self, calls: list[list], timeout_s: float = 1.0, sync: bool = False) -> None:
        """Start a job: a fresh connection and every call sent (returns once it says so)."""
        self.start(calls, timeout_s, sync)
        self.wait_sent()

    def start(self, calls: list[list], timeout_s: float = 1.0, sync: bool = False) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"calls": calls, "timeout_s": timeout_s, "sync": sync}) + "\n")
        self.process.stdin.flush()

    def wait_sent(self) -> None:
        sent = self._next(30.0)
        assert "sent" in sent, sent

    def go(self) -> None:
        """Sync jobs: let it listen for its replies now."""
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def results(self, timeout_s: float = 15.0) -> list[dict]:
        out = []
        while True:
            line = self._next(timeout_s)
            if line.get("done"):
                return out
            out.append(line)

    def run(self, calls: list[list], timeout_s: float = 1.0) -> list[dict]:
        self.send(calls, timeout_s)
        return self.results(timeout_s + 15.0)

    def close(self) -> None:
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(5)
        except Exception:  # noqa: BLE001 - it must not outlive the test
            self.process.kill()
            self.process.wait(5)


@pytest.fixture
def attacker(second_user):
    """Factory: ``attacker(url)`` → an :class:`Attacker` running as the second user; stopped at teardown."""
    made: list[Attacker] = []

    def start(url: str) -> Attacker:
        made.append(Attacker(second_user, url))
        return made[-1]

    yield start
    for one in made:
        one.close()


def wait_refused(served: Served, uid: int, evil: Attacker) -> None:
    """Wait (bounded) for ``lmcache.peer_refused`` naming ``uid``; failing, say what the attacker got."""
    try:
        wait_for(lambda: served.log.events("lmcache.peer_refused", level="warning", uid=uid), REFUSAL_WAIT_S,
                 f"lmcache.peer_refused with uid={uid}", tolerate=())
    except AssertionError:
        evil.go()
        got = [(r["op"], "no_reply" if r.get("no_reply") else r.get("reply", "no result frame"))
               for r in evil.results()]
        pytest.fail(f"no lmcache.peer_refused warning with uid={uid} within {REFUSAL_WAIT_S} s; "
                    f"the foreign uid's requests got: {got}")


def no_reply(results: list[dict]) -> bool:
    return all(result.get("no_reply") for result in results)


# -- the victim's side ------------------------------------------------------------------------------


def store(served: Served, tokens: list[int], request: str, *, seed: int, salt: str = SALT,
          instance: int = 1, client: LMClient | None = None) -> list[bytes]:
    """Store ``tokens``' whole chunks as a worker does; the bytes written."""
    client = client or served.victim
    stored = key(tokens, request, worker_id=0, salt=salt)
    prepared = client.call("prepare_store", stored, instance)
    written = write_slots(served.pool, prepared["context"]["slots"], seed)
    assert len(written) == len(tokens) // CHUNK, prepared
    assert True is client.call("commit_store", stored, instance, b"")
    client.call("end_session", request)
    return written


def hits(client: LMClient, tokens: list[int], request: str, salt: str = SALT) -> Any:
    assert NO_RESULT is client.call("lookup", key(tokens, request, salt=salt), 1)
    return client.call("query_prefetch_status", request)


def locks(served: Served, tokens: list[int], salt: str = SALT) -> list[int]:
    keys = rank_hashes(chunk_hashes(tokens, CHUNK), 1, [0])
    return [served.harness.server.l1.readers(ChunkKey(MODEL, salt, k)) for k in keys]


def tokens_of(base: int, chunks: int) -> list[int]:
    return list(range(base, base + chunks * CHUNK))


_EMPTY = {"__bytes__": ""}  # b"" on the attacker's command line


# -- 1-3: a foreign uid is refused at the handshake ---------------------------------------------------


def test_a_foreign_uid_cannot_poison_a_prefix_the_victim_then_stores_and_reads_its_own_bytes(
        served, second_user, attacker):
    """A peer of another uid that registers, prepares and commits a prefix gets no reply to any of it
    (``lmcache.peer_refused`` with its uid); the prefix is no hit for the victim, whose own store of it gets
    slots and whose retrieve returns exactly the bytes the victim wrote."""
    service = served()
    store(service, tokens_of(100_000, 2), "other", seed=1)  # stale bytes of another prefix in the pool
    poisoned = tokens_of(200_000, 2)
    evil = attacker(service.url)
    evil_key = key(poisoned, "evil", worker_id=0, salt=SALT)
    evil.send([["register", registration(ATTACKER_INSTANCE, layers=LAYERS, hidden=HIDDEN)],
               ["prepare_store", evil_key, ATTACKER_INSTANCE],
               ["commit_store", evil_key, ATTACKER_INSTANCE, _EMPTY]], timeout_s=1.0, sync=True)
    wait_refused(service, second_user.uid, evil)
    evil.go()
    results = evil.results()
    assert no_reply(results), f"the foreign uid was answered: {results}"
    assert 0 == hits(service.victim, poisoned, "victim-look")
    victim_key = key(poisoned, "victim", worker_id=0, salt=SALT)
    prepared = service.victim.call("prepare_store", victim_key, 1)
    assert 2 == len(prepared["context"]["slots"]), f"the victim's own store got no slots: {prepared}"
    written = write_slots(service.pool, prepared["context"]["slots"], seed=2)
    assert True is service.victim.call("commit_store", victim_key, 1, b"")
    assert 2 == hits(service.victim, poisoned, "victim-read")
    got = service.victim.call("prepare_retrieve", key(poisoned, "victim-read", worker_id=0, salt=SALT), 1)
    assert written == read_slots(service.pool, got["context"]["slots"])
    assert True is service.victim.call("commit_retrieve", key(poisoned, "victim-read", worker_id=0, salt=SALT), 1)


def test_a_foreign_uid_cannot_tell_whether_a_prefix_is_cached(served, second_user, attacker):
    """The membership oracle is closed: a foreign uid's lookup and query_prefetch_status for a prefix the
    victim stored (same tokens, same salt) get no reply at all, not a hit count."""
    service = served()
    stored = tokens_of(300_000, 2)
    store(service, stored, "w", seed=3)
    evil = attacker(service.url)
    evil.send([["lookup", key(stored, "spy", salt=SALT), 1], ["query_prefetch_status", "spy"]],
              timeout_s=1.0, sync=True)
    wait_refused(service, second_user.uid, evil)
    evil.go()
    results = evil.results()
    assert no_reply(results), f"the foreign uid was answered: {results}"


def test_a_foreign_uid_cannot_clear_l1_even_where_clear_is_allowed(served, second_user, attacker):
    """With ``lmcache_allow_clear=True``, a foreign uid's ``clear`` still gets no reply and L1 is unchanged:
    the victim's chunks are still hits."""
    service = served(lmcache_allow_clear=True)
    stored = tokens_of(400_000, 2)
    store(service, stored, "w", seed=4)
    used = len(service.harness.server.l1)
    evil = attacker(service.url)
    evil.send([["clear", False]], timeout_s=1.0, sync=True)
    wait_refused(service, second_user.uid, evil)
    evil.go()
    results = evil.results()
    assert no_reply(results), f"the foreign uid was answered: {results}"
    assert used == len(service.harness.server.l1)
    assert 2 == hits(service.victim, stored, "after")


def test_clear_from_the_services_own_uid_is_refused_by_default_with_one_warning_per_client(served):
    """Without ``lmcache_allow_clear`` a ``clear`` over the LMCache protocol, even from the service's own
    uid, is answered but empties nothing; ``lmcache.clear_refused`` is logged once per client."""
    service = served()
    stored = tokens_of(500_000, 2)
    store(service, stored, "w", seed=5)
    first, second = service.client(), service.client()
    assert [NO_RESULT] * 3 == [first.call("clear", False), first.call("clear", False), second.call("clear", False)]
    assert 2 == len(service.log.events("lmcache.clear_refused", level="warning")), service.log.since(0)
    assert 2 == hits(service.victim, stored, "after")


def test_clear_empties_l1_where_lmcache_allow_clear_is_set(served):
    """With ``lmcache_allow_clear=True`` the service's own uid's ``clear`` empties L1."""
    service = served(lmcache_allow_clear=True)
    stored = tokens_of(510_000, 2)
    store(service, stored, "w", seed=6)
    assert NO_RESULT is service.client().call("clear", False)
    assert 0 == len(service.harness.server.l1)
    assert 0 == hits(service.victim, stored, "after")
    assert not service.log.events("lmcache.clear_refused")


def test_a_prepare_store_storm_reserves_at_most_a_quarter_of_l1(served):
    """Uncommitted prepare_stores of many prefixes from one registration reserve at most a quarter of L1's
    bytes in all (here 4 of 16 objects; beyond it: no slots, ``{"context": {"slots": [], "chunk_indices":
    []}}`` or fewer slots), and the victim's committed chunks stay hits."""
    service = served(l1_size_bytes=16 * OBJECT)
    stored = tokens_of(600_000, 4)
    store(service, stored, "w", seed=7)
    storm = service.client()
    storm.call("register", registration(2, layers=LAYERS, hidden=HIDDEN))
    replies = [storm.call("prepare_store", key(tokens_of(1_000_000 + i * CHUNK * 7, 1), f"storm{i}", worker_id=0,
                                               salt=SALT), 2) for i in range(24)]
    for reply in replies:
        context = reply["context"]
        assert len(context["slots"]) == len(context["chunk_indices"]), reply
    reserved = sum(len(reply["context"]["slots"]) for reply in replies)
    assert 1 <= reserved <= max(1, 16 // 4), f"24 uncommitted prepare_stores reserved {reserved} of 16 slots"
    assert 4 == hits(service.victim, stored, "after")


def _reserved(client: LMClient, instance: int, base: int, requests: int) -> int:
    """Slots ``requests`` uncommitted one-chunk prepare_stores of ``instance`` got, each a new prefix."""
    replies = [client.call("prepare_store", key(tokens_of(base + i * CHUNK * 7, 1), f"p{instance}-{i}", worker_id=0,
                                                salt=SALT), instance) for i in range(requests)]
    return sum(len(reply["context"].get("slots", [])) for reply in replies)


def test_one_connection_with_many_registrations_reserves_at_most_a_quarter_of_l1(served):
    """The uncommitted share is the connection's, not each instance id's: one connection that registers four
    instance ids and prepares stores under each (they used to get a quarter each: all of L1, until the TTL)
    holds at most a quarter of L1's bytes in all (4 of 16 objects), and the victim's chunks stay hits."""
    service = served(l1_size_bytes=16 * OBJECT)
    stored = tokens_of(620_000, 4)
    store(service, stored, "w", seed=9)
    storm = service.client()
    for instance in (2, 3, 4, 5):
        storm.call("register", registration(instance, layers=LAYERS, hidden=HIDDEN))
    reserved = sum(_reserved(storm, instance, 2_000_000 + instance * 100_000, 6) for instance in (2, 3, 4, 5))
    assert 1 <= reserved <= 16 // 4, f"one connection's uncommitted prepare_stores reserved {reserved} of 16 slots"
    assert 4 == hits(service.victim, stored, "after")


def test_each_workers_connection_has_its_own_share(served):
    """The share is per connection, so a tensor-parallel engine's workers (a connection each, one uid) each
    reserve their own quarter: two connections, a quarter each, 8 of 16 objects in all."""
    service = served(l1_size_bytes=16 * OBJECT)
    reserved = []
    for instance in (10, 11):
        worker = service.client()
        worker.call("register", registration(instance, layers=LAYERS, hidden=HIDDEN))
        reserved.append(_reserved(worker, instance, 3_000_000 + instance * 100_000, 6))
    assert [16 // 4, 16 // 4] == reserved


# -- 4: one request cannot stop or stall the process ---------------------------------------------------


def _frames(op: str, *payloads: bytes, uid: int = 7) -> list[bytes]:
    return [msgpack.packb(uid), msgpack.packb(OPS[op]), *payloads]


def _still_serving(service: Served, thread_ident: int, stored: list[int], request: str) -> None:
    """The same server thread is alive, the heartbeat advances, and a new client gets the stored hits."""
    assert service.harness.thread.is_alive() and thread_ident == service.harness.thread.ident
    beat = service.heartbeat
    wait_for(lambda: service.heartbeat > beat, timeout_s=5, what="the heartbeat to advance", tolerate=())
    assert len(stored) // CHUNK == hits(service.client(), stored, request)


def test_a_frame_over_the_cap_drops_the_connection_unanswered_and_the_process_keeps_serving(served):
    """A 40 MB frame (far over ``5 * lmcache_max_tokens + 1 MiB``) is not answered: the connection is
    dropped; the process keeps serving with its L1 unchanged."""
    service = served()
    stored = tokens_of(700_000, 2)
    store(service, stored, "w", seed=8)
    thread_ident = service.harness.thread.ident
    client = service.client()
    assert True is client.call("ping", None)  # connected
    monitor = zmq_sockets.bounded(client.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED))
    try:
        client.socket.send_multipart(_frames("lookup", msgpack.packb(b"\0" * 40_000_000), msgpack.packb(1)))
        wait_for(lambda: client.socket.poll(0) or monitor.poll(0), timeout_s=20,
                 what="a reply or the connection to drop", tolerate=())
        assert not client.socket.poll(0), "a 40 MB frame was answered: the message size cap is not enforced"
        assert zmq.EVENT_DISCONNECTED == recv_monitor_message(monitor)["event"]
        assert not client.socket.poll(200), "no reply comes for the dropped frame"
    finally:
        client.socket.disable_monitor()
        monitor.close(linger=0)
    _still_serving(service, thread_ident, stored, "after")


def test_a_frame_of_millions_of_empty_maps_is_refused_by_the_decoders_budget(served):
    """About 4 MiB of empty msgpack maps (under the cap) as a lookup's key is refused by the decoder's container
    budget (at most one container per 8 bytes of frame: it stops before building millions of dicts) and answered
    with the failure value (no result frame), and the process keeps serving unchanged.  How fast that is belongs
    to the benchmarks; here the answer only has to come within the deadline of the 40 MB frame above."""
    service = served()
    stored = tokens_of(800_000, 2)
    store(service, stored, "w", seed=9)
    thread_ident = service.harness.thread.ident
    client = service.client()
    assert True is client.call("ping", None)
    maps = msgpack.packb([[{}] * 1024] * 4096)
    assert 4 << 20 <= len(maps) < 5 << 20
    sent = _frames("lookup", maps, msgpack.packb(1))
    mark = service.log.mark()
    client.socket.send_multipart(sent)
    assert client.socket.poll(20_000), "no answer within 20 s to a lookup of 4 MiB of empty maps"
    assert sent[:2] == client.socket.recv_multipart(), "the failure value of a lookup is a reply without a result"
    assert ["malformed frame: more nested containers than its size allows"] == [
        fields["error"] for fields in service.log.events("client.error", since=mark, op="lookup")]
    _still_serving(service, thread_ident, stored, "after")


def test_pipelined_lookups_of_the_most_tokens_are_all_answered_while_the_heartbeat_beats(served):
    """Twenty-four pipelined lookups of exactly ``lmcache_max_tokens`` tokens are all answered (with their hits),
    one of ``lmcache_max_tokens + 1`` is refused, and the heartbeat advances while the backlog is worked off:
    the loop returns to its timers between messages (the backlog outlasts several passes of
    ``PASS_BUDGET_S``, however fast a lookup is decoded)."""
    max_tokens = 1 << 18
    service = served(lmcache_max_tokens=max_tokens, heartbeat_interval_s=0.02)
    tokens = list(range(max_tokens))
    store(service, tokens[:CHUNK], "w", seed=10)
    client = service.client()
    assert True is client.call("ping", None)
    requests = [f"big{i}" for i in range(24)] + ["over"]
    frames = [_frames("lookup", msgpack.packb(key(tokens, request, salt=SALT)), msgpack.packb(1), uid=index)
              for index, request in enumerate(requests[:24])]
    frames.append(_frames("lookup", msgpack.packb(key(tokens + [1], "over", salt=SALT)), msgpack.packb(1), uid=24))
    for sent in frames:
        client.socket.send_multipart(sent)
    beats = []
    for index in range(len(frames)):
        assert client.socket.poll(10_000), f"lookup {index} of the pipelined backlog was not answered in 10 s"
        reply = client.socket.recv_multipart()
        beats.append(service.heartbeat)
        assert frames[index][:2] == reply, f"reply {index}: {reply[:2]!r}"
    assert beats[-2] > beats[1], f"no heartbeat while pipelined lookups 3-24 were worked off: {beats}"
    assert [1] * 24 + [0] == [client.call("query_prefetch_status", request) for request in requests]


@pytest.mark.parametrize(("start", "end"), [(2 * CHUNK, CHUNK), (0, 2**62), (2**62, 2**62 + CHUNK)],
                         ids=["inverted", "end-2**62", "start-2**62"])
def test_free_lookup_locks_with_an_inverted_or_huge_range_is_refused_and_frees_nothing(served, start, end):
    """``free_lookup_locks`` whose range is inverted (start > end) or reaches 2**62 is refused with a
    ``client.error`` warning and changes no lock; the lookup's locks go with its session as usual."""
    service = served()
    stored = tokens_of(900_000, 2)
    store(service, stored, "w", seed=11)
    assert 2 == hits(service.victim, stored, "r")
    assert [1, 1] == locks(service, stored)
    mark = service.log.mark()
    assert NO_RESULT is service.victim.call("free_lookup_locks", key(stored, "r", start=start, end=end, salt=SALT), 1)
    assert service.log.events("client.error", level="warning", since=mark, op="free_lookup_locks"), \
        f"no client.error for free_lookup_locks [{start}, {end}): {service.log.since(mark)}"
    assert [1, 1] == locks(service, stored)
    assert NO_RESULT is service.victim.call("end_session", "r")
    assert [0, 0] == locks(service, stored)


# -- 5: request state belongs to its uid; transfers to their instance ---------------------------------


def test_an_allowed_second_uid_cannot_read_or_release_another_uids_request_state(served, second_user, attacker):
    """With ``lmcache_allow_uids=[second uid]`` that uid is answered, but a request id another uid looked up
    is not its: its query_prefetch_status says 0, its end_session and free_lookup_locks release nothing;
    the owner still gets its hit count and retrieves its bytes."""
    service = served(lmcache_allow_uids=[second_user.uid])
    stored = tokens_of(1_100_000, 2)
    written = store(service, stored, "w", seed=12)
    assert NO_RESULT is service.victim.call("lookup", key(stored, "R", salt=SALT), 1)
    assert [1, 1] == locks(service, stored)
    other = attacker(service.url)
    results = other.run([["query_prefetch_status", "R"], ["end_session", "R"],
                         ["free_lookup_locks", key(stored, "R", salt=SALT), 1]], timeout_s=5.0)
    assert [{"op": "query_prefetch_status", "reply": 0}, {"op": "end_session", "no_result": True},
            {"op": "free_lookup_locks", "no_result": True}] == results
    assert [1, 1] == locks(service, stored)
    assert 2 == service.victim.call("query_prefetch_status", "R")
    got = service.victim.call("prepare_retrieve", key(stored, "R", worker_id=0, salt=SALT), 1)
    assert written == read_slots(service.pool, got["context"]["slots"])
    assert True is service.victim.call("commit_retrieve", key(stored, "R", worker_id=0, salt=SALT), 1)
    assert [0, 0] == locks(service, stored)


def test_an_allowed_second_uid_moves_its_bytes_inline_and_is_given_no_slot(served, second_user, attacker):
    """A second uid cannot map the 0600 pool, so it is told ``shm_name ""`` (LMCache 0.5.7's inline transfer):
    its prepare_store gets no slot and an empty commit_store stores nothing (a slot it never wrote would have
    become readable with whatever bytes it held); its objects sent inline are the victim's hits, byte for byte."""
    service = served(lmcache_allow_uids=[second_user.uid])
    stored = tokens_of(1_200_000, 2)
    sent = [bytes([index + 1]) * OBJECT for index in range(2)]
    payload = {"__bytes__": inline.encode(groups.layout([2, LAYERS, CHUNK, HIDDEN], "float16"), sent).hex()}
    other = attacker(service.url)
    again = key(stored, "E", worker_id=0, salt=SALT)
    results = other.run([["register", {**registration(7, layers=LAYERS, hidden=HIDDEN), "group_layouts": []}],
                         ["prepare_store", again, 7, []], ["commit_store", again, 7, {"__bytes__": ""}]], timeout_s=5.0)
    assert [{"op": "register", "reply": {"shm_name": "", "pool_size": 0, "null_block_id": 0}},
            {"op": "prepare_store", "reply": {"context": {}}}, {"op": "commit_store", "reply": False}] == results
    assert 0 == hits(service.client(), stored, "R0")
    assert [{"op": "commit_store", "reply": True}] == other.run([["commit_store", again, 7, payload]], timeout_s=5.0)
    assert 2 == hits(service.victim, stored, "R1")
    got = service.victim.call("prepare_retrieve", key(stored, "R1", worker_id=0, salt=SALT), 1)
    assert sent == read_slots(service.pool, got["context"]["slots"])


def test_commit_store_of_slots_another_instance_prepared_is_refused(served):
    """Same uid: commit_store naming instance B for slots instance A prepared returns False, and those slots
    stay unreadable (a lookup reports 0 hits)."""
    service = served()
    other = service.client()
    other.call("register", registration(2, layers=LAYERS, hidden=HIDDEN))
    tokens = tokens_of(1_200_000, 2)
    prepared_key = key(tokens, "s", worker_id=0, salt=SALT)
    prepared = service.victim.call("prepare_store", prepared_key, 1)
    assert 2 == len(prepared["context"]["slots"])
    write_slots(service.pool, prepared["context"]["slots"], seed=13)
    assert False is other.call("commit_store", prepared_key, 2, b"")
    assert 0 == hits(other, tokens, "look")


# -- 6: the log cannot be flooded -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [{"float16": 2}, ["float16"]], ids=["map", "list"])
def test_a_registration_whose_dtype_is_not_a_string_is_refused_without_a_traceback(served, dtype):
    """``register`` with ``dtype_str`` a map or a list gets ``{"shm_name": "", "pool_size": 0}``, logs no
    ``lmcache.request_failed`` (no traceback) and at most one warning per client for that fault."""
    service = served()
    for client in (service.client(), service.client()):
        mark = service.log.mark()
        payload = registration(3, layers=LAYERS, hidden=HIDDEN)
        payload["dtype_str"] = dtype
        assert [{"shm_name": "", "pool_size": 0}] * 5 == [client.call("register", payload) for _ in range(5)]
        lines = service.log.since(mark)
        assert not [line for line in lines if line[1] == "lmcache.request_failed" or line[2].get("exc_info")], lines
        assert len([line for line in lines if line[0] in ("warning", "error", "critical")]) <= 1, lines


def test_pings_from_ever_new_instance_ids_are_answered_and_their_log_lines_are_rate_limited(served):
    """2000 pings, each naming a new instance id, are all answered and cause at most 30 log lines; a later
    line says how many were ``suppressed``."""
    service = served()
    client = service.client()
    ids = itertools.count(10_000)
    mark = service.log.mark()
    replies = [client.call("ping", next(ids)) for _ in range(2000)]
    assert all(type(reply) is bool for reply in replies)
    burst = service.log.since(mark)
    assert len(burst) <= 30, f"2000 pings caused {len(burst)} log lines, e.g. {burst[:2]}"
    wait_for(lambda: type(client.call("ping", next(ids))) is bool
             and any(line[2].get("suppressed") for line in service.log.since(mark)),
             timeout_s=5, what="a line with the suppressed count", tolerate=())


# -- 7: a non-loopback host needs lmcache_allow_remote ------------------------------------------------------


def test_a_non_loopback_lmcache_host_is_refused_naming_both_flags(provisioned):
    """``lmcache_host="0.0.0.0"`` without ``lmcache_allow_remote`` is a ConfigError naming
    ``--lmcache-host`` and ``--lmcache-allow-remote`` (from Config or from building the cache process)."""
    with pytest.raises(ConfigError) as refused:
        config = provisioned(lmcache_port=free_port(), lmcache_host="0.0.0.0")
        CacheProcess(config, 0).close()
    assert "--lmcache-host" in str(refused.value) and "--lmcache-allow-remote" in str(refused.value)


def test_a_non_loopback_lmcache_host_starts_with_lmcache_allow_remote(cache):
    """With ``lmcache_allow_remote=True`` a cache process on ``0.0.0.0`` starts and answers on loopback."""
    port = free_port()
    cache(lmcache_port=port, lmcache_host="0.0.0.0", lmcache_allow_remote=True)
    client = LMClient(f"tcp://127.0.0.1:{port}")
    try:
        assert True is client.call("ping", None)
    finally:
        client.close()


# -- 8: the race ------------------------------------------------------------------------------------------


def test_a_foreign_and_an_allowed_client_connecting_together_foreign_never_answered(served, second_user, attacker):
    """20 rounds, fresh sockets each: a foreign client and an allowed one connect at the same moment; the
    foreign one (which asks for the allowed one's request) never gets a reply, the allowed one always gets
    its own hit count within 5 s."""
    service = served()
    stored = tokens_of(1_300_000, 2)
    store(service, stored, "w", seed=14)
    evil = attacker(service.url)
    evil.send([["ping", None]], timeout_s=0.01)  # the attacker's interpreter is up: rounds start together
    evil.results()
    for round_ in range(20):
        request = f"race{round_}"
        calls = [["query_prefetch_status", request], ["lookup", key(stored, f"evil{round_}", salt=SALT), 1]]
        if round_ % 2 == 0:
            evil.start(calls, timeout_s=0.3, sync=True)
            allowed = LMClient(service.url, timeout_s=5.0)
        else:
            allowed = LMClient(service.url, timeout_s=5.0)
            evil.start(calls, timeout_s=0.3, sync=True)
        try:
            started = time.monotonic()
            assert 2 == hits(allowed, stored, request), f"round {round_}: the allowed client's hits"
            assert time.monotonic() - started < 5.0
        finally:
            allowed.close()
        evil.wait_sent()
        if round_ == 0:
            wait_refused(service, second_user.uid, evil)
        evil.go()
        results = evil.results()
        assert no_reply(results), f"round {round_}: the foreign uid was answered: {results}"


def test_with_a_second_uid_allowed_a_request_s_blocks_and_its_end_name_the_same_request(served):
    """Where more than one uid is served, a request id is scoped by its uid (another uid's "R" is not this one's):
    the blocks a request reports and its end_session name it alike, so the L0 lifecycle sees the request end (its
    blocks reported under the bare id never got an end, and aged out instead)."""
    from mpcache.contract.events import EventType as E

    service = served(lmcache_allow_uids=[os.geteuid() + 4242])
    service.harness.events.take()
    records = [{"req_id": "R", "new_block_ids": [3, 4], "new_token_ids": list(range(32))}]
    assert NO_RESULT is service.victim.call("report_block_allocation", 7, "org/model", records)
    assert NO_RESULT is service.victim.call("end_session", "R")
    batch = service.harness.events.take()
    [allocation] = batch.events([E.MP_VLLM_BLOCK_ALLOCATION])
    ended = [event.session_id for event in batch.events([E.MP_VLLM_END_SESSION])]
    assert [f"{os.geteuid()}/R"] * 2 == [request for request, _, _ in allocation.blocks] == ended * 2
