"""A real Redis Cluster (or Valkey cluster) for tests: three primaries, each its own ``redis-server
--cluster-enabled yes`` on a free port of 127.0.0.1, joined by ``redis-cli --cluster create``; a node can be killed
and started again, and slots moved between nodes with ``redis-cli --cluster reshard`` while clients use them."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import time
from typing import Any, Iterator

import redis

from support.redis_servers import RedisServer, server_binary
from support.servers import free_port


class RedisCluster:
    """``size`` primaries, no replicas, ``cluster-require-full-coverage no`` (the setting docs/shared-tier.md
    recommends: the nodes left keep serving their slots while one is down)."""

    def __init__(self, directory: pathlib.Path, size: int = 3, binary: str | None = None, **options: str) -> None:
        self.binary = server_binary(binary)
        # valkey-cli and redis-cli speak the same protocol: the cli next to the server, else Debian's redis-cli.
        cli = pathlib.Path(self.binary).with_name(pathlib.Path(self.binary).name.replace("server", "cli"))
        self.cli = str(cli) if cli.exists() else "redis-cli"
        self.nodes: list[RedisServer] = []
        try:
            for index in range(size):
                folder = directory / f"node{index}"
                folder.mkdir()
                self.nodes.append(RedisServer(folder, {
                    # The bus port is the client port + 10000 unless set: a free port of its own instead.
                    "cluster-enabled": "yes", "cluster-port": str(free_port()),
                    "cluster-config-file": str(folder / "nodes.conf"),
                    "cluster-node-timeout": "1000", "cluster-require-full-coverage": "no", **options},
                    binary=self.binary))
            self.run_cli("--cluster", "create", *[f"127.0.0.1:{node.port}" for node in self.nodes],
                         "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise

    @property
    def url(self) -> str:
        """The URL of the first node: any node's URL reaches the whole cluster."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def run_cli(self, *args: str, timeout: float = 120) -> str:
        password = self.nodes[0].options.get("requirepass")
        auth = ["-a", password, "--no-auth-warning"] if password else []
        done = subprocess.run([self.cli, *auth, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{self.cli} {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def wait_ok(self, timeout: float = 30) -> None:
        """Wait until every running node says the cluster is ok (its slots all covered, every node known)."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for node in self.nodes:
                if node.running:
                    info = node.client().execute_command("CLUSTER", "INFO").decode()
                    states.append("cluster_state:ok" in info and "cluster_known_nodes:" in info)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become ok")
            time.sleep(0.1)

    def client(self) -> redis.RedisCluster:
        password = self.nodes[0].options.get("requirepass")
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, password=password,
                                  require_full_coverage=False, socket_timeout=5)

    def node_of(self, key: str | bytes) -> RedisServer:
        """The node serving ``key``'s slot now."""
        slot = self.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key)
        for node in self.nodes:
            if node.running:
                for start, end, primary, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return next(n for n in self.nodes if n.port == int(primary[1]))
        raise LookupError(f"no node serves slot {slot}")

    def slots_of(self, node: RedisServer) -> int:
        """How many slots ``node`` serves."""
        info = node.client().execute_command("CLUSTER", "NODES").decode()
        mine = next(line for line in info.splitlines() if "myself" in line).split()[8:]
        return sum(int(r.split("-")[1]) - int(r.split("-")[0]) + 1 if "-" in r else 1
                   for r in mine if not r.startswith("["))

    def keys(self, pattern: str = "*") -> dict[int, list[bytes]]:
        """Keys matching ``pattern`` on each running node, by port."""
        return {node.port: node.keys(pattern) for node in self.nodes if node.running}

    def reshard(self, source: RedisServer, target: RedisServer, slots: int) -> None:
        """Move ``slots`` slots from ``source`` to ``target`` with their keys (``redis-cli --cluster reshard``)."""
        ids = {node.port: node.client().execute_command("CLUSTER", "MYID").decode() for node in (source, target)}
        self.run_cli("--cluster", "reshard", f"127.0.0.1:{target.port}", "--cluster-from", ids[source.port],
                     "--cluster-to", ids[target.port], "--cluster-slots", str(slots), "--cluster-yes",
                     "--cluster-pipeline", "100")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def run_cluster(directory: pathlib.Path, size: int = 3, binary: str | None = None,
                **options: Any) -> Iterator[RedisCluster]:
    """Start a cluster of ``size`` primaries (``options`` for every node, as :func:`run_redis` takes them); stop
    every node after."""
    cluster: RedisCluster | None = None
    try:
        cluster = RedisCluster(directory, size, binary, **{k.replace("_", "-"): str(v) for k, v in options.items()})
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
