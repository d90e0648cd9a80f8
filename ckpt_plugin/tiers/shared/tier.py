"""The shared tier: cache entries in Redis or Valkey, so that every replica of a model resumes any conversation.

It sits behind the same store interface as RAM and disk (:class:`~ckpt_plugin.tiers.store.TieredStore`): ``lookup``
returns :class:`~ckpt_plugin.policy.plan.Hit` objects the planner fetches lazily, entries go in through the write-behind
queue. The layout of keys and values is :mod:`ckpt_plugin.tiers.shared.format`'s.

Cost per request (see ``docs/shared-tier.md``):

- lookup: one ``MGET`` of the index keys of the prompt's whole 32-token blocks; if a stored prefix could beat what
  the local tiers hold, one ``MGET`` of the manifests of the (at most 2) deepest entries found;
- fetch, only when the planner picks a shared entry: one ``MGET`` of the blobs it restores (the full state and the
  one checkpoint the plan uses), less those a live local buffer already holds;
- write, after the response, on the write-behind thread once the next request's reads are done: ``EXISTS`` of the
  blobs, ``SET`` of the missing ones, ``SET`` of the manifest and the index keys (three pipelined round trips).

It is never in the way: reads have a timeout, and any failure (unreachable, slow, full, garbage) is a warning, a
counter and a miss, never an error for the request; while the server is unreachable no request touches it and the
write-behind thread probes it every ``retry`` seconds, reconnecting by itself.

:meth:`SharedTier.forget` deletes a partition's keys (a tenant's, or a model's) with ``SCAN`` and ``UNLINK`` in
batches (never ``KEYS``, which blocks the server for the whole keyspace), after the write in progress, and makes the
writes queued before it write nothing (``DELETE /checkpoints``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import StateBuffer
from ckpt_plugin.core.errors import CheckpointError, ConfigError
from ckpt_plugin.policy.plan import Hit, MemoryKind, Reuse, best_reuse
from ckpt_plugin.tiers.shared.format import BLOCK_TOKENS, MAX_LOOKUP_BLOCKS, Manifest, Partition, check_blob, decode_manifest, parse_entry_id
from ckpt_plugin.tiers.protocol import Query
from ckpt_plugin.tiers.shared.write_behind import Job, WriteBehind
from ckpt_plugin.tiers.shared.support import (
    _T,
    LINEAGE_MANIFESTS,
    MAX_CANDIDATES,
    TIER,
    WRITE_TIMEOUT,
    DigestCache,
    Reads,
    SharedCounters,
    histogram_snapshot,
    latency_histogram,
    redacted,
)
from ckpt_plugin.tiers.shared.writes import SharedWrites

log = logging.getLogger("ckpt_plugin")

class SharedTier(SharedWrites):
    """Entries in a Redis or Valkey server at ``url``, shared by every replica that points there.

    :param url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) or ``unix://path``, as
        redis-py takes them.
    :param prefix: First part of every key (several deployments can share one server).
    :param ttl: Seconds keys live after their last write; ``None`` leaves eviction to the server's ``maxmemory``.
    :param timeout: Seconds a read (lookup, fetch) or a connection attempt may take.
    :param queue: Entries waiting for the write-behind thread at most.
    :param retry: Seconds between probes of an unreachable server.
    """

    def __init__(self, url: str, *, prefix: str = "ckpt", ttl: int | None = None, timeout: float = 0.5,
                 queue: int = 8, retry: float = 2.0) -> None:
        try:
            import redis
            import xxhash  # noqa: F401  (blob digests, see shared_format.blob_digest)
            from redis.backoff import NoBackoff
            from redis.connection import Encoder, PythonRespSerializer
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - the redis extra is missing
            raise ConfigError("the shared tier needs redis-py and xxhash: pip install 'ckpt_plugin[redis]'") from exc
        self.url = redacted(url)
        self.prefix = prefix
        self.ttl = ttl
        self.block_tokens = BLOCK_TOKENS
        self.counters = SharedCounters()
        self.lookup_histogram = latency_histogram("lookup_seconds", "Time of a shared-tier lookup (index and manifests)")
        self.fetch_histogram = latency_histogram("fetch_seconds",
                                                 "Time to fetch and check the blobs of a shared-tier entry")
        self.lookup_latency = self.lookup_histogram.labels(server=self.url)
        self.fetch_latency = self.fetch_histogram.labels(server=self.url)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._unreachable: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
        # No retries inside redis-py: a failure is a miss now and a probe later, never a request waiting.
        options: dict[str, Any] = dict(socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                                       client_name="ckpt_plugin")
        # States are tens of MB: read them in 1 MiB gulps rather than redis-py's 64 KiB (20% faster here).
        self._reader = redis.Redis.from_url(url, socket_timeout=timeout, socket_read_size=1 << 20, **options)
        # hiredis packs a command into one new buffer (two copies of every state); this packer sends them as they are.
        packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        self._writer = redis.Redis.from_url(url, socket_timeout=max(WRITE_TIMEOUT, timeout), command_packer=packer,
                                            **options)
        self._digests = DigestCache()
        self._partitions: dict[tuple[str, str], Partition] = {}
        # entry id -> (when claimed, its partition's key prefix)
        self._recent: OrderedDict[str, tuple[float, str]] = OrderedDict()
        # key prefix of a forgotten partition -> when (monotonic); see forget()
        self._forgotten: OrderedDict[str, float] = OrderedDict()
        # Held for a whole entry's write and for a forget: a forget waits for the write in progress, and a write
        # after it sees its mark.
        self._write_lock = threading.Lock()
        self._lineage: OrderedDict[tuple[str, str], Manifest] = OrderedDict()
        self._lock = threading.Lock()
        self._reads = Reads()
        self._up = True
        self._published: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()
        self._queue = WriteBehind(queue, idle=self._probe, idle_interval=retry, name="ckpt-shared-tier",
                                  nice=19)
        self._queue.submit(Job(self._first_probe))

    # -------------------------------------------------------------------------------------------------------------
    # health

    @property
    def available(self) -> bool:
        """Whether requests use the server (``False`` from a failure until a probe answers)."""
        return self._up

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count a failure; an unreachable or slow server is left alone until a probe answers."""
        self._count(errors=1)
        if isinstance(exc, self._unreachable):
            with self._lock:
                was_up, self._up = self._up, False
            if was_up:
                log.warning("shared tier %s unavailable (%s: %s); serving from the local tiers, probing every %.1f s",
                            self.url, what, exc, self._queue.idle_interval)
        else:
            log.warning("shared tier %s: %s failed: %s", self.url, what, exc)

    def _first_probe(self) -> None:
        try:
            self._reader.ping()
        except self._errors as exc:
            self._failed("connect", exc)

    def _probe(self) -> None:
        if self._up:
            return
        try:
            self._reader.ping()
        except self._errors:
            return
        # Connections made before the outage are dead: drop them rather than fail one request on each.
        self._reader.connection_pool.disconnect()
        self._writer.connection_pool.disconnect()
        with self._lock:
            self._up = True
        log.warning("shared tier %s reachable again", self.url)

    # -------------------------------------------------------------------------------------------------------------
    # reads

    def partition(self, namespace: str, fingerprint: str) -> Partition:
        key = (namespace, fingerprint)
        partition = self._partitions.get(key)
        if partition is None:  # slots and the write-behind thread ask at once: one object per key all the same
            partition = self._partitions.setdefault(key, Partition(self.prefix, fingerprint, namespace))
        return partition

    def find(self, query: Query) -> list[Hit[CacheEntry]]:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: :meth:`lookup` for ``query``; asked only with a memory kind (a
        fetch brings only what a plan of that kind restores)."""
        if query.kind is None:
            return []
        return self.lookup(query.namespace, query.fingerprint, query.prompt, query.kind, query.limit, query.floor)

    def lookup(self, namespace: str, fingerprint: str, prompt: np.ndarray, kind: MemoryKind, limit: int,
               floor: int = 0) -> list[Hit[CacheEntry]]:
        """Hits for the longest stored prefixes of ``prompt`` that could serve more than ``floor`` of its first
        ``limit`` tokens (what the local tiers offer); nothing is fetched until a hit's ``fetch``."""
        n_blocks = min(len(prompt) // BLOCK_TOKENS, MAX_LOOKUP_BLOCKS)
        if not self._up or n_blocks == 0 or limit <= floor:
            return []
        partition = self.partition(namespace, fingerprint)
        started = time.perf_counter()
        self._count(lookups=1)
        try:
            with self._reads.active():
                hits = self._lookup(partition, prompt, n_blocks, kind, limit, floor)
        except self._errors as exc:
            self._failed("lookup", exc)
            return []
        except Exception as exc:  # the shared tier never fails a request
            log.exception("shared tier %s: lookup failed", self.url)
            self._failed("lookup", exc)
            return []
        finally:
            self.lookup_latency.observe(time.perf_counter() - started)
        if not hits:
            self._count(misses=1)
        return hits

    def _lookup(self, partition: Partition, prompt: np.ndarray, n_blocks: int, kind: MemoryKind, limit: int,
                floor: int) -> list[Hit[CacheEntry]]:
        chain = partition.chain(prompt, n_blocks)
        ids = self._reader.mget([partition.index_key(h) for h in chain])
        self._count(round_trips=1)
        found = [(block, parse_entry_id(value)) for block, value in enumerate(ids)]
        deepest = max((block for block, entry_id in found if entry_id is not None), default=None)
        if deepest is None:
            return []
        # No entry holds block deepest + 1: at most one token short of it is shared.
        bound = len(prompt) if deepest + 1 == n_blocks else (deepest + 2) * BLOCK_TOKENS - 1
        if min(bound, limit) <= floor:
            return []
        candidates: list[str] = []
        for _, entry_id in reversed(found):
            if entry_id is not None and entry_id not in candidates:
                candidates.append(entry_id)
                if len(candidates) == MAX_CANDIDATES:
                    break
        keys = [partition.entry_key(entry_id) for entry_id in candidates]
        values = self._reader.mget(keys)
        self._count(round_trips=1, bytes_read=sum(len(v) for v in values if v is not None))
        rated = []
        for key, value in zip(keys, values):
            if value is None:
                continue  # evicted (or expired) since the index named it
            manifest = self._valid(key, lambda: decode_manifest(value, partition, key))
            if manifest is None:
                continue
            entry = manifest.entry
            reuse = best_reuse(kind, entry.tokens, entry.n_tokens, entry.pos_min, entry.checkpoints, prompt, limit)
            if reuse.n_keep > 0:
                rated.append((reuse, manifest))
        # The hit's n_common is what its entry can serve, so the planner fetches only the one that serves most.
        rated.sort(key=lambda pair: -pair[0].n_keep)
        return [Hit(TIER, reuse.n_keep, self._fetcher(partition, manifest, reuse)) for reuse, manifest in rated]

    def _valid(self, key: str, parse: Callable[[], _T]) -> _T | None:
        """``parse()``, or ``None`` (and the value dropped) if the value at ``key`` fails validation."""
        try:
            return parse()
        except CheckpointError as exc:
            self._corrupt(key, exc)
            return None

    def _corrupt(self, key: str, exc: BaseException) -> None:
        log.warning("shared tier %s: dropping %s: %s", self.url, key, exc)
        self._count(corrupt=1)
        # Deleted off the request path, so that a replica holding the state writes it again.
        self._queue.submit(Job(lambda: self._delete(key)))

    def _delete(self, key: str) -> None:
        try:
            self._writer.delete(key)
        except self._errors as exc:
            self._failed("delete", exc)

    def _fetcher(self, partition: Partition, manifest: Manifest, reuse: Reuse) -> Callable[[], CacheEntry | None]:
        def fetch() -> CacheEntry | None:
            if not self._up:
                return None
            started = time.perf_counter()
            try:
                with self._reads.active():
                    return self._fetch(partition, manifest, reuse)
            except self._errors as exc:
                self._failed("fetch", exc)
            except Exception as exc:  # the shared tier never fails a request
                log.exception("shared tier %s: fetch failed", self.url)
                self._failed("fetch", exc)
            finally:
                self.fetch_latency.observe(time.perf_counter() - started)
            return None

        return fetch

    def _fetch(self, partition: Partition, manifest: Manifest, reuse: Reuse) -> CacheEntry | None:
        """The entry as far as the plan restores it: its full state and the one checkpoint that serves the prompt
        best (``reuse``; the planner rates the fetched entry again and finds the same)."""
        entry = manifest.entry
        records = [entry.state] if reuse.checkpoint is None else [entry.state, reuse.checkpoint]
        refs = manifest.blobs_of(records)
        blobs: dict[bytes, StateBuffer] = {}
        for digest in refs:
            held = self._digests.buffer(digest)
            if held is not None:
                blobs[digest] = held
        missing = [ref for digest, ref in refs.items() if digest not in blobs]
        if missing:
            keys = [partition.blob_key(ref.digest) for ref in missing]
            values = self._reader.mget(keys)
            self._count(round_trips=1, bytes_read=sum(len(v) for v in values if v is not None))
            for key, ref, value in zip(keys, missing, values):
                if value is None:
                    self._count(incomplete=1)  # the server evicted a blob the manifest still names
                    return None
                buffer = self._valid(key, lambda: check_blob(value, ref, key))
                if buffer is None:
                    return None
                self._digests.remember(buffer, ref.digest)
                blobs[ref.digest] = buffer
        self._note(partition, manifest)
        return manifest.materialize(reuse.checkpoint, blobs)

    def _note(self, partition: Partition, manifest: Manifest) -> None:
        """Remember a manifest this replica restored from or wrote: the next entries of its lineage name its
        checkpoints, which the slot does not hold."""
        key = (partition.base, partition.entry_id(manifest.entry.tokens))
        with self._lock:
            self._lineage[key] = manifest
            self._lineage.move_to_end(key)
            while len(self._lineage) > LINEAGE_MANIFESTS:
                self._lineage.popitem(last=False)

    def _lineage_of(self, partition: Partition) -> list[Manifest]:
        with self._lock:
            return [m for (base, _), m in self._lineage.items() if base == partition.base]

    def count_hit(self) -> None:
        """A plan restored an entry of this tier."""
        self._count(hits=1)

    # -------------------------------------------------------------------------------------------------------------
    # views

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until the write-behind queue is empty (tests, shutdown)."""
        return self._queue.drain(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (for at most ``timeout`` seconds) and stop the write-behind thread."""
        self._queue.close(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters, gauges and latency histograms (read-only snapshot)."""
        with self._lock:
            out: dict[str, Any] = asdict(self.counters)
        out["write_drops"] += self._queue.drops  # dropped from a full queue, besides those refused while down
        out.update(available=int(self._up), queue_depth=self.queue_depth, url=self.url,
                   lookup_seconds=histogram_snapshot(self.lookup_histogram),
                   fetch_seconds=histogram_snapshot(self.fetch_histogram))
        return out
