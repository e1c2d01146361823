"""Free TCP ports for listeners the tests start in other processes (``bin/start-cache``, redis-server,
prometheus).

A port found with ``bind(0)`` is in the kernel's ephemeral range, which the kernel keeps handing out — to
another test's ``bind(0)`` listener or to any outgoing connection — in the gap before the other process binds
it (CI failed that way).  These ports are chosen at random *below* that range
(``/proc/sys/net/ipv4/ip_local_port_range``), where only an explicit bind can take them, probed free, and
never handed out twice by this process.  Where another process still reports its port taken, the caller
starts it again on new ports (:meth:`support.service.Service.ready`, ``cluster_nodes``, ``l2/conftest``).
A test that listens itself binds port 0 and reads the port instead.
"""

from __future__ import annotations

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
    and below the range too (a Redis Cluster node's bus port)."""
    extra = also_offset or 0
    highest = ephemeral_low() - 1 - extra - (count - 1 if run else 0)
    if highest < LOWEST + count:
        raise RuntimeError(f"no room below the ephemeral port range for {count} ports (+{extra})")

    def usable(port: int) -> bool:
        return (port not in _handed_out and bindable(host, port)
                and (also_offset is None or (port + extra not in _handed_out and bindable(host, port + extra))))

    ports: list[int] = []
    for _ in range(count * 200):
        if run:
            base = _chooser.randint(LOWEST, highest)
            candidate = list(range(base, base + count))
            if all(usable(port) for port in candidate):
                ports = candidate
        else:
            port = _chooser.randint(LOWEST, highest)
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
