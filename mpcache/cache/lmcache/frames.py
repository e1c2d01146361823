"""Multipart messages on a ZeroMQ socket without pyzmq's per-frame Python layer.

pyzmq's ``send_multipart``/``recv_multipart`` and ``getsockopt(EVENTS)`` go through its Python "sugar"
class for every frame: flag enums combined and built per call, option values turned into enums.  On the
LMCache front end's request path that was a tenth of the cache process's CPU per request; these call the
compiled socket's own ``send``/``recv``/``get`` with plain integer flags instead (same frames, same errors:
``zmq.Again`` when nothing is waiting, ``ZMQError`` when a send cannot be queued).
"""

from __future__ import annotations

import zmq

_Base = zmq.backend.Socket  # the compiled socket class every zmq.Socket is built on
_send, _recv, _get = _Base.send, _Base.recv, _Base.get
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def readable(socket: zmq.Socket) -> bool:
    """Whether a whole message is waiting (``EVENTS & POLLIN``)."""
    events: int = _get(socket, _EVENTS)  # type: ignore[assignment]  # an int option
    return bool(events & _POLLIN)


def recv_frames(socket: zmq.Socket) -> list[bytes]:
    """One whole message, without blocking (``zmq.Again`` when none is waiting)."""
    frames = [_recv(socket, _NOBLOCK)]
    while _get(socket, _RCVMORE):
        frames.append(_recv(socket, _NOBLOCK))
    return frames


def send_frames(socket: zmq.Socket, frames: list[bytes]) -> None:
    """Queue one message of bytes frames without blocking (``ZMQError`` when it cannot be)."""
    last = len(frames) - 1
    for index in range(last):
        _send(socket, frames[index], _MORE_NOBLOCK)
    _send(socket, frames[last], _NOBLOCK)
