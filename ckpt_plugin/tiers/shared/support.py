"""The shared tier's parts that hold no connection: its constants, counters, latency histograms, the digest cache
of live buffers, and the tracker of the request path's reads."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Iterator
from urllib.parse import urlsplit

from prometheus_client import Histogram

from ckpt_plugin.core.checkpoint import StateBuffer
from ckpt_plugin.tiers.shared.format import Manifest, Partition, blob_digest
from ckpt_plugin.tiers.protocol import Tier

__all__ = [
    "DigestCache",
    "FORGETS",
    "FORGET_BATCH",
    "FORGET_SCAN_COUNT",
    "Lineage",
    "MAX_CANDIDATES",
    "RECENT",
    "Reads",
    "SharedCounters",
    "TIER",
    "Tally",
    "WRITE_DELAY",
    "WRITE_TIMEOUT",
    "histogram_snapshot",
    "latency_histogram",
    "redacted",
]

log = logging.getLogger("ckpt_plugin")

TIER = Tier.SHARED
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
RECENT = 4096
LINEAGE_MANIFESTS = 64
"""Manifests restored from or written recently, whose checkpoints later entries of their lineages name."""
FORGET_SCAN_COUNT = 1000
"""``COUNT`` hint of each ``SCAN`` of :meth:`SharedTier.forget`: keys the server looks at per round trip."""
FORGET_BATCH = 500
"""Keys per ``UNLINK`` of :meth:`SharedTier.forget`: each call is short for the server (UNLINK frees the values on
a background thread), and a round trip carries many keys."""
FORGETS = 1024
"""Forgotten partitions remembered (with when), so that writes queued before a forget write nothing."""


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
    # Pages of paged states: written (the server lacked them), found on the server already when writing, read on a
    # fetch (this process held no live page of that id), and found live here instead of read.
    pages_written: int = 0
    pages_present: int = 0
    pages_read: int = 0
    pages_held: int = 0


class Tally:
    """A tier's :class:`SharedCounters` and the lock that guards them (requests and the write-behind thread count
    at once)."""

    def __init__(self) -> None:
        self.counters = SharedCounters()
        self._lock = threading.Lock()

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return asdict(self.counters)


class Lineage:
    """Manifests this replica restored from or wrote recently, by partition: the next entries of their lineages name
    their checkpoints, which the slot does not hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._manifests: OrderedDict[tuple[str, str], Manifest] = OrderedDict()

    def note(self, partition: Partition, manifest: Manifest) -> None:
        key = (partition.base, partition.entry_id(manifest.entry.tokens))
        with self._lock:
            self._manifests[key] = manifest
            self._manifests.move_to_end(key)
            while len(self._manifests) > LINEAGE_MANIFESTS:
                self._manifests.popitem(last=False)

    def of(self, partition: Partition) -> list[Manifest]:
        with self._lock:
            return [m for (base, _), m in self._manifests.items() if base == partition.base]

    def forget(self, base: str) -> None:
        """Forget the manifests of every partition whose keys start with ``base``: later manifests must not name
        checkpoints whose blobs are about to go."""
        with self._lock:
            for key in [k for k in self._manifests if k[0].startswith(base)]:
                del self._manifests[key]


def latency_histogram(name: str, documentation: str) -> Histogram:
    """A ``prometheus_client`` histogram of one shared tier's latencies (``ckpt_shared_<name>``), labelled by server
    and in no registry: the server's collector (:class:`~ckpt_plugin.http.metrics.SharedTierCollector`) gathers the
    histograms of every tier it serves."""
    return Histogram(f"ckpt_shared_{name}", documentation, ["server"], registry=None, buckets=LATENCY_BUCKETS)


def histogram_snapshot(histogram: Histogram) -> tuple[list[tuple[str, int]], float]:
    """``([(upper bound, cumulative count), ..., ("+Inf", total)], sum)`` of a one-server histogram (the JSON view of
    ``stats()``)."""
    buckets: list[tuple[str, int]] = []
    total = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bound = sample.labels["le"]
                buckets.append((bound if bound == "+Inf" else str(float(bound)), int(sample.value)))
            elif sample.name.endswith("_sum"):
                total += sample.value
    return buckets, total


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


