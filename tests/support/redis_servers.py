"""A real redis-server for tests (:mod:`ckpt_plugin.testing.redis`, which the benchmarks use too): its own process on
a free port of 127.0.0.1, in a temporary directory, no persistence; it can be killed, restarted on the same port,
paused and resumed."""

from __future__ import annotations

from ckpt_plugin.testing.redis import RedisServer, run_redis, server_binary, valkey_server

__all__ = ["RedisServer", "run_redis", "server_binary", "valkey_server"]
