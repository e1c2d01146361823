"""ZMTP 3.0 with the NULL mechanism — the wire protocol of ZeroMQ's ``tcp://`` and ``ipc://`` transports —
as a ROUTER speaks it: the 64-byte greeting, the READY command, and framed messages (ZeroMQ RFC 23).

The LMCache front end speaks it itself rather than through libzmq, whose I/O thread adds two thread
wake-ups to every message of a request-reply protocol (benchmarks/HISTORY.md, issue 21, third pass).  Everything here is
bounded: a frame over the cap, a message of too many frames, a malformed command each raise
:class:`ZmtpError` before anything is buffered for them.
"""

from __future__ import annotations

FLAG_MORE, FLAG_LONG, FLAG_COMMAND = 0x01, 0x02, 0x04
GREETING_BYTES = 64
MECHANISM_NULL = b"NULL".ljust(20, b"\0")
# signature (0xFF, 8 bytes of padding, 0x7F), version 3.0, mechanism, as-server 0, filler
GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + MECHANISM_NULL + b"\x00" + bytes(31)
PEER_SOCKET_TYPES = frozenset({b"DEALER", b"REQ", b"ROUTER"})  # what a ROUTER may talk to (RFC 23)
MAX_COMMAND_BYTES = 4096  # READY, PING, ERROR: a few properties at most


class ZmtpError(Exception):
    """A peer broke the protocol or a bound; its connection is closed, and the message says why."""


def check_greeting(greeting: bytes) -> None:
    """Accept a ZMTP 3.x peer that asks for the NULL mechanism; anything else is refused by name."""
    if greeting[0] != 0xFF or greeting[9] != 0x7F:
        raise ZmtpError("not a ZMTP 3 greeting")
    if greeting[10] < 3:
        raise ZmtpError(f"ZMTP {greeting[10]}.{greeting[11]}: 3.0 or later is served")
    if greeting[12:32] != MECHANISM_NULL:
        mechanism = greeting[12:32].rstrip(b"\0").decode("ascii", "replace")
        raise ZmtpError(f"security mechanism {mechanism!r}: only NULL is served")


def _head(flags: int, size: int) -> bytes:
    if size < 256:
        return bytes((flags, size))
    return bytes((flags | FLAG_LONG,)) + size.to_bytes(8, "big")


def command(name: bytes, data: bytes = b"") -> bytes:
    """One command frame: its name's length, the name, then its data."""
    body = bytes([len(name)]) + name + data
    return _head(FLAG_COMMAND, len(body)) + body


def ready_properties(properties: dict[bytes, bytes]) -> bytes:
    return b"".join(bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value
                    for name, value in properties.items())


READY = command(b"READY", ready_properties({b"Socket-Type": b"ROUTER"}))


def split_command(body: bytes) -> tuple[bytes, bytes]:
    """A command frame's body as (name, data)."""
    if not body or body[0] == 0 or 1 + body[0] > len(body):
        raise ZmtpError("a command frame with no name")
    return body[1:1 + body[0]], body[1 + body[0]:]


def parse_properties(data: bytes) -> dict[bytes, bytes]:
    """READY's metadata: name-length, name, 4-byte value-length, value, repeated to the end."""
    properties: dict[bytes, bytes] = {}
    at = 0
    while at < len(data):
        length = data[at]
        if length == 0 or at + 1 + length + 4 > len(data):
            raise ZmtpError("READY: a truncated property")
        name = data[at + 1:at + 1 + length]
        at += 1 + length
        size = int.from_bytes(data[at:at + 4], "big")
        if at + 4 + size > len(data):
            raise ZmtpError("READY: a property value past the command's end")
        properties[name.lower()] = data[at + 4:at + 4 + size]
        at += 4 + size
    return properties


def peer_socket_type(ready_data: bytes) -> bytes:
    """The peer's Socket-Type from its READY; refused unless a ROUTER may talk to it."""
    kind = parse_properties(ready_data).get(b"socket-type", b"")
    if kind not in PEER_SOCKET_TYPES:
        raise ZmtpError(f"a {kind.decode('ascii', 'replace') or 'nameless'} socket cannot talk to a ROUTER")
    return kind


def encode(frames: list[bytes]) -> bytes:
    """One message: every frame but the last flagged MORE."""
    last = len(frames) - 1
    parts = []
    for index, frame in enumerate(frames):
        parts.append(_head(FLAG_MORE if index < last else 0, len(frame)))
        parts.append(frame)
    return b"".join(parts)


class FrameReader:
    """Splits a connection's incoming bytes (``buffer``, appended to by its owner) into whole messages and
    commands, one at a time; no frame over ``max_frame`` bytes, no message over ``max_frames`` frames or
    twice ``max_frame`` bytes in all."""

    __slots__ = ("buffer", "_frames", "_held", "_max_frame", "_max_frames")

    def __init__(self, max_frame: int, max_frames: int) -> None:
        self.buffer = bytearray()
        self._frames: list[bytes] = []  # the message being read
        self._held = 0  # its bytes so far
        self._max_frame = max_frame
        self._max_frames = max_frames

    def widen(self, max_frame: int) -> None:
        """Raise the frame cap (a connection whose requests carry KV objects)."""
        self._max_frame = max(self._max_frame, max_frame)

    def next(self) -> list[bytes] | bytes | None:
        """The next whole message (a list of frames), command (its body, as bytes), or None until more bytes
        come."""
        buffer = self.buffer
        frames = self._frames
        at = 0
        end = len(buffer)
        view = memoryview(buffer)  # a frame's bytes copied once (a bytearray slice would copy them twice)
        try:
            while end - at >= 2:
                flags = buffer[at]
                if flags & FLAG_LONG:
                    if end - at < 9:
                        return None
                    size = int.from_bytes(view[at + 1:at + 9], "big")
                    start = at + 9
                else:
                    size = buffer[at + 1]
                    start = at + 2
                if flags & FLAG_COMMAND:
                    if size > MAX_COMMAND_BYTES:
                        raise ZmtpError(f"a command frame of {size} bytes (at most {MAX_COMMAND_BYTES})")
                    if frames:
                        raise ZmtpError("a command inside a message")
                elif size > self._max_frame:
                    raise ZmtpError(f"a frame of {size} bytes (at most {self._max_frame})")
                elif self._held + size > 2 * self._max_frame:
                    raise ZmtpError(f"a message of over {2 * self._max_frame} bytes")
                if end - start < size:
                    return None
                body = bytes(view[start:start + size])
                at = start + size
                if flags & FLAG_COMMAND:
                    return body
                frames.append(body)
                if not flags & FLAG_MORE:
                    self._frames = []
                    self._held = 0
                    return frames
                self._held += size
                if len(frames) >= self._max_frames:
                    raise ZmtpError(f"a message of more than {self._max_frames} frames")
            return None
        finally:
            view.release()  # before the buffer shrinks: a bytearray with a live view cannot be resized
            if at:
                del buffer[:at]
