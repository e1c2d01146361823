"""A private network for tests that need several hosts: a bridge with a /24 of 10.x.y.0 that no interface of this
machine uses, network namespaces ("hosts") joined to it by veth pairs, and extra addresses on the bridge for
servers in the root namespace.  Everything carries a random tag and :meth:`PrivateNetwork.remove` deletes it
all, also after a failure; traffic stays on these addresses (no forwarding, no default route).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess


class Unavailable(Exception):
    """Why this machine cannot give a test a private network (not root, no ``ip``, no netns support)."""


def _ip(*argv: str) -> None:
    completed = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if completed.returncode != 0:
        raise Unavailable(f"ip {' '.join(argv)}: {completed.stderr.strip()}")


class PrivateNetwork:
    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise Unavailable("needs root for network namespaces, a bridge and veth pairs")
        if shutil.which("ip") is None:
            raise Unavailable("the ip command (iproute2) is not installed")
        self.tag = secrets.token_hex(3)
        self.bridge = f"mpcbr{self.tag}"
        self.subnet = self._unused_subnet()
        self.hosts: dict[str, tuple[str, str]] = {}  # host name -> (namespace, address)
        self.server_addresses: list[str] = []
        self._veths: list[str] = []
        self._next = 2
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self._address(1)}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except Unavailable:
            self.remove()
            raise

    @staticmethod
    def _unused_subnet() -> ipaddress.IPv4Network:
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=30).stdout
        for _ in range(50):
            subnet = ipaddress.IPv4Network(f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}.0/24")
            prefix = str(subnet.network_address).rsplit(".", 1)[0] + "."
            if prefix not in used and prefix not in routes:
                return subnet
        raise Unavailable("no unused 10.x.y.0/24 found")

    def _address(self, host_part: int) -> str:
        return str(self.subnet.network_address + host_part)

    def add_host(self, name: str) -> str:
        """A namespace joined to the bridge; its address."""
        namespace = f"mpc{name}{self.tag}"
        address = self._address(self._next)
        self._next += 1
        outside, inside = f"v{self.tag}{len(self._veths)}o", f"v{self.tag}{len(self._veths)}i"
        _ip("netns", "add", namespace)
        self.hosts[name] = (namespace, address)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self._veths.append(outside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return address

    def add_server_address(self) -> str:
        """One more address of the root namespace on the bridge (for a server the hosts reach)."""
        address = self._address(100 + len(self.server_addresses))
        _ip("addr", "add", f"{address}/24", "dev", self.bridge)
        self.server_addresses.append(address)
        return address

    def cut(self, host: str, address: str) -> None:
        """Make ``address`` unreachable from ``host`` (an ``unreachable`` route in its namespace): a partition
        between that host and one server, the rest of the network untouched."""
        _ip("-n", self.hosts[host][0], "route", "add", "unreachable", f"{address}/32")

    def mend(self, host: str, address: str) -> None:
        """Undo :meth:`cut`."""
        _ip("-n", self.hosts[host][0], "route", "del", "unreachable", f"{address}/32")

    def in_host(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``name``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[name][0], *argv]

    def remove(self) -> None:
        """Delete the namespaces, veth pairs and bridge (each may already be gone)."""
        for namespace, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        for veth in self._veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
