"""The shared tier: cache entries in Redis or Valkey (one server, or a cluster), so that every replica of a model
resumes any conversation.

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
counter and a miss, never an error for the request; while the server (or a node of a cluster) is unreachable no
request touches it and the write-behind thread probes it every ``retry`` seconds, reconnecting by itself
(:mod:`ckpt_plugin.tiers.shared.connection`). Writes and forgets are :class:`~ckpt_plugin.tiers.shared.writes.SharedWriter`'s.

:meth:`SharedTier.forget` deletes a partition's keys (a tenant's, or a model's) with ``SCAN`` and ``UNLINK`` in
batches (never ``KEYS``, which blocks the server for the whole keyspace), after the write in progress, and makes the
writes queued before it write nothing (``DELETE /checkpoints``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import StateBuffer
from ckpt_plugin.core.pages import PAGES, PagedState
from ckpt_plugin.core.errors import CheckpointError, ConfigError
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.persist.page_map import decode_page_map, is_page_map, open_page
from ckpt_plugin.policy.plan import Hit, Reuse, best_reuse
from ckpt_plugin.tiers.protocol import Admission, Query
from ckpt_plugin.tiers.shared.connection import SharedServer
from ckpt_plugin.tiers.shared.format import (BLOCK_TOKENS, MAX_LOOKUP_BLOCKS, Manifest, Partition, check_blob,
                                             decode_manifest, parse_entry_id)
from ckpt_plugin.tiers.shared.write_behind import Job, WriteBehind
from ckpt_plugin.tiers.shared.support import (MAX_CANDIDATES, TIER, DigestCache, Lineage, Reads, SharedCounters,
                                              Tally, histogram_snapshot, latency_histogram)
from ckpt_plugin.tiers.shared.writes import SharedWriter

__all__ = ["SharedTier"]

log = logging.getLogger("ckpt_plugin")

_T = TypeVar("_T")


class SharedTier:
    """Entries in a Redis or Valkey server at ``url`` (or the cluster that node is part of), shared by every replica
    that points there.

    :param url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) or ``unix://path``, as
        redis-py takes them; a cluster node's URL (database 0) reaches the whole cluster.
    :param prefix: First part of every key (several deployments can share one server).
    :param ttl: Seconds keys live after their last write; ``None`` leaves eviction to the server's ``maxmemory``.
    :param timeout: Seconds a read (lookup, fetch) or a connection attempt may take.
    :param queue: Entries waiting for the write-behind thread at most.
    :param retry: Seconds between probes of an unreachable server (or node).
    """

    def __init__(self, url: str, *, prefix: str = "ckpt", ttl: int | None = None, timeout: float = 0.5,
                 queue: int = 8, retry: float = 2.0) -> None:
        try:
            import redis  # noqa: F401
            import xxhash  # noqa: F401  (blob digests, see shared_format.blob_digest)
        except ImportError as exc:  # pragma: no cover - the redis extra is missing
            raise ConfigError("the shared tier needs redis-py and xxhash: pip install 'ckpt_plugin[redis]'") from exc
        self.prefix = prefix
        self.ttl = ttl
        self.block_tokens = BLOCK_TOKENS
        self._tally = Tally()
        self.server = SharedServer(url, timeout, self._tally, retry)
        self.url = self.server.url
        self.lookup_histogram = latency_histogram("lookup_seconds", "Time of a shared-tier lookup (index and manifests)")
        self.fetch_histogram = latency_histogram("fetch_seconds",
                                                 "Time to fetch and check the blobs of a shared-tier entry")
        self.lookup_latency = self.lookup_histogram.labels(server=self.url)
        self.fetch_latency = self.fetch_histogram.labels(server=self.url)
        self._digests = DigestCache()
        self._lineage = Lineage()
        self._reads = Reads()
        self._published: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()
        self._publish_lock = threading.Lock()
        self._queue = WriteBehind(queue, idle=self.server.probe, idle_interval=retry, name="ckpt-shared-tier",
                                  nice=19)
        self.writes = SharedWriter(self.server, self.partition, ttl, self._tally, self._lineage, self._digests,
                                   self._reads, self._queue)
        # Connected here, not on the write-behind thread: the first request may come at once. A server that does
        # not answer within ``timeout`` is probed later, as after an outage.
        try:
            self.server.connect()
        except self.server.errors as exc:
            self.server.failed("connect", exc)

    # -------------------------------------------------------------------------------------------------------------
    # health

    @property
    def counters(self) -> SharedCounters:
        """The counters (live; :meth:`stats` has a consistent snapshot)."""
        return self._tally.counters

    @property
    def available(self) -> bool:
        """Whether requests use the server (``False`` from a failure until a probe answers). A cluster is available
        while some of its nodes are: requests whose keys are on a failed node are misses, the others go on."""
        return self.server.usable(())

    def _count(self, **amounts: int) -> None:
        self._tally.add(**amounts)

    # -------------------------------------------------------------------------------------------------------------
    # reads

    def partition(self, namespace: str, fingerprint: str) -> Partition:
        """The keys of (``namespace``, ``fingerprint``), in the layout of the server (or cluster) connected."""
        return self.server.partition(self.prefix, namespace, fingerprint)

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
        if n_blocks == 0 or limit <= floor:
            return []
        partition = self.partition(namespace, fingerprint)
        head = [partition.entry_key("")]  # the node of the partition's manifests and index keys (one slot)
        if not self.server.usable(head):
            return []
        started = time.perf_counter()
        self._count(lookups=1)
        try:
            with self._reads.active():
                hits = self._lookup(partition, prompt, n_blocks, kind, limit, floor)
        except self.server.errors as exc:
            self.server.failed("lookup", exc, head)
            return []
        except Exception as exc:  # the shared tier never fails a request
            log.exception("shared tier %s: lookup failed", self.url)
            self.server.failed("lookup", exc)
            return []
        finally:
            self.lookup_latency.observe(time.perf_counter() - started)
        if not hits:
            self._count(misses=1)
        return hits

    def _lookup(self, partition: Partition, prompt: np.ndarray, n_blocks: int, kind: MemoryKind, limit: int,
                floor: int) -> list[Hit[CacheEntry]]:
        chain = partition.chain(prompt, n_blocks)
        ids = self.server.reader.mget([partition.index_key(h) for h in chain])  # one slot in a cluster
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
        values = self.server.reader.mget(keys)  # the same slot
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
            self.server.writer.delete(key)
        except self.server.errors as exc:
            self.server.failed("delete", exc, [key])

    def _fetcher(self, partition: Partition, manifest: Manifest, reuse: Reuse) -> Callable[[], CacheEntry | None]:
        def fetch() -> CacheEntry | None:
            keys: list[str] = []
            started = time.perf_counter()
            try:
                with self._reads.active():
                    return self._fetch(partition, manifest, reuse, keys)
            except self.server.errors as exc:
                self.server.failed("fetch", exc, keys)
            except Exception as exc:  # the shared tier never fails a request
                log.exception("shared tier %s: fetch failed", self.url)
                self.server.failed("fetch", exc)
            finally:
                self.fetch_latency.observe(time.perf_counter() - started)
            return None

        return fetch

    def _fetch(self, partition: Partition, manifest: Manifest, reuse: Reuse, keys: list[str]) -> CacheEntry | None:
        """The entry as far as the plan restores it: its full state and the one checkpoint that serves the prompt
        best (``reuse``; the planner rates the fetched entry again and finds the same). ``keys`` gets the keys
        read (a failure is the fault of their nodes)."""
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
            keys += [partition.blob_key(ref.digest) for ref in missing]
            if not self.server.usable(keys):  # a node holding some of them is down: the others would not do
                return None
            values = self.server.mget(keys)
            self._count(round_trips=1, bytes_read=sum(len(v) for v in values if v is not None))
            for key, ref, value in zip(keys, missing, values):
                if value is None:
                    self._count(incomplete=1)  # the server evicted a blob the manifest still names
                    return None
                buffer = self._valid(key, lambda: check_blob(value, ref, key))
                if buffer is None:
                    return None
                blobs[ref.digest] = buffer
        maps = {digest: buffer for digest, buffer in blobs.items()
                if isinstance(buffer, np.ndarray) and is_page_map(buffer)}
        if maps:
            paged = self._paged(partition, maps, keys)
            if paged is None:
                return None
            blobs.update(paged)
        for ref in missing:  # a later fetch of a blob this process holds takes it from here
            self._digests.remember(blobs[ref.digest], ref.digest)
        self._lineage.note(partition, manifest)
        return manifest.materialize(reuse.checkpoint, blobs)

    def _paged(self, partition: Partition, maps: dict[bytes, StateBuffer],
               keys: list[str]) -> dict[bytes, PagedState] | None:
        """The paged states whose page maps are ``maps`` (by digest): their pages taken live from this process where
        it holds them, the others read in one ``MGET``; ``None`` if one is missing or corrupt."""
        decoded = {}
        for digest, data in maps.items():
            where = partition.blob_key(digest)
            page_map = self._valid(where, lambda: decode_page_map(data, where))
            if page_map is None:
                return None
            decoded[digest] = page_map
        sizes = {page_id: size for page_map in decoded.values() for page_id, size in page_map.page_sizes.items()}
        pages = {}
        for page_id in sizes:
            page = PAGES.get(page_id)
            if page is not None and page.nbytes == sizes[page_id]:
                pages[page_id] = page
        wanted = [page_id for page_id in sizes if page_id not in pages]
        self._count(pages_held=len(pages), pages_read=len(wanted))
        if wanted:
            page_keys = [partition.blob_key(page_id) for page_id in wanted]
            keys += page_keys
            if not self.server.usable(page_keys):
                return None
            values = self.server.mget(page_keys)
            self._count(round_trips=1, bytes_read=sum(len(v) for v in values if v is not None))
            for key, page_id, value in zip(page_keys, wanted, values):
                if value is None:
                    self._count(incomplete=1)  # the server evicted a page a page map still names
                    return None
                page = self._valid(key, lambda: open_page(value, page_id, sizes[page_id], PAGES, key))
                if page is None:
                    return None
                pages[page_id] = page
        return {digest: page_map.bind(pages) for digest, page_map in decoded.items()}

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
        out: dict[str, Any] = self._tally.snapshot()
        out["write_drops"] += self._queue.drops  # dropped from a full queue, besides those refused while down
        out.update(available=int(self.available), failed_nodes=self.server.failed_nodes, queue_depth=self.queue_depth, url=self.url,
                   lookup_seconds=histogram_snapshot(self.lookup_histogram),
                   fetch_seconds=histogram_snapshot(self.fetch_histogram))
        return out

    # -------------------------------------------------------------------------------------------------------------
    # writes (SharedWriter's)

    def admit(self, entry: CacheEntry, admission: Admission) -> bool:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: queue ``entry`` for writing after the response, its
        buffers held until written or dropped; whether it was queued."""
        return self.writes.admit(entry, admission)

    def submit(self, entry: CacheEntry, release: Callable[[], None]) -> bool:
        """Queue ``entry`` for writing; ``release`` runs once it is written or dropped (:meth:`SharedWriter.submit`)."""
        return self.writes.submit(entry, release)

    def forget(self, namespace: str | None, fingerprint: str) -> int | None:
        """Delete a partition's keys on the server (every node of a cluster): :meth:`SharedWriter.forget`."""
        return self.writes.forget(namespace, fingerprint)

    def publish_marker(self, owner: Any, marker: tuple[int, str]) -> bool:
        """Record that ``owner`` (a manager) offered its slot at ``marker`` (version, namespace); ``False`` if it
        already had."""
        with self._publish_lock:
            if self._published.get(owner) == marker:
                return False
            self._published[owner] = marker
            return True
