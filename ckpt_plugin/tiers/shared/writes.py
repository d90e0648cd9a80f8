"""The write side of the shared tier: entries written behind the response, a tenant's partition forgotten, the
markers of slots already offered. :class:`SharedWrites` is the base of :class:`~ckpt_plugin.tiers.shared.tier.SharedTier`,
which owns the connections and the state these methods use (declared here)."""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable


from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.protocol import Admission
from ckpt_plugin.tiers.shared.format import BLOCK_TOKENS, Manifest, Partition, encode_manifest
from ckpt_plugin.tiers.shared.write_behind import Job, WriteBehind
from ckpt_plugin.tiers.shared.support import FORGETS, RECENT, FORGET_BATCH, FORGET_SCAN_COUNT, WRITE_DELAY, DigestCache, Reads, SharedCounters

log = logging.getLogger("ckpt_plugin")


class SharedWrites:
    """Writes, forgets and publish markers of a :class:`~ckpt_plugin.tiers.shared.tier.SharedTier` (see the module)."""

    url: str
    prefix: str
    ttl: int | None
    counters: SharedCounters
    _writer: Any
    _errors: tuple[type[BaseException], ...]
    _unreachable: tuple[type[BaseException], ...]
    _digests: DigestCache
    _recent: OrderedDict[str, tuple[float, str]]
    _forgotten: OrderedDict[str, float]
    _write_lock: threading.Lock
    _lineage: OrderedDict[tuple[str, str], Manifest]
    _lock: threading.Lock
    _reads: Reads
    _up: bool
    _published: weakref.WeakKeyDictionary[Any, tuple[int, str]]
    _queue: WriteBehind

    # The read side's, defined by SharedTier.
    def _count(self, **amounts: int) -> None: ...

    def _failed(self, what: str, exc: BaseException) -> None: ...

    def partition(self, namespace: str, fingerprint: str) -> Partition: ...

    def _note(self, partition: Partition, manifest: Manifest) -> None: ...

    def _lineage_of(self, partition: Partition) -> list[Manifest]: ...

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
                while len(self._forgotten) > FORGETS:
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


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``SCAN ... MATCH``): the prefix is the operator's choice."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", text)
