"""A real Redis Cluster for tests: 3 masters + 3 replicas of ``redis-server --cluster-enabled yes`` on addresses
the test chose, created with ``redis-cli --cluster create``; nodes can be killed, restarted and made unreachable.

Every wait is on a condition with a deadline (cluster state, roles, slot owners), never a fixed sleep.  Nodes
use a short ``cluster-node-timeout`` so a failover takes about a second, and ``cluster-require-full-coverage
no`` so a lost slot range leaves the rest of the cluster serving (what docs/L2.md asks of a deployment).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import redis

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                else None)
REDIS_CLI = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if os.path.exists("/usr/bin/redis-cli") else None)
NODE_TIMEOUT_MS = 600


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05):
    """``condition()``'s first truthy value; AssertionError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = condition()
        except (redis.RedisError, OSError) as exc:
            value, last = None, exc
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last!r})")


def _ephemeral_low() -> int:
    """The first port the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    try:
        with socket.socket() as probe:
            probe.bind((host, port))
    except OSError:
        return False
    return True


def free_ports(host: str, count: int) -> list[int]:
    """``count`` ports free on ``host`` whose cluster-bus port (+10000) is free too, both below the kernel's
    ephemeral range: a port the kernel hands to another test's ``bind(0)`` listener or outgoing connection
    between this probe and redis-server's bind can never be one of them."""
    highest = _ephemeral_low() - 10000 - 1
    if highest < 2048:
        raise RuntimeError(f"no room below the ephemeral port range for a node and its bus port ({highest})")
    chooser = random.Random()
    ports: list[int] = []
    for _ in range(count * 200):
        if len(ports) == count:
            break
        port = chooser.randint(1024, highest)
        if port not in ports and _bindable(host, port) and _bindable(host, port + 10000):
            ports.append(port)
    if len(ports) < count:
        raise RuntimeError(f"found only {len(ports)} of {count} free node ports on {host}")
    return ports


class NodeDied(AssertionError):
    """redis-server exited while starting (its port was taken after all): the log's tail says why."""


class Node:
    def __init__(self, host: str, port: int, directory: str, password: str = "") -> None:
        self.host, self.port, self.directory, self.password = host, port, directory, password
        self.process: subprocess.Popen | None = None

    @property
    def live(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", self.host, "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.directory, "nodes.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
                "--cluster-replica-validity-factor", "0", "--cluster-announce-ip", self.host,
                "--save", "", "--appendonly", "no", "--dir", self.directory, "--protected-mode", "no",
                "--daemonize", "no", "--logfile", os.path.join(self.directory, "redis.log")]
        if self.password:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers_or_died, 10, f"redis node {self.address} to answer")
        if not self.live:
            raise NodeDied(f"redis node {self.address} exited while starting: {self.log_tail()}")

    def _answers_or_died(self) -> bool:
        return not self.live or self.ping()

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log"), encoding="utf-8", errors="replace") as handle:
                return " | ".join(handle.read().splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def client(self, **options) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, socket_timeout=2, socket_connect_timeout=2,
                           password=self.password or None, **options)

    def ping(self) -> bool:
        with self.client() as client:
            return bool(client.ping())

    def info(self) -> dict:
        with self.client() as client:
            return client.info("replication") | client.cluster("info")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


class Cluster:
    """Six nodes: after :meth:`create`, ``masters()`` and ``replica_of(master)`` say who is who right now."""

    def __init__(self, hosts: list[str], directory: str, password: str = "") -> None:
        """``hosts``: one address per node (the same one six times is fine); ``password``: every node's
        ``requirepass`` (and ``masterauth``), none by default."""
        self.password = password
        ports: dict[str, list[int]] = {}
        for host in dict.fromkeys(hosts):
            ports[host] = free_ports(host, hosts.count(host))
        self.nodes = [Node(host, ports[host].pop(), os.path.join(directory, f"node{index}"), password)
                      for index, host in enumerate(hosts)]

    @property
    def url(self) -> str:
        """A seed node's URL (the first node)."""
        return f"redis://{self.nodes[0].address}/0"

    def create(self) -> None:
        for node in self.nodes:
            self._start_fresh(node)
        environment = dict(os.environ, REDISCLI_AUTH=self.password) if self.password else None
        completed = subprocess.run([REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes),
                                    "--cluster-replicas", "1", "--cluster-yes"],
                                   capture_output=True, text=True, timeout=60, env=environment)
        assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
        self.wait_healthy()

    @staticmethod
    def _start_fresh(node: Node, attempts: int = 3) -> None:
        """Start a node that has never run, on new ports if its first ones were taken meanwhile."""
        for attempt in range(attempts):
            try:
                node.start()
                return
            except NodeDied:
                if attempt == attempts - 1:
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(node.directory, "nodes.conf"))
                node.port = free_ports(node.host, 1)[0]

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """Until every live node says cluster_state:ok and 3 masters each have a replica, all agreeing."""
        def healthy() -> bool:
            live = [node for node in self.nodes if node.live]
            views = set()
            for node in live:
                with node.client() as client:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
                    views.add(tuple(sorted((n["node_id"], n["flags"].replace("myself,", ""), bool(n["slots"]))
                                           for n in client.cluster("nodes").values())))
            return len(views) == 1
        wait_until(healthy, timeout_s, "the cluster to be healthy and agree on its topology")

    def nodes_view(self) -> dict[str, dict]:
        """``CLUSTER NODES`` of a live node, by address."""
        for node in self.nodes:
            if node.live:
                try:
                    with node.client() as client:
                        return {address.split("@")[0]: info for address, info in client.cluster("nodes").items()}
                except (redis.RedisError, OSError):
                    continue
        raise AssertionError("no live node answers")

    def node(self, address: str) -> Node:
        return next(node for node in self.nodes if node.address == address)

    def owner_of_key(self, key: str) -> Node:
        """The master that serves ``key``'s slot, as the cluster says now."""
        slot = _keyslot(key)
        with self.node(self._any_live()).client() as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return self.node(f"{master[0].decode()}:{master[1]}")
        raise AssertionError(f"no node serves slot {slot}")

    def replica_of(self, master: Node) -> Node:
        master_id = self.nodes_view()[master.address]["node_id"]
        for address, info in self.nodes_view().items():
            if info.get("master_id") == master_id and "slave" in info["flags"]:
                return self.node(address)
        raise AssertionError(f"{master.address} has no replica")

    def _any_live(self) -> str:
        for node in self.nodes:
            if node.live:
                return node.address
        raise AssertionError("no live node")

    def wait_master(self, node: Node, timeout_s: float = 20) -> None:
        wait_until(lambda: "master" in self.nodes_view()[node.address]["flags"]
                   and node.info()["role"] == "master", timeout_s, f"{node.address} to be a master")

    def stop(self) -> None:
        """Kill every node (nothing of theirs is worth a clean shutdown) and reap it."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)  # a frozen node too
                node.process.kill()
        for node in self.nodes:
            if node.process is not None:
                node.process.wait()


def _keyslot(key: str) -> int:
    """The cluster hash slot of ``key`` (CRC16 of its hash tag, mod 16384)."""
    from redis.crc import key_slot

    return key_slot(key.encode())
