"""redis-server for the benchmarks: one server, or a Redis Cluster of three primaries, on free ports of 127.0.0.1,
no persistence, LRU eviction; stopped when the block ends."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _binary(name: str) -> str:
    binary = shutil.which(name)
    if binary is None:
        raise SystemExit(f"{name} is not on PATH: run scripts/setup.sh")
    return binary


def _start(directory: str, port: int, nice: int, *options: str) -> subprocess.Popen:
    process = subprocess.Popen(["nice", "-n", str(nice), _binary("redis-server"), "--port", str(port), "--bind",
                                "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory,
                                "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru", *options],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


@contextlib.contextmanager
def redis_server(nice: int = 0) -> Iterator[str]:
    """A fresh redis-server on a free port (no persistence, LRU eviction within 1 GiB) at CPU priority ``nice``;
    yields its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-redis-") as directory:
        process = _start(directory, port, nice)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(timeout=10)


@contextlib.contextmanager
def redis_cluster(size: int = 3) -> Iterator[list[str]]:
    """A fresh Redis Cluster of ``size`` primaries (each as :func:`redis_server`'s, cluster bus on a free port of
    its own, ``cluster-require-full-coverage no``), joined by ``redis-cli --cluster create``; yields each node's
    URL."""
    ports = [free_port() for _ in range(size)]
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-cluster-") as directory:
        try:
            for port in ports:
                processes.append(_start(directory, port, 0, "--cluster-enabled", "yes", "--cluster-port",
                                        str(free_port()), "--cluster-config-file", f"{directory}/nodes-{port}.conf",
                                        "--cluster-require-full-coverage", "no"))
            subprocess.run([_binary("redis-cli"), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                            "--cluster-yes"], check=True, capture_output=True, timeout=60)
            deadline = time.monotonic() + 30
            while not all("cluster_state:ok" in subprocess.run(
                    [_binary("redis-cli"), "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                    timeout=10).stdout for port in ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not become ok")
                time.sleep(0.1)
            yield [f"redis://127.0.0.1:{port}" for port in ports]
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=10)
