"""The ZMTP codec against libzmq itself: what a libzmq DEALER sends is read back frame for frame, whatever
the sizes and wherever the bytes are split; what the codec encodes, libzmq reads back; bounds are refused
from a frame's header, before its body is held."""

from __future__ import annotations

import random
import socket

import pytest
from support import zmq_sockets

from mpcache.cache.lmcache import zmtp


def _messages(seed: int, count: int) -> list[list[bytes]]:
    rng = random.Random(seed)
    sizes = [0, 1, 254, 255, 256, 257, 4096, 70_000]
    return [[rng.randbytes(rng.choice(sizes)) for _ in range(rng.randint(1, 6))] for _ in range(count)]


@pytest.fixture
def pair(tmp_path):
    """A raw Unix socket accepting a libzmq DEALER, past the handshake: (raw server end, DEALER)."""
    path = str(tmp_path / "z.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    dealer = zmq_sockets.dealer()
    dealer.connect(f"ipc://{path}")
    server, _ = listener.accept()
    server.settimeout(10)
    server.sendall(zmtp.GREETING + zmtp.READY)
    reader = zmtp.FrameReader(1 << 20, 16)
    while len(reader.buffer) < zmtp.GREETING_BYTES:
        reader.buffer += server.recv(4096)
    zmtp.check_greeting(bytes(reader.buffer[:zmtp.GREETING_BYTES]))
    del reader.buffer[:zmtp.GREETING_BYTES]
    ready = None
    while ready is None:
        ready = reader.next()
        if ready is None:
            reader.buffer += server.recv(4096)
    name, data = zmtp.split_command(ready)
    assert (name, zmtp.peer_socket_type(data)) == (b"READY", b"DEALER")
    yield server, dealer, reader
    dealer.close(linger=0)
    server.close()
    listener.close()


def test_what_libzmq_sends_is_read_back_frame_for_frame_however_it_is_split(pair) -> None:
    server, dealer, reader = pair
    sent = _messages(1, 60)
    for message in sent:
        dealer.send_multipart(message)
    rng = random.Random(2)
    received: list[list[bytes]] = []
    while len(received) < len(sent):
        item = reader.next()
        if item is None:
            reader.buffer += server.recv(rng.choice([1, 7, 300, 65536]))  # split anywhere
        else:
            assert isinstance(item, list)
            received.append(item)
    assert received == sent


def test_what_the_codec_encodes_libzmq_reads_back(pair) -> None:
    server, dealer, _ = pair
    sent = _messages(3, 40)
    server.sendall(b"".join(zmtp.encode(message) for message in sent))
    assert [dealer.recv_multipart() for _ in sent] == sent


def test_a_frame_over_the_cap_is_refused_from_its_header() -> None:
    reader = zmtp.FrameReader(1000, 8)
    reader.buffer += b"\x02" + (1001).to_bytes(8, "big")  # the header alone: nothing of the body yet
    with pytest.raises(zmtp.ZmtpError, match="a frame of 1001 bytes"):
        reader.next()


def test_a_message_over_twice_the_cap_in_all_is_refused() -> None:
    reader = zmtp.FrameReader(1000, 8)
    reader.buffer += zmtp.encode([b"a" * 1000, b"b" * 1000, b"c" * 10])
    with pytest.raises(zmtp.ZmtpError, match="a message of over 2000 bytes"):
        reader.next()


def test_a_command_over_its_bound_is_refused_from_its_header() -> None:
    reader = zmtp.FrameReader(1 << 20, 8)
    reader.buffer += b"\x06" + (zmtp.MAX_COMMAND_BYTES + 1).to_bytes(8, "big")
    with pytest.raises(zmtp.ZmtpError, match="a command frame of"):
        reader.next()


@pytest.mark.parametrize("data", [b"\x0bSocket-Type\x00\x00", b"\x0bSocket-Type\x00\x00\x00\x09DEALER", b"\x00",
                                  b"\x0bSocket"])
def test_truncated_properties_are_refused(data) -> None:
    with pytest.raises(zmtp.ZmtpError):
        zmtp.parse_properties(data)


@pytest.mark.parametrize("body", [b"", b"\x00READY", b"\x09READY"])
def test_a_command_without_a_whole_name_is_refused(body) -> None:
    with pytest.raises(zmtp.ZmtpError):
        zmtp.split_command(body)
