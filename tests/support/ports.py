"""Free TCP ports for listeners the tests start in other processes (``bin/start-cache``, redis-server,
prometheus).

A port found with ``bind(0)`` is in the kernel's ephemeral range, which the kernel keeps handing out — to
another test's ``bind(0)`` listener or to any outgoing connection — in the gap before the other process binds
it (CI failed that way).  These ports are chosen at random *below* that range
(``/proc/sys/net/ipv4/ip_local_port_range``), where only an explicit bind can take them, probed free, and
never handed out twice by this process; each pytest-xdist worker picks from a slice of its own (:func:`share`), so
that two workers never pick the same port between one's probe and its listener's bind.  Where another process
still reports its port taken, the caller starts it again on new ports (:meth:`support.service.Service.ready`,
``cluster_nodes``, ``l2/conftest``).
A test that listens itself binds port 0 and reads the port instead.
"""

from __future__ import annotations

import os
import random
import socket

LOWEST = 1024
_handed_out: set[int] = set()
_chooser = random.Random()


def ephemeral_low() -> int:
    """The first port the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def share() -> tuple[int, int]:
    """The lowest and highest port this process picks from: all of those below the ephemeral range, or this
    pytest-xdist worker's slice of them (``gw<i>`` of ``PYTEST_XDIST_WORKER_COUNT``; a replacement worker, whose
    index is not below the count, gets the whole range)."""
    low, high = LOWEST, ephemeral_low() - 1
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and workers.isdigit() and int(worker[2:]) < int(workers) > 1:
        width = (high - low + 1) // int(workers)
        low += int(worker[2:]) * width
        high = low + width - 1
    return low, high


def bindable(host: str, port: int) -> bool:
    try:
        with socket.socket() as probe:
            probe.bind((host, port))
    except OSError:
        return False
    return True


def free_ports(count: int = 1, host: str = "127.0.0.1", *, run: bool = False,
               also_offset: int | None = None) -> list[int]:
    """``count`` ports free on ``host`` now, below the ephemeral range and new to this process.  ``run``: a
    run of consecutive ports (P, P+1, ...); ``also_offset``: each port's ``port + also_offset`` must be free
    and below the range too (a Redis Cluster node's bus port), picked from the whole range where this worker's
    slice (:func:`share`) is too narrow for the offset."""
    extra = also_offset or 0
    above = extra + (count - 1 if run else 0)  # the ports taken above a chosen one
    lowest, top = share()
    if top - above < lowest + count:
        lowest, top = LOWEST, ephemeral_low() - 1
    highest = top - above
    if highest < lowest + count:
        raise RuntimeError(f"no room below the ephemeral port range for {count} ports (+{extra})")

    def usable(port: int) -> bool:
        return (port not in _handed_out and bindable(host, port)
                and (also_offset is None or (port + extra not in _handed_out and bindable(host, port + extra))))

    ports: list[int] = []
    for _ in range(count * 200):
        if run:
            base = _chooser.randint(lowest, highest)
            candidate = list(range(base, base + count))
            if all(usable(port) for port in candidate):
                ports = candidate
        else:
            port = _chooser.randint(lowest, highest)
            if port not in ports and usable(port):
                ports.append(port)
        if len(ports) == count:
            _handed_out.update(ports)
            if also_offset is not None:
                _handed_out.update(port + extra for port in ports)
            return ports
    raise RuntimeError(f"found only {len(ports)} of {count} free ports on {host} below the ephemeral range")


def free_port(host: str = "127.0.0.1") -> int:
    """One port for another process to listen on (see :func:`free_ports`)."""
    return free_ports(1, host)[0]
