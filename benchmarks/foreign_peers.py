"""``python -m benchmarks.foreign_peers MODE PORT ...``: the hostile local user of ``python -m benchmarks
peers``, run as another uid (standard library only, so that any user's Python can run it).

* ``hold PORT N ROWS RATE``: ``N`` connections to the LMCache port (each refused), held open; ``ROWS`` rows of
  loopback pairs of its own added to the host's socket table; then ``RATE`` connections a second more.
* ``flood PORT SECONDS``: connect and reset, as fast as it can, for ``SECONDS``.

Sources rotate over 127.0.0.2–127.0.0.17 so that the ephemeral ports of one address do not run out.  It prints
``ready`` once set up (``hold``) and ``done COUNT`` at the end; ``hold`` runs until its stdin closes.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h: the port is chosen at connect(), per destination
SOURCES = [f"127.0.0.{i}" for i in range(2, 18)]
_RESET = struct.pack("ii", 1, 0)


def _connect(port: int, index: int, blocking: bool) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
    try:
        sock.bind((SOURCES[index % len(SOURCES)], 0))
        sock.setblocking(blocking)
        sock.connect_ex(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def hold(port: int, connections: int, rows: int, rate: float) -> int:
    held: list[socket.socket] = []
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    for _ in range(rows // 2):  # a loopback pair is two rows
        client = socket.create_connection(listener.getsockname())
        accepted, _address = listener.accept()
        held += [client, accepted]
    made = 0
    for index in range(connections):
        sock = _connect(port, index, blocking=False)
        if sock is not None:
            held.append(sock)
            made += 1
    print("ready", made, flush=True)
    stop = threading.Event()

    def trickle() -> None:
        index = 0
        while not stop.wait(1.0 / rate):
            sock = _connect(port, index, blocking=False)
            index += 1
            if sock is not None:
                sock.close()

    if rate > 0:
        threading.Thread(target=trickle, daemon=True).start()
    sys.stdin.read()
    stop.set()
    for sock in held:
        sock.close()
    return made


def flood(port: int, seconds: float) -> int:
    count = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(64):
            sock = _connect(port, count, blocking=True)
            count += 1
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                sock.close()
    return count


def main(argv: list[str]) -> int:
    mode, port = argv[0], int(argv[1])
    if mode == "hold":
        made = hold(port, int(argv[2]), int(argv[3]), float(argv[4]))
    else:
        made = flood(port, float(argv[2]))
    print("done", made, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
