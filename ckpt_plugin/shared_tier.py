"""The shared tier: cache entries in Redis or Valkey, so that every replica of a model resumes any conversation.

It sits behind the same store interface as RAM and disk (:class:`~ckpt_plugin.store.TieredStore`): ``lookup``
returns :class:`~ckpt_plugin.policy.Hit` objects the planner fetches lazily, entries go in through the write-behind
queue. The layout of keys and values is :mod:`ckpt_plugin.shared_format`'s.

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

import atexit
import contextlib
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import urlsplit

import numpy as np

from .cache import CacheEntry
from .checkpoint import StateBuffer
from .errors import CheckpointError, ConfigError
from .policy import Hit, MemoryKind, Reuse, best_reuse
from .shared_format import (
    BLOCK_TOKENS,
    MAX_LOOKUP_BLOCKS,
    Manifest,
    Partition,
    blob_digest,
    check_blob,
    decode_manifest,
    encode_manifest,
    parse_entry_id,
)
from .write_behind import Job, WriteBehind

if TYPE_CHECKING:
    from .config import CheckpointSettings

log = logging.getLogger("ckpt_plugin")

TIER = "shared"
"""The tier name of the shared tier's hits (``Plan.tier``)."""
MAX_CANDIDATES = 2
"""Manifests fetched per lookup: the deepest entries the index names, deepest first."""
WRITE_TIMEOUT = 5.0
"""Seconds a write-behind command may block (a state of tens of MB takes a while on a slow link)."""
WRITE_DELAY = 0.1
"""Seconds a write waits at most for the next request's reads: the server ingesting a state of tens of MB delays
every other command, so a write starts once the request that follows its response has done its lookup and fetch
(or after this long, when none comes)."""
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_RECENT = 4096
LINEAGE_MANIFESTS = 64
"""Manifests restored from or written recently, whose checkpoints later entries of their lineages name."""
FORGET_SCAN_COUNT = 1000
"""``COUNT`` hint of each ``SCAN`` of :meth:`SharedTier.forget`: keys the server looks at per round trip."""
FORGET_BATCH = 500
"""Keys per ``UNLINK`` of :meth:`SharedTier.forget`: each call is short for the server (UNLINK frees the values on
a background thread), and a round trip carries many keys."""
_FORGETS = 1024
"""Forgotten partitions remembered (with when), so that writes queued before a forget write nothing."""
_T = TypeVar("_T")


@dataclass
class SharedCounters:
    """Monotonic counters of a shared tier (``ckpt_shared_*_total`` in ``/metrics``)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    corrupt: int = 0
    incomplete: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    write_errors: int = 0
    write_drops: int = 0
    round_trips: int = 0
    write_round_trips: int = 0


class Latency:
    """A latency histogram (cumulative buckets, as Prometheus exposes them)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if seconds <= bound), len(self.buckets))
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """``([(upper bound, cumulative count), ..., ("+Inf", total)], sum)``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        return cumulative, total


class DigestCache:
    """Blob digests of live state buffers by identity, and live buffers by digest; both forget a buffer when it
    dies. A checkpoint shared by a conversation's entries is hashed once, and a blob this process holds is never
    fetched."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, bytes]] = {}
        self._by_digest: dict[bytes, weakref.ref] = {}
        # Finalizers may run in the middle of any allocation, on a thread already holding the lock.
        self._lock = threading.RLock()

    def digest(self, buffer: StateBuffer) -> bytes:
        with self._lock:
            known = self._by_id.get(id(buffer))
            if known is not None and known[0]() is buffer:
                return known[1]
        digest = blob_digest(buffer)
        self.remember(buffer, digest)
        return digest

    def remember(self, buffer: StateBuffer, digest: bytes) -> None:
        with self._lock:
            self._by_id[id(buffer)] = (weakref.ref(buffer), digest)
            self._by_digest[digest] = weakref.ref(buffer)
        weakref.finalize(buffer, self._forget, id(buffer), digest)

    def buffer(self, digest: bytes) -> StateBuffer | None:
        with self._lock:
            ref = self._by_digest.get(digest)
            return ref() if ref is not None else None

    def _forget(self, key: int, digest: bytes) -> None:
        with self._lock:
            known = self._by_id.get(key)
            if known is not None and known[0]() is None:
                del self._by_id[key]
            ref = self._by_digest.get(digest)
            if ref is not None and ref() is None:
                del self._by_digest[digest]


class Reads:
    """When the request path last talked to the server, so that writes wait for its reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._started = 0.0
        self._ended = 0.0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            self._in_flight += 1
            self._started = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._ended = time.monotonic()

    def wait_quiet(self, since: float, limit: float, quiet: float = 0.002) -> None:
        """Wait until a read that started after ``since`` is over and ``quiet`` seconds passed without one, or
        until ``since + limit``."""
        while (now := time.monotonic()) < since + limit:
            with self._lock:
                done = self._started > since and not self._in_flight and now - self._ended >= quiet
            if done:
                return
            time.sleep(quiet)


def redacted(url: str) -> str:
    """``url`` without its credentials, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class SharedTier:
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
        self.lookup_latency = Latency()
        self.fetch_latency = Latency()
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
        if partition is None:
            partition = self._partitions[key] = Partition(self.prefix, fingerprint, namespace)
        return partition

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
    # writes

    def submit(self, entry: CacheEntry, release: Callable[[], None]) -> bool:
        """Queue ``entry`` for writing after the response; ``release`` runs once it is written or dropped.

        Entries shorter than a block (never found by a lookup) and entries this process wrote recently (same
        tokens, same partition: the same state) are not written again.
        """
        partition = self.partition(entry.namespace, entry.fingerprint)
        entry_id = partition.entry_id(entry.tokens)
        if entry.n_tokens < BLOCK_TOKENS or not self._claim(entry_id, partition.base):
            release()
            return False
        if not self._up:
            self._count(write_drops=1)
            self._unclaim(entry_id)
            release()
            return False
        written = [False]
        submitted = time.monotonic()

        def run() -> None:
            self._reads.wait_quiet(submitted, WRITE_DELAY)
            written[0] = self._write(partition, entry_id, entry, submitted)

        def done() -> None:
            if not written[0]:
                self._unclaim(entry_id)  # dropped or failed: a later offer of the same state is written
            release()

        return self._queue.submit(Job(run, done))

    def _claim(self, entry_id: str, base: str) -> bool:
        """Record that ``entry_id`` (of the partition whose keys start with ``base``) is being written, unless it was
        (or is being) written recently: the state of a slot is offered after its response and again when the slot
        is parked, and written once."""
        with self._lock:
            claimed = self._recent.get(entry_id)
            now = time.monotonic()
            if claimed is not None and (self.ttl is None or now - claimed[0] < self.ttl / 2):
                return False
            self._recent[entry_id] = (now, base)
            self._recent.move_to_end(entry_id)
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
            return True

    def _unclaim(self, entry_id: str) -> None:
        with self._lock:
            self._recent.pop(entry_id, None)

    def _write(self, partition: Partition, entry_id: str, entry: CacheEntry, submitted: float) -> bool:
        """Write ``entry`` (queued at ``submitted``); return whether it is stored (a failure is counted, never
        raised). An entry of a partition forgotten since it was queued is not written: it is state the tenant asked
        to forget."""
        with self._write_lock:
            if self._forgotten_since(partition.base, submitted):
                log.debug("shared tier %s: not writing an entry of a partition forgotten since", self.url)
                return False
            if not self._up:
                self._count(write_drops=1)
                return False
            try:
                return self._write_entry(partition, entry_id, entry)
            except self._errors as exc:
                self._count(write_errors=1)
                self._failed("write", exc)
                return False

    def _write_entry(self, partition: Partition, entry_id: str, entry: CacheEntry) -> bool:
        """Blobs first, then the manifest, then the index: a reader that finds an index key finds the rest."""
        encoded = encode_manifest(entry, self._digests.digest, self._lineage_of(partition))
        blobs = encoded.blobs
        blob_keys = {digest: partition.blob_key(digest) for digest in blobs}
        pipe = self._writer.pipeline(transaction=False)
        for key in blob_keys.values():
            pipe.exists(key)
        present = pipe.execute()
        pipe = self._writer.pipeline(transaction=False)
        written = 0
        for (digest, key), exists in zip(blob_keys.items(), present):
            if not exists:
                pipe.set(key, memoryview(blobs[digest]), ex=self.ttl)
                written += int(blobs[digest].nbytes)
            elif self.ttl is not None:
                pipe.expire(key, self.ttl)
        if self.ttl is not None:
            for digest in encoded.carried:
                pipe.expire(partition.blob_key(digest), self.ttl)
        if not self._executed(pipe, "write blobs"):
            return False
        pipe = self._writer.pipeline(transaction=False)
        pipe.set(partition.entry_key(entry_id), encoded.data, ex=self.ttl)
        for chained in partition.chain(entry.tokens):
            pipe.set(partition.index_key(chained), entry_id, ex=self.ttl)
        if not self._executed(pipe, "write manifest"):
            return False
        self._count(writes=1, bytes_written=written + len(encoded.data), write_round_trips=3)
        self._note(partition, encoded.manifest)
        return True

    def _executed(self, pipe: Any, what: str) -> bool:
        """Run ``pipe``; a refused command (``maxmemory`` with ``noeviction``: OOM) fails the write, not the tier."""
        results = pipe.execute(raise_on_error=False)
        refused = [r for r in results if isinstance(r, BaseException)]
        if not refused:
            return True
        unreachable = [r for r in refused if isinstance(r, self._unreachable)]
        if unreachable:
            raise unreachable[0]
        self._count(write_errors=1)
        log.warning("shared tier %s: %s refused: %s", self.url, what, refused[0])
        return False

    # -------------------------------------------------------------------------------------------------------------
    # forgetting

    def forget(self, namespace: str | None, fingerprint: str) -> int | None:
        """Delete every key of ``namespace``'s partition of model ``fingerprint`` (of every namespace of that model,
        for ``None``): manifests, blobs and index keys; return how many manifests (entries) went, or ``None`` if the
        server could not do it (unreachable, or the ACL refuses ``SCAN``/``UNLINK``; a warning and
        ``ckpt_shared_errors_total``).

        Waits for a write in progress (its keys are then deleted too); writes of that partition queued before this
        call write nothing. Keys are found with ``SCAN ... MATCH <partition>*`` and deleted with ``UNLINK`` in
        batches of :data:`FORGET_BATCH`, never ``KEYS``: the server keeps serving other clients between round trips.
        The cost grows with the server's whole keyspace (``SCAN`` walks it), about one round trip per
        :data:`FORGET_SCAN_COUNT` keys. Other replicas' RAM and disk tiers are theirs to clear.
        """
        base = self.partition(namespace if namespace is not None else "", fingerprint).base
        if namespace is None:
            # "<prefix>:<fp>:<ns>:" -> "<prefix>:<fp>:": every namespace of the model (digests hold no ':').
            base = base[: base.rstrip(":").rfind(":") + 1]
        with self._write_lock:
            with self._lock:
                self._forgotten[base] = time.monotonic()
                self._forgotten.move_to_end(base)
                while len(self._forgotten) > _FORGETS:
                    self._forgotten.popitem(last=False)
                # A state of the partition offered again later is new state: write it then.
                for entry_id in [i for i, (_, b) in self._recent.items() if b.startswith(base)]:
                    del self._recent[entry_id]
                # Later manifests must not name checkpoints whose blobs are about to go.
                for key in [k for k in self._lineage if k[0].startswith(base)]:
                    del self._lineage[key]
            try:
                return self._unlink_matching(_glob_escape(base) + "*")
            except self._errors as exc:
                self._failed("forget", exc)
                return None

    def _unlink_matching(self, pattern: str) -> int:
        """``UNLINK`` every key matching ``pattern``, found by ``SCAN``; return how many were manifests."""
        manifests = 0
        batch: list[bytes] = []

        def flush() -> int:
            self._writer.unlink(*batch)
            # A manifest's key is "<partition>e:<entry id>"; ids are hex digits, so the kind is the part before.
            found = sum(1 for key in batch if key.rsplit(b":", 2)[-2] == b"e")
            batch.clear()
            return found

        for key in self._writer.scan_iter(match=pattern, count=FORGET_SCAN_COUNT):
            batch.append(key)
            if len(batch) >= FORGET_BATCH:
                manifests += flush()
        if batch:
            manifests += flush()
        return manifests

    def _forgotten_since(self, base: str, since: float) -> bool:
        """Whether a partition whose keys start with ``base`` was forgotten at or after ``since``."""
        with self._lock:
            return any(base.startswith(prefix) and when >= since for prefix, when in self._forgotten.items())

    def publish_marker(self, owner: Any, marker: tuple[int, str]) -> bool:
        """Record that ``owner`` (a manager) offered its slot at ``marker`` (version, namespace); ``False`` if it
        already had."""
        with self._lock:
            if self._published.get(owner) == marker:
                return False
            self._published[owner] = marker
            return True

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
                   lookup_seconds=self.lookup_latency.snapshot(), fetch_seconds=self.fetch_latency.snapshot())
        return out


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``SCAN ... MATCH``): the prefix is the operator's choice."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", text)


_TIERS: dict[tuple, SharedTier] = {}
_TIERS_LOCK = threading.Lock()


def shared_tier_for(settings: CheckpointSettings) -> SharedTier | None:
    """The process's shared tier for ``settings.redis_url`` (one per server and options, shared by every manager:
    one connection pool and one write-behind thread), or ``None`` without a URL."""
    if settings.redis_url is None:
        return None
    url = settings.redis_url.get_secret_value()
    key = (url, settings.redis_prefix, settings.redis_ttl, settings.redis_timeout, settings.redis_queue,
           settings.redis_retry)
    with _TIERS_LOCK:
        tier = _TIERS.get(key)
        if tier is None:
            tier = _TIERS[key] = SharedTier(url, prefix=settings.redis_prefix, ttl=settings.redis_ttl,
                                            timeout=settings.redis_timeout, queue=settings.redis_queue,
                                            retry=settings.redis_retry)
            # The lifespan shutdown parks every slot into the queue: write it before the process goes.
            atexit.register(tier.close)
        return tier
