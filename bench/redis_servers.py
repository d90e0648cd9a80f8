"""redis-server for the benchmarks: one server, or a Redis Cluster of three primaries, on free ports of 127.0.0.1,
no persistence, LRU eviction; stopped when the block ends. The servers are :mod:`ckpt_plugin.testing.redis`'s, the
tests' own."""

from __future__ import annotations

import contextlib
import pathlib
import tempfile
from collections.abc import Iterator

from ckpt_plugin.testing.redis import run_cluster, run_redis

MEMORY = {"maxmemory": "1gb", "maxmemory_policy": "allkeys-lru"}


@contextlib.contextmanager
def redis_server(nice: int = 0) -> Iterator[str]:
    """A fresh redis-server on a free port (no persistence, LRU eviction within 1 GiB) at CPU priority ``nice``;
    yields its URL."""
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-redis-") as directory:
        with run_redis(pathlib.Path(directory), "redis-server", nice=nice, **MEMORY) as server:
            yield server.url


@contextlib.contextmanager
def redis_cluster(size: int = 3) -> Iterator[list[str]]:
    """A fresh Redis Cluster of ``size`` primaries (each as :func:`redis_server`'s, cluster bus on a free port of
    its own, ``cluster-require-full-coverage no``, redis-server's default node timeout), joined by ``redis-cli
    --cluster create``; yields each node's URL."""
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-cluster-") as directory:
        with run_cluster(pathlib.Path(directory), size, "redis-server", cluster_node_timeout=15000,
                         **MEMORY) as cluster:
            yield cluster.urls
