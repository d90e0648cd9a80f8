"""A real Redis Cluster (or Valkey cluster) for tests (:mod:`ckpt_plugin.testing.redis`, which the benchmarks use
too): three primaries, each its own ``redis-server --cluster-enabled yes`` on a free port of 127.0.0.1; a node can be
killed and started again, and slots moved between nodes while clients use them."""

from __future__ import annotations

from ckpt_plugin.testing.redis import RedisCluster, run_cluster

__all__ = ["RedisCluster", "run_cluster"]
