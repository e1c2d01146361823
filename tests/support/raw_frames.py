"""A client that speaks mpcache frames by hand, so tests can send what the real client never would."""

from __future__ import annotations

import socket

import msgpack

from mpcache.contract import protocol


class RawConn:
    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)

    def send_payload(self, payload: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        """One frame; ``fds`` go with its first byte (one ``sendmsg``, SCM_RIGHTS), as the real client sends them."""
        frame = protocol.FRAME_HEADER.pack(len(payload)) + payload
        sent = socket.send_fds(self.sock, [frame], list(fds)) if fds else 0
        if sent < len(frame):
            self.sock.sendall(frame[sent:])

    def reply(self) -> dict:
        (length,) = protocol.FRAME_HEADER.unpack(self._exact(4))
        return msgpack.unpackb(self._exact(length), raw=False)

    def request(self, message, fds: list[int] | tuple[int, ...] = ()) -> dict:
        self.send_payload(msgpack.packb(message, use_bin_type=True), fds)
        return self.reply()

    def _exact(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            assert chunk, "the server closed the connection"
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()
