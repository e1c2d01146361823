"""The kernel's TCP socket table (``/proc/net/tcp``, ``/proc/net/tcp6``): who owns each end of a connection.

A loopback connection appears twice in the table of its network namespace: the client's end, owned by the
uid that created the client socket, and the server's end, owned by this process.  That is how the
LMCache front end learns the uid behind a TCP peer, which TCP itself never tells the server.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class TcpEnd:
    """One row of the table: a socket's own address and port, its peer's, its owner and its inode (0: no
    file any more — closed, or in TIME_WAIT — so its owner is not known)."""

    local: tuple[IPAddress, int]
    remote: tuple[IPAddress, int]
    uid: int
    inode: int


def _address(field: str) -> tuple[IPAddress, int]:
    """``0100007F:1F90`` (IPv4 as a host-order word) or 32 hex digits (IPv6 as four host-order words)."""
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    # each 32-bit word is in host byte order (little-endian on every platform this runs on)
    data = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip: IPAddress = ipaddress.IPv4Address(data) if len(data) == 4 else ipaddress.IPv6Address(data)
    return _unmapped(ip), int(port, 16)


def _unmapped(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def ends(peer_port: int, tables: tuple[str, ...] = TABLES) -> list[TcpEnd]:
    """Every TCP socket end in this network namespace whose peer's port is ``peer_port``, in any state: a
    peer that half-closed or closed its end before it was judged has left ESTABLISHED, but is still a local
    peer, never another host's.  Other rows (a local user can make the table long) are skipped unparsed."""
    ends = []
    port = f":{peer_port:04X}"
    for table in tables:
        try:
            with open(table, encoding="ascii") as handle:
                next(handle, None)  # the header
                for line in handle:
                    if port not in line:
                        continue
                    fields = line.split()
                    if len(fields) < 10 or not fields[2].endswith(port):
                        continue
                    ends.append(TcpEnd(_address(fields[1]), _address(fields[2]), int(fields[7]), int(fields[9])))
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
    return ends


def parse_ip(text: str) -> IPAddress:
    return _unmapped(ipaddress.ip_address(text.strip("[]")))
