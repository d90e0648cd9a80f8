"""The shared tier's server: one Redis or Valkey server, or a Redis Cluster (or Valkey cluster) reached through any
of its nodes; its clients, its key layout, and which of its nodes answer.

Whether the URL names a cluster node is asked on connecting (``CLUSTER SLOTS``: a standalone server refuses it, a
cluster node answers with the slot map redis-py's cluster client needs anyway), so an operator gives any node's URL
and nothing else. A cluster is spoken to through redis-py's :class:`~redis.RedisCluster`: it routes each command to
the node of its key's slot, follows ``MOVED`` and ``ASK`` while slots move, splits multi-key commands per slot and
pipelines per node.

Faults are per node: a node that fails (unreachable, hung, or saying the cluster is down) is left alone until a probe
answers, while requests whose keys live on the other nodes go on using them. A standalone server is a cluster of one
node here: when it fails, the whole tier waits for the probe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable

from ckpt_plugin.tiers.shared.format import Partition
from ckpt_plugin.tiers.shared.support import WRITE_TIMEOUT, Tally, redacted

__all__ = ["SharedServer"]

log = logging.getLogger("ckpt_plugin")

SERVER = "server"
"""The node name of a standalone server (a cluster's nodes are named ``host:port``)."""


class SharedServer:
    """The clients of the server (or cluster) at ``url``; nothing is connected until :meth:`connect`.

    :param url: As :class:`~ckpt_plugin.tiers.shared.tier.SharedTier` takes it.
    :param timeout: Seconds a read or a connection attempt may take.
    :param tally: Where failures are counted (``errors``).
    :param retry: Seconds between probes of a failed node (for the log line).
    """

    def __init__(self, url: str, timeout: float, tally: Tally, retry: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self._url = url
        self.url = redacted(url)
        self.timeout = timeout
        self.retry = retry
        self.tally = tally
        self.cluster: bool | None = None  # None until connected
        self.reader: Any = None
        self.writer: Any = None
        # No retries inside redis-py: a failure is a miss now and a probe later, never a request waiting.
        self._retry = Retry(NoBackoff(), 0)
        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, redis.RedisClusterException, OSError)
        # Faults of a node (rather than of a command): the node is left alone until a probe answers. A cluster
        # whose slots are not all served answers CLUSTERDOWN from its live nodes (with the servers' default
        # cluster-require-full-coverage), and a node just restarted does so until it has rejoined.
        self.node_faults: tuple[type[BaseException], ...] = (
            redis.ConnectionError, redis.TimeoutError, OSError, redis.exceptions.ClusterDownError,
            redis.exceptions.SlotNotCoveredError, redis.exceptions.RedisClusterUnreachableError)
        self._lock = threading.Lock()
        # Failed nodes (SERVER: the server, or the URL's node before the first connection) -> since when.
        self._down: dict[str, float] = {}
        self._suspects: set[str] = set()  # nodes of a failed command sent to several; see failed()
        self._rechecking = False
        self._partitions: dict[tuple[str, str, str, bool], Partition] = {}

    # -------------------------------------------------------------------------------------------------------------
    # connecting

    def connect(self) -> None:
        """Ask whether the URL names a cluster node and make the clients (one round trip, one more for a cluster's
        slot map); raises what redis-py raises."""
        redis = self._redis
        from redis.backoff import NoBackoff
        from redis.connection import Encoder, PythonRespSerializer
        from redis.retry import Retry

        options: dict[str, Any] = dict(socket_connect_timeout=self.timeout, client_name="ckpt_plugin")
        probe = redis.Redis.from_url(self._url, socket_timeout=self.timeout, retry=self._retry, **options)
        try:
            probe.execute_command("CLUSTER", "SLOTS")
            cluster = True
        except redis.ResponseError:  # "cluster support disabled", or an ACL user without it on a standalone server
            cluster = False
        finally:
            probe.close()
        # States are tens of MB: read them in 1 MiB gulps rather than redis-py's 64 KiB (20% faster here).
        reads: dict[str, Any] = dict(socket_timeout=self.timeout, socket_read_size=1 << 20, **options)
        # hiredis packs a command into one new buffer (two copies of every state); this packer sends them as they are.
        writes: dict[str, Any] = dict(socket_timeout=max(WRITE_TIMEOUT, self.timeout), **options,
                                      command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode))
        if cluster:
            # A node down leaves its slots unserved; the client still serves the others' (require_full_coverage).
            # Building the client reads COMMAND from one node, which may be the one that is down: a few tries, each
            # on another node, then none (set_retry), as for the single server.
            made = [redis.RedisCluster.from_url(self._url, retry=Retry(NoBackoff(), 3), require_full_coverage=False,
                                                **kwargs) for kwargs in (reads, writes)]
            for client in made:
                client.set_retry(self._retry)
        else:
            made = [redis.Redis.from_url(self._url, retry=self._retry, **kwargs) for kwargs in (reads, writes)]
        old = (self.reader, self.writer)
        with self._lock:
            self.reader, self.writer = made
            self.cluster = cluster
            self._down.clear()
            self._suspects.clear()
        for client in old:
            if client is not None:
                client.close()
        log.info("shared tier %s: %s", self.url, "a cluster of %d nodes" % len(self.reader.get_nodes()) if cluster
                 else "one server")

    # -------------------------------------------------------------------------------------------------------------
    # the key layout

    def partition(self, prefix: str, namespace: str, fingerprint: str) -> Partition:
        """The keys of (``namespace``, ``fingerprint``) under ``prefix``: in a cluster, the manifests and index keys
        of a partition share one hash slot (a lookup is one node's), blobs are spread over every slot."""
        key = (prefix, namespace, fingerprint, bool(self.cluster))
        partition = self._partitions.get(key)
        if partition is None:  # slots and the write-behind thread ask at once: one object per key all the same
            partition = self._partitions.setdefault(key, Partition(prefix, fingerprint, namespace, bool(self.cluster)))
        return partition

    def mget(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys``: one ``MGET``; in a cluster, one per slot, each node's sent at once."""
        reader = self.reader
        return reader.mget_nonatomic(keys) if self.cluster else reader.mget(keys)

    # -------------------------------------------------------------------------------------------------------------
    # health

    @property
    def up(self) -> bool:
        """Whether every node answers (``False`` from a node's failure until a probe answers)."""
        with self._lock:
            return not self._down and not self._suspects and self.reader is not None

    @property
    def failed_nodes(self) -> list[str]:
        """The nodes left alone until a probe answers (``"server"`` for a single server)."""
        with self._lock:
            return sorted(self._down)

    def nodes_of(self, keys: Iterable[str]) -> set[str]:
        """The nodes serving ``keys`` (as far as the client knows)."""
        with self._lock:
            client, cluster = self.reader, self.cluster
        if not cluster:
            return {SERVER}
        return {client.get_node_from_key(key).name for key in keys}

    def usable(self, keys: Iterable[str]) -> bool:
        """Whether every node serving ``keys`` answers: the request may ask them."""
        with self._lock:
            if SERVER in self._down or self.reader is None:
                return False
            if not self._down and not self._suspects:
                return True
            avoid = self._down.keys() | self._suspects
        try:
            return not (self.nodes_of(keys) & avoid)
        except Exception:  # a slot no node serves, as far as the client knows: nothing to ask
            return False

    def failed(self, what: str, exc: BaseException, keys: Iterable[str] = ()) -> None:
        """Count a failure; if it is a fault of the nodes serving ``keys`` (of the server, for a single one), leave
        them alone until a probe answers.

        redis-py does not say which node of a command sent to several failed: when several are involved, they are
        suspects, avoided until a probe (on the write-behind thread, at once) finds which of them do not answer.
        """
        self.tally.add(errors=1)
        if not isinstance(exc, self.node_faults):
            log.warning("shared tier %s: %s failed: %s", self.url, what, exc)
            return
        if not self.cluster:
            nodes = {SERVER}
        else:
            try:
                nodes = self.nodes_of(keys)
            except Exception:  # no slot map yet: nothing to pin it on
                nodes = set()
            if not nodes:  # a command of every node (SCAN): the next requests find the node that fails
                log.warning("shared tier %s: %s failed: %s", self.url, what, exc)
                return
        with self._lock:
            fresh = nodes - self._down.keys() - self._suspects
            if len(nodes) > 1:
                self._suspects |= fresh
            else:
                for node in fresh:
                    self._down[node] = time.monotonic()
        if fresh and len(nodes) > 1:
            self.recheck()
        elif fresh:
            self._warn_down(fresh.pop(), f"{what}: {exc}")

    def recheck(self) -> None:
        """Probe the suspects now, on a thread of its own: not on the request path, and not behind the writes
        queued on the write-behind thread (whose idle probe comes only every ``retry`` seconds)."""
        with self._lock:
            if self._rechecking:
                return
            self._rechecking = True

        def run() -> None:
            try:
                self.probe()
            except Exception:  # a probe's failure must not escape into a thread nobody joins
                log.exception("shared tier %s: probe failed", self.url)
            finally:
                with self._lock:
                    self._rechecking = False

        threading.Thread(target=run, name="ckpt-shared-recheck", daemon=True).start()

    def _warn_down(self, node: str, why: str) -> None:
        log.warning("shared tier %s unavailable%s (%s); serving from the local tiers, probing every %.1f s",
                    self.url, "" if node == SERVER else f" on {node}", why, self.retry)

    def probe(self) -> None:
        """Ask each failed or suspect node (or the server, or, before the first connection, the URL) whether it
        answers; a failed node that answers is used again, with fresh connections."""
        with self._lock:
            down, suspects = list(self._down), list(self._suspects)
        if not down and not suspects and self.reader is not None:
            return
        if SERVER in down or self.reader is None:
            try:
                self.connect()  # a standalone server replaced by a cluster (or back) is found out here
            except self.errors:
                return
            log.warning("shared tier %s reachable again", self.url)
            return
        for name in suspects + down:
            node = self.reader.get_node(node_name=name)
            try:
                if node is not None:  # gone from the slot map (failed over): nothing to wait for
                    self.reader.ping(target_nodes=node)
            except self.errors as exc:
                if name in suspects:
                    with self._lock:
                        self._suspects.discard(name)
                        self._down[name] = time.monotonic()
                    self._warn_down(name, f"probe: {exc}")
                continue
            if name in suspects:
                with self._lock:
                    self._suspects.discard(name)
                continue
            # Connections made before the outage are dead: drop them rather than fail one request on each.
            for client in (self.reader, self.writer):
                known = client.get_node(node_name=name)
                if known is not None and known.redis_connection is not None:
                    known.redis_connection.connection_pool.disconnect()
            with self._lock:
                self._down.pop(name, None)
            log.warning("shared tier %s reachable again on %s", self.url, name)
