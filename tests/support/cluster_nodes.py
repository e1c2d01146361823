"""A real Redis Cluster for tests: 3 masters + 3 replicas of ``redis-server --cluster-enabled yes`` on addresses
the test chose, created with ``redis-cli --cluster create``; nodes can be killed, restarted and made unreachable.

Every wait is on a condition with a deadline (cluster state, roles, slot owners), never a fixed sleep.  Nodes
use a short ``cluster-node-timeout`` so a failover takes about a second, and ``cluster-require-full-coverage
no`` so a lost slot range leaves the rest of the cluster serving (what docs/L2.md asks of a deployment).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

import redis

from support.ports import free_ports
from support.waiting import wait_for

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                else None)
REDIS_CLI = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if os.path.exists("/usr/bin/redis-cli") else None)
NODE_TIMEOUT_MS = 600
BUS_PORT_OFFSET = 10000  # a node's cluster-bus port is its port + 10000: both must be free


# What a wait on a node tolerates while the cluster settles (a node not answering yet, a failover in progress).
REDIS_NOT_YET = (redis.RedisError, OSError)


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
        wait_for(self._answers_or_died, 10, f"redis node {self.address} to answer", tolerate=REDIS_NOT_YET)
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
            ports[host] = free_ports(hosts.count(host), host, also_offset=BUS_PORT_OFFSET)
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
                node.port = free_ports(1, node.host, also_offset=BUS_PORT_OFFSET)[0]

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
        wait_for(healthy, timeout_s, "the cluster to be healthy and agree on its topology", tolerate=REDIS_NOT_YET)

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
        wait_for(lambda: "master" in self.nodes_view()[node.address]["flags"] and node.info()["role"] == "master",
                 timeout_s, f"{node.address} to be a master", tolerate=REDIS_NOT_YET)

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
