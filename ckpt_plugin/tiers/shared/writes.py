"""The write side of the shared tier: entries written behind the response, and a tenant's partition forgotten.
:class:`SharedWriter` is owned by :class:`~ckpt_plugin.tiers.shared.tier.SharedTier`, which hands it the parts both
sides use (the server, the counters, the lineage, the digests, the write-behind queue)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Callable


from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.pages import PAGES
from ckpt_plugin.persist.page_map import seal_page
from ckpt_plugin.tiers.protocol import Admission
from ckpt_plugin.tiers.shared.connection import SharedServer
from ckpt_plugin.tiers.shared.format import BLOCK_TOKENS, MANIFEST_TAG, Partition, encode_manifest
from ckpt_plugin.tiers.shared.write_behind import Job, WriteBehind
from ckpt_plugin.tiers.shared.support import (FORGETS, RECENT, FORGET_BATCH, FORGET_SCAN_COUNT, WRITE_DELAY,
                                              DigestCache, Lineage, Reads, Tally)

__all__ = ["SharedWriter"]

log = logging.getLogger("ckpt_plugin")


class SharedWriter:
    """Writes and forgets of a :class:`~ckpt_plugin.tiers.shared.tier.SharedTier` (see the module).

    :param partition: ``partition(namespace, fingerprint)``: the tier's key layout of a partition.
    :param ttl: Seconds keys live after their last write (``None``: until evicted).
    """

    def __init__(self, server: SharedServer, partition: Callable[[str, str], Partition], ttl: int | None,
                 tally: Tally, lineage: Lineage, digests: DigestCache, reads: Reads, queue: WriteBehind) -> None:
        self.server = server
        self.partition = partition
        self.ttl = ttl
        self.tally = tally
        self.lineage = lineage
        self.digests = digests
        self.reads = reads
        self.queue = queue
        self._lock = threading.Lock()
        # entry id -> (when claimed, its partition's key prefix)
        self._recent: OrderedDict[str, tuple[float, str]] = OrderedDict()
        # key prefix of a forgotten partition -> when (monotonic); see forget()
        self._forgotten: OrderedDict[str, float] = OrderedDict()
        # Held for a whole entry's write and for a forget: a forget waits for the write in progress, and a write
        # after it sees its mark.
        self._write_lock = threading.Lock()

    # -------------------------------------------------------------------------------------------------------------
    # writes

    def admit(self, entry: CacheEntry, admission: Admission) -> bool:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: :meth:`submit` ``entry``, its buffers held (``admission.hold``)
        until written or dropped; whether it was queued."""
        return self.submit(entry, admission.hold(entry))

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
        if not self.server.usable(()):
            self.tally.add(write_drops=1)
            self._unclaim(entry_id)
            release()
            return False
        written = [False]
        submitted = time.monotonic()

        def run() -> None:
            self.reads.wait_quiet(submitted, WRITE_DELAY)
            written[0] = self._write(partition, entry_id, entry, submitted)

        def done() -> None:
            if not written[0]:
                self._unclaim(entry_id)  # dropped or failed: a later offer of the same state is written
            release()

        return self.queue.submit(Job(run, done))

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
            while len(self._recent) > RECENT:
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
                log.debug("shared tier %s: not writing an entry of a partition forgotten since", self.server.url)
                return False
            keys: list[str] = [partition.entry_key(entry_id)]
            try:
                return self._write_entry(partition, entry_id, entry, keys)
            except self.server.errors as exc:
                self.tally.add(write_errors=1)
                self.server.failed("write", exc, keys)
                return False

    def _write_entry(self, partition: Partition, entry_id: str, entry: CacheEntry, keys: list[str]) -> bool:
        """Blobs first, then the manifest, then the index: a reader that finds an index key finds the rest. ``keys``
        gets the keys written (a failure is the fault of their nodes)."""
        encoded = encode_manifest(entry, self.digests.digest, self.lineage.of(partition))
        blobs = encoded.blobs
        blob_keys = {digest: partition.blob_key(digest) for digest in (*blobs, *encoded.pages)}
        keys += blob_keys.values()
        if not self.server.usable(keys):  # a node of the cluster that holds some of them is down
            self.tally.add(write_drops=1)
            return False
        writer = self.server.writer
        # In a cluster, each pipeline sends each node its commands at once (redis-py groups them by node).
        pipe = writer.pipeline(transaction=False)
        for key in blob_keys.values():
            pipe.exists(key)
        present = pipe.execute()
        pipe = writer.pipeline(transaction=False)
        written = 0
        new_pages = []
        for (digest, key), exists in zip(blob_keys.items(), present):
            if not exists:
                page = encoded.pages.get(digest)
                value = memoryview(blobs[digest]) if page is None else seal_page(page)
                pipe.set(key, value, ex=self.ttl)
                written += len(value)
                if page is not None:
                    new_pages.append(digest)
            elif self.ttl is not None:
                pipe.expire(key, self.ttl)
        if self.ttl is not None:
            for digest in encoded.carried:
                pipe.expire(partition.blob_key(digest), self.ttl)
        if not self._executed(pipe, "write blobs"):
            return False
        pipe = writer.pipeline(transaction=False)
        pipe.set(partition.entry_key(entry_id), encoded.data, ex=self.ttl)
        for chained in partition.chain(entry.tokens):
            pipe.set(partition.index_key(chained), entry_id, ex=self.ttl)
        if not self._executed(pipe, "write manifest"):
            return False
        self.tally.add(writes=1, bytes_written=written + len(encoded.data), write_round_trips=3,
                       pages_written=len(new_pages), pages_present=len(encoded.pages) - len(new_pages))
        PAGES.tier_stored("shared", new_pages)  # the KV events announce them (a page's id is its blob's digest)
        for digest, state in encoded.paged.items():  # a fetch of this entry here finds the state live
            self.digests.remember(state, digest)
        self.lineage.note(partition, encoded.manifest)
        return True

    def _executed(self, pipe: Any, what: str) -> bool:
        """Run ``pipe``; a refused command (``maxmemory`` with ``noeviction``: OOM) fails the write, not the tier."""
        results = pipe.execute(raise_on_error=False)
        refused = [r for r in results if isinstance(r, BaseException)]
        if not refused:
            return True
        faults = [r for r in refused if isinstance(r, self.server.node_faults)]
        if faults:
            raise faults[0]
        self.tally.add(write_errors=1)
        log.warning("shared tier %s: %s refused: %s", self.server.url, what, refused[0])
        return False

    # -------------------------------------------------------------------------------------------------------------
    # forgetting

    def forget(self, namespace: str | None, fingerprint: str) -> int | None:
        """Delete every key of ``namespace``'s partition of model ``fingerprint`` (of every namespace of that model,
        for ``None``): manifests, blobs and index keys, on every node of a cluster; return how many manifests
        (entries) went, or ``None`` if the server could not do it (unreachable, a node of the cluster down, or the
        ACL refuses ``SCAN``/``UNLINK``; a warning and ``ckpt_shared_errors_total``).

        Waits for a write in progress (its keys are then deleted too); writes of that partition queued before this
        call write nothing. Keys are found with ``SCAN ... MATCH <partition>*`` and deleted with ``UNLINK`` in
        batches of :data:`FORGET_BATCH`, never ``KEYS``: the server keeps serving other clients between round trips.
        The cost grows with the server's whole keyspace (``SCAN`` walks it), about one round trip per
        :data:`FORGET_SCAN_COUNT` keys. Other replicas' RAM and disk tiers are theirs to clear.
        """
        partition = self.partition(namespace if namespace is not None else "", fingerprint)
        prefixes = partition.key_prefixes(every_namespace=namespace is None)
        base = prefixes[0]
        if not partition.tagged:
            prefixes = prefixes[:1]  # one server's keys are all under the untagged prefix: one SCAN
        with self._write_lock:
            with self._lock:
                self._forgotten[base] = time.monotonic()
                self._forgotten.move_to_end(base)
                while len(self._forgotten) > FORGETS:
                    self._forgotten.popitem(last=False)
                # A state of the partition offered again later is new state: write it then.
                for entry_id in [i for i, (_, b) in self._recent.items() if b.startswith(base)]:
                    del self._recent[entry_id]
            self.lineage.forget(base)
            if not self.server.usable(()):
                self.tally.add(errors=1)
                log.warning("shared tier %s: cannot forget while unreachable", self.server.url)
                return None
            try:
                return sum(self._unlink_matching(_glob_escape(prefix) + "*") for prefix in prefixes)
            except self.server.errors as exc:
                self.server.failed("forget", exc)
                return None

    def _unlink_matching(self, pattern: str) -> int:
        """``UNLINK`` every key matching ``pattern``, found by ``SCAN`` (of every node of a cluster); return how many
        were manifests."""
        writer = self.server.writer
        manifests = 0
        batch: list[bytes] = []

        def flush() -> int:
            writer.unlink(*batch)  # in a cluster, redis-py splits it per slot, pipelined per node
            # A manifest's key is "<partition>e:<entry id>"; ids are hex digits, so the kind is the part before.
            found = sum(1 for key in batch if key.rsplit(b":", 2)[-2] == MANIFEST_TAG.encode())
            batch.clear()
            return found

        for key in writer.scan_iter(match=pattern, count=FORGET_SCAN_COUNT):
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


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``SCAN ... MATCH``): the prefix is the operator's choice."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", text)
