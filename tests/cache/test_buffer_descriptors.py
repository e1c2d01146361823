"""Client KV buffers by descriptor, against an in-process server: what the server accepts
with ``register_buffer`` (a memfd sealed against shrinking, large enough), what it refuses, and that every
descriptor it receives is closed — with its reply, with an unfinished frame's connection, or at once when a
frame brings too many.  The server runs in this process, so its open descriptors are this process's.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket

import msgpack
import numpy as np
import pytest
from support.cache_harness import CHUNK_BYTES, MODEL, CapturedLog
from support.raw_frames import RawConn
from support.waiting import wait_for

from mpcache.cache import buffers
from mpcache.cache.native.transport import MAX_FDS_PER_FRAME
from mpcache.contract import protocol
from mpcache.shm import layout

BLOCKS = 4


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since the listing
        return ""


def memfd(size: int, seals: int | None = fcntl.F_SEAL_SHRINK) -> int:
    """A memfd of ``size`` bytes with ``seals`` (None: created without MFD_ALLOW_SEALING)."""
    fd = os.memfd_create("mpcache-test", os.MFD_CLOEXEC | (0 if seals is None else os.MFD_ALLOW_SEALING))
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def register(conn: RawConn, fds: list[int], num_blocks: int = BLOCKS, block_bytes: int = CHUNK_BYTES) -> dict:
    return conn.request({"op": "register_buffer", "id": 7, "num_blocks": num_blocks, "block_bytes": block_bytes},
                        fds)


def store(buffer_id: int, hashes: list[int]) -> dict:
    return {"op": "store", "id": 8, "buffer_id": buffer_id, "request_id": f"s{hashes[0]}", "model_name": MODEL,
            "chunk_hashes": hashes, "block_ids": list(range(len(hashes)))}


def is_closed_everywhere(read_end: int) -> bool:
    """The pipe's write end is closed in every process (its read end sees EOF, not "would block")."""
    try:
        return b"" == os.read(read_end, 1)
    except BlockingIOError:
        return False


def pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    return read_end, write_end


@pytest.fixture
def served(cache):
    """A running server whose client errors are captured, and a raw connection to it that it has accepted."""
    log = CapturedLog()
    harness = cache(server_kwargs={"logger": log})
    conn = RawConn(harness.config.socket_path(0))
    assert True is conn.request({"op": "ping", "id": 0})["ok"]
    yield harness, conn, log
    conn.close()


def test_a_sealed_memfd_is_mapped_and_its_bytes_round_trip(served):
    """A hand-crafted client's memfd, sealed with F_SEAL_SHRINK, registers; a store reads the bytes the client
    wrote into it, a retrieve writes them back into other blocks, and the server keeps no descriptor for it:
    its mapping is all it holds (Python's mmap kept a duplicate descriptor per buffer, and one client's sparse
    buffers drove a cache process to its descriptor limit in 1.6 s)."""
    harness, conn, _ = served
    fd = memfd(2 * BLOCKS * CHUNK_BYTES)
    view = np.frombuffer(mmap.mmap(fd, 2 * BLOCKS * CHUNK_BYTES), dtype=np.uint8).reshape(-1, CHUNK_BYTES)
    view[:BLOCKS] = np.random.default_rng(3).integers(0, 256, (BLOCKS, CHUNK_BYTES), dtype=np.uint8)
    before = open_fds()
    buffer_id = register(conn, [fd], num_blocks=2 * BLOCKS)["buffer_id"]
    registered = open_fds()
    assert BLOCKS == conn.request(store(buffer_id, [1, 2, 3, 4]))["stored_count"]
    job = conn.request({"op": "lookup_prefetch", "id": 9, "request_id": "r", "model_name": MODEL,
                        "chunk_hashes": [1, 2, 3, 4]})["job_id"]
    reply = conn.request({"op": "retrieve", "id": 10, "buffer_id": buffer_id, "request_id": "r", "job_id": job,
                          "block_ids": list(range(BLOCKS, 2 * BLOCKS))})
    os.close(fd)
    assert (BLOCKS, True) == (reply["retrieved_count"], bool(np.array_equal(view[:BLOCKS], view[BLOCKS:])))
    assert before == registered


# name -> (descriptors to send, built in the test; error_type; part of the one-line error)
REFUSED = {
    "unsealed memfd": (lambda: [memfd(BLOCKS * CHUNK_BYTES, seals=0)], "request",
                       "the memfd is not sealed against shrinking (F_SEAL_SHRINK)"),
    "memfd that takes no seals": (lambda: [memfd(BLOCKS * CHUNK_BYTES, seals=None)], "request",
                                  "not sealed against shrinking"),
    "sealed memfd smaller than the buffer": (lambda: [memfd(BLOCKS * CHUNK_BYTES - 1)], "request",
                                             f"the memfd is {BLOCKS * CHUNK_BYTES - 1} bytes, num_blocks × "
                                             f"block_bytes is {BLOCKS * CHUNK_BYTES}"),
    "read-only sealed memfd": (lambda: [_read_only(memfd(BLOCKS * CHUNK_BYTES))], "request",
                               "cannot map the memfd"),
    "pipe": (lambda: [_pipe_end()], "request", "the descriptor is a pipe, not a memfd"),
    "socket": (lambda: [_socket_end()], "request", "the descriptor is a socket, not a memfd"),
    "character device": (lambda: [os.open(os.devnull, os.O_RDWR)], "request", "is a character device"),
    "file on disk": (lambda: [os.open(__file__, os.O_RDONLY)], "request", "not a memfd (it takes no seals)"),
    "no descriptor": (lambda: [], "protocol",
                      "register_buffer: expects one file descriptor (SCM_RIGHTS) with its frame, got 0"),
    "two sealed memfds": (lambda: [memfd(BLOCKS * CHUNK_BYTES), memfd(BLOCKS * CHUNK_BYTES)], "protocol",
                          "expects one file descriptor (SCM_RIGHTS) with its frame, got 2"),
}


def _read_only(fd: int) -> int:
    read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    os.close(fd)
    return read_only


def _pipe_end() -> int:
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def _socket_end() -> int:
    one, other = socket.socketpair()
    other.close()
    return one.detach()


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_descriptor_is_refused_with_one_line_and_closed_and_the_server_serves_on(served, case):
    """register_buffer with each bad descriptor (or count of them) gets one one-line error reply and one
    client.error warning, and leaves no descriptor open in the server; the same connection then registers
    a good memfd and stores from it."""
    _, conn, log = served
    build, error_type, fragment = REFUSED[case]
    before = open_fds()
    fds = build()
    reply = register(conn, fds)
    for fd in fds:
        os.close(fd)
    assert (False, error_type) == (reply["ok"], reply["error_type"])
    assert fragment in reply["error"] and "\n" not in reply["error"]
    assert [("client.error", "register_buffer")] == [(event, fields["op"]) for event, fields in log.warnings]
    assert before == open_fds()
    good = memfd(BLOCKS * CHUNK_BYTES)
    buffer_id = register(conn, [good])["buffer_id"]
    os.close(good)
    assert 1 == conn.request(store(buffer_id, [hash(case) & 0xFFFF_FFFF]))["stored_count"]


@pytest.mark.parametrize("payload", [msgpack.packb({"op": "ping", "id": 1}), b"\xc1",
                                     msgpack.packb({"op": "explode", "id": 2})], ids=["ping", "garbage", "unknown op"])
def test_descriptors_sent_with_a_request_that_takes_none_are_closed_and_refused(served, payload):
    """A descriptor sent with ping, a malformed payload or an unknown operation gets a protocol error
    reply and is closed (the pipe's write end it was is closed everywhere); after 20 such requests no
    descriptor of the process refers to any of the 20 pipes (other threads' descriptors do not count),
    and the connection still answers a ping."""
    _, conn, _ = served
    replies, pipes = [], set()
    for _ in range(20):
        read_end, write_end = pipe()
        pipes.add(os.readlink(f"/proc/self/fd/{write_end}"))  # "pipe:[inode]", both ends alike
        conn.send_payload(payload, [write_end])
        os.close(write_end)
        replies.append(conn.reply())
        replies[-1]["closed"] = is_closed_everywhere(read_end)
        os.close(read_end)
    assert ([], [("protocol", True)] * 20) == (
        [fd for fd in os.listdir("/proc/self/fd") if _link(fd) in pipes],
        [(r["error_type"], r["closed"]) for r in replies])
    assert True is conn.request({"op": "ping", "id": 3})["ok"]


def test_more_descriptors_than_a_frame_may_carry_close_the_connection_and_all_of_them(served):
    """A ping sent with one descriptor more than a frame may carry gets an error reply (id nil) and its
    connection is closed; every one of those descriptors is closed, and another connection is served."""
    harness, conn, _ = served
    before = open_fds()
    pipes = [pipe() for _ in range(MAX_FDS_PER_FRAME + 1)]
    conn.send_payload(msgpack.packb({"op": "ping", "id": 1}), [write_end for _, write_end in pipes])
    for _, write_end in pipes:
        os.close(write_end)
    reply = conn.reply()
    assert (False, None, "protocol") == (reply["ok"], reply["id"], reply["error_type"])
    assert f"more than {MAX_FDS_PER_FRAME} file descriptors with one frame" in reply["error"]
    assert b"" == conn.sock.recv(1)
    assert [True] * len(pipes) == [is_closed_everywhere(read_end) for read_end, _ in pipes]
    for read_end, _ in pipes:
        os.close(read_end)
    assert before - 1 == open_fds()  # and the server's end of the connection is closed
    fresh = RawConn(harness.config.socket_path(0))
    assert True is fresh.request({"op": "ping", "id": 2})["ok"]
    fresh.close()


def test_the_descriptor_of_a_frame_never_finished_is_closed_with_its_connection(served):
    """A client sends the first half of a register_buffer frame with a descriptor and disconnects: the
    server closes that descriptor when it drops the connection."""
    _, conn, _ = served
    read_end, write_end = pipe()
    frame = protocol.encode_frame({"op": "register_buffer", "id": 1, "num_blocks": 1, "block_bytes": CHUNK_BYTES})
    socket.send_fds(conn.sock, [frame[: len(frame) // 2]], [write_end])
    os.close(write_end)
    conn.sock.close()
    wait_for(lambda: is_closed_everywhere(read_end), 5, "the server to close the unfinished frame's descriptor",
             tolerate=())
    os.close(read_end)


def test_a_descriptor_goes_to_the_frame_it_was_sent_with_among_pipelined_frames(served):
    """Frames sent back to back — a ping, a register_buffer whose first 3 bytes carry the memfd and whose
    rest follows in another send, a ping — are answered in order, each correctly: the memfd belongs to the
    register_buffer frame, and neither ping is refused for carrying it."""
    _, conn, _ = served
    fd = memfd(BLOCKS * CHUNK_BYTES)
    ping = protocol.encode_frame({"op": "ping", "id": 1})
    frame = protocol.encode_frame({"op": "register_buffer", "id": 2, "num_blocks": BLOCKS, "block_bytes": CHUNK_BYTES})
    conn.sock.sendall(ping)
    socket.send_fds(conn.sock, [frame[:3]], [fd])
    conn.sock.sendall(frame[3:] + protocol.encode_frame({"op": "ping", "id": 3}))
    os.close(fd)
    replies = [conn.reply() for _ in range(3)]
    assert [(1, True), (2, True), (3, True)] == [(r["id"], r["ok"]) for r in replies]
    assert 1 == conn.request(store(replies[1]["buffer_id"], [99]))["stored_count"]


def test_the_client_buffer_is_a_memfd_its_owner_cannot_shrink(cache):
    """A buffer from CacheClient.register_buffer is a memfd sealed against shrinking (ftruncate fails with
    EPERM, the size stays) and has no name in /dev/shm."""
    client = cache().client()
    kv = client.register_buffer(2, CHUNK_BYTES)
    with pytest.raises(PermissionError):
        os.ftruncate(kv.fd, CHUNK_BYTES)
    seals = fcntl.fcntl(kv.fd, fcntl.F_GET_SEALS)
    assert (2 * CHUNK_BYTES, fcntl.F_SEAL_SHRINK) == (os.fstat(kv.fd).st_size, seals & fcntl.F_SEAL_SHRINK)
    assert [] == [n for n in os.listdir("/dev/shm") if kv.name in n]
    assert f"/memfd:{kv.name}" == os.readlink(f"/proc/self/fd/{kv.fd}").split(" ")[0]


def _refused_buffers(harness) -> int:
    return harness.board.word(0, layout.G_BUFFERS_REFUSED)


def test_a_connection_past_its_buffer_budget_is_refused_in_one_line_and_counted(served):
    """The 65th buffer of one connection is refused with one line naming the budget and the fix, counted in
    the gauge word ``mpcache_buffers_refused_total`` reads; after one is unregistered, another registers."""
    harness, conn, log = served
    fd = memfd(BLOCKS * CHUNK_BYTES)
    try:
        ids = [register(conn, [fd])["buffer_id"] for _ in range(buffers.MAX_BUFFERS_PER_PEER)]
        refused = register(conn, [fd])
        assert (False, "request") == (refused["ok"], refused["error_type"])
        assert f"at most {buffers.MAX_BUFFERS_PER_PEER} buffers per connection" in refused["error"]
        assert 1 == _refused_buffers(harness)
        assert conn.request({"op": "unregister_buffer", "id": 3, "buffer_id": ids[0]})["ok"]
        assert register(conn, [fd])["ok"]
    finally:
        os.close(fd)


def test_many_connections_cannot_take_more_buffers_than_the_process_budget(served, monkeypatch):
    """Connections each within their own budget still share the process's (its mappings and address space):
    with a process budget of 3 buffers, two connections get 3 in all, the fourth is refused and counted, and
    a buffer given back by a closed connection can be registered again."""
    harness, conn, log = served
    monkeypatch.setattr(buffers, "MAX_BUFFERS", 3)
    other = RawConn(harness.config.socket_path(0))
    fd = memfd(BLOCKS * CHUNK_BYTES)
    try:
        assert [True, True] == [register(conn, [fd])["ok"] for _ in range(2)]
        assert register(other, [fd])["ok"]
        refused = register(other, [fd])
        assert (False, 1) == (refused["ok"], _refused_buffers(harness))
        assert "every connection's" in refused["error"]
        other.close()
        wait_for(lambda: register(conn, [fd])["ok"], 10, "the closed connection's buffer given back")
    finally:
        os.close(fd)
