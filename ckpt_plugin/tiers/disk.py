"""The disk tier of the prompt cache: entries as files that survive restarts.

Entries are written through when they enter the RAM cache (atomically, see :mod:`ckpt_plugin.persist`), indexed at
start-up from their headers, found by the same radix index as the RAM cache, and read when chosen: one pass of the
file into state buffers of the RAM cache's pool, validated there (:func:`~ckpt_plugin.persist.read_entry`). The file
is never mapped: a mapped file truncated from outside would kill the process with ``SIGBUS`` on the next restore.
The tier has its own byte budget; the least recently used files go first. A file that fails validation (at the
start-up scan or when read) is moved aside (``.corrupt``), counted in :attr:`DiskTier.corrupt_files` and never
loaded. :meth:`DiskTier.clear` forgets a namespace (or everything): its files are deleted.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pathlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.ram import locked
from ckpt_plugin.core.checkpoint import StateBufferPool
from ckpt_plugin.core.errors import CheckpointError, CorruptFileError
from ckpt_plugin.policy.eviction import Chooser, evict_until
from ckpt_plugin.policy.plan import Hit
from ckpt_plugin.persist.paths import remove_stale_temp_files
from ckpt_plugin.persist.read import read_entry, read_header, read_recorded_namespace
from ckpt_plugin.persist.write import write_entry
from ckpt_plugin.tiers.radix import RadixIndex
from ckpt_plugin.tiers.protocol import Admission, Query, Tier

__all__ = ["DiskRecord", "DiskTier"]

log = logging.getLogger("ckpt_plugin")

SUFFIX = ".ckpt"
CORRUPT_SUFFIX = ".corrupt"
"""Files that failed validation are renamed to this suffix (kept for inspection, never loaded)."""


@dataclass(eq=False)
class DiskRecord:
    """An entry on disk, known by its header (``_node`` is its place in the tier's radix index)."""

    path: pathlib.Path
    tokens: np.ndarray
    namespace: str
    fingerprint: str
    size: int
    _node: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """The file's size (what evicting it frees)."""
        return self.size

    @property
    def n_tokens(self) -> int:
        """Tokens of the entry."""
        return len(self.tokens)


class DiskTier:
    """Prompt-cache entries in ``directory``, within ``max_bytes``.

    :param directory: Where the files live (created if missing).
    :param max_bytes: Byte budget of the files.
    :ivar corrupt_files: Files that failed validation since the tier was made (start-up scan and reads).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._indexes: dict[tuple[str, str], RadixIndex[DiskRecord]] = {}
        self._records: OrderedDict[pathlib.Path, DiskRecord] = OrderedDict()
        self.resident_bytes = 0
        self.corrupt_files = 0
        # Several managers (threads) may share one tier; held for bookkeeping and one file write or read at a time.
        self._lock = threading.RLock()
        self._scan()

    def __len__(self) -> int:
        return len(self._records)

    def _scan(self) -> None:
        # A writer killed mid-save leaves its temporary file; an hour old, it belongs to no live write.
        for stale in remove_stale_temp_files(self.directory):
            log.info("disk tier: removed %s, left by an interrupted write", stale.name)
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                header = read_header(path)
            except CorruptFileError as exc:
                log.warning("disk tier: %s is not a valid entry (%s); moved aside", path.name, exc)
                self.corrupt_files += 1
                path.replace(path.with_suffix(CORRUPT_SUFFIX))
                continue
            self._add(DiskRecord(path, header.tokens, header.namespace, header.fingerprint, header.file_size))

    def _add(self, record: DiskRecord) -> None:
        key = (record.namespace, record.fingerprint)
        index = self._indexes.get(key) or self._indexes.setdefault(key, RadixIndex())
        replaced = index.insert(record)
        if replaced is not None:
            self._forget(replaced)
        self._records[record.path] = record
        self.resident_bytes += record.size

    def _forget(self, record: DiskRecord) -> None:
        if self._records.pop(record.path, None) is not None:
            self.resident_bytes -= record.size

    def _remove(self, record: DiskRecord) -> None:
        self._indexes[(record.namespace, record.fingerprint)].remove(record)
        self._forget(record)
        record.path.unlink(missing_ok=True)

    @staticmethod
    def file_name(entry: CacheEntry) -> str:
        """A stable name for ``entry``: the digest of its partition and tokens."""
        digest = hashlib.sha256(f"{entry.namespace}\0{entry.fingerprint}\0".encode())
        digest.update(np.ascontiguousarray(entry.tokens, dtype="<i4").tobytes())
        return digest.hexdigest()[:40] + SUFFIX

    def admit(self, entry: CacheEntry, admission: Admission) -> bool:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: :meth:`store`, the victims chosen by ``admission`` (tier
        ``"disk"``)."""
        return self.store(entry, lambda records, n_bytes: admission.select_victims(records, n_bytes, Tier.DISK))

    @locked
    def store(self, entry: CacheEntry, select_victims: Chooser[DiskRecord] | None = None) -> bool:
        """Write ``entry`` (unless a file of the same tokens exists); return whether it is on disk now.

        :param select_victims: Picks the files to delete when the budget is exceeded, among the others, least
            recently used first (:func:`~ckpt_plugin.policy.eviction.evict_until`; the ``select_cache_victims`` hook with
            ``tier="disk"``); a chooser that frees too little leaves the new entry out instead.
        """
        path = self.directory / self.file_name(entry)
        known = self._records.get(path)
        if known is not None:
            self._records.move_to_end(path)
            return True
        if entry.nbytes > self.max_bytes:
            return False
        try:
            size = write_entry(path, entry, model_fingerprint=entry.fingerprint)
        except OSError as exc:
            log.warning("disk tier: could not write %s: %s", path.name, exc)
            return False
        tokens = np.array(entry.tokens, dtype=np.int32)
        tokens.flags.writeable = False
        record = DiskRecord(path, tokens, entry.namespace, entry.fingerprint, size)
        self._add(record)
        fitted, _ = evict_until(
            lambda: self.resident_bytes <= self.max_bytes,
            lambda: self.resident_bytes - self.max_bytes,
            lambda: [r for r in self._records.values() if r is not record],
            self._remove,
            select_victims,
        )
        if not fitted:
            self._remove(record)
        return fitted

    @locked
    def lookup(self, namespace: str, fingerprint: str, prompt: np.ndarray) -> list[tuple[DiskRecord, int]]:
        """Records sharing the longest prefixes with ``prompt`` (see :meth:`RadixIndex.lookup`)."""
        index = self._indexes.get((namespace, fingerprint))
        if index is None or index.size == 0:
            return []
        return index.lookup(prompt)

    def find(self, query: Query) -> list[Hit[CacheEntry]]:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: the records :meth:`lookup` finds, as hits whose ``fetch`` reads the
        file into ``query.pool`` (:meth:`load`)."""
        return [Hit(Tier.DISK, n_common, self._reader(record, query.pool))
                for record, n_common in self.lookup(query.namespace, query.fingerprint, query.prompt)]

    def _reader(self, record: DiskRecord, pool: StateBufferPool | None) -> Callable[[], CacheEntry | None]:
        return lambda: self.load(record, pool)

    @locked
    def load(self, record: DiskRecord, pool: StateBufferPool | None = None) -> CacheEntry | None:
        """Read ``record``'s file into buffers of ``pool`` (see :func:`~ckpt_plugin.persist.read_entry`); ``None``
        if it cannot be had now, and the record forgotten (the file moved aside and counted, if it no longer
        validates)."""
        try:
            entry = read_entry(record.path, expected_fingerprint=record.fingerprint, pool=pool)
        except CheckpointError as exc:
            log.warning("disk tier: dropping %s: %s", record.path.name, exc)
            self.corrupt_files += 1
            self._drop(record)
            return None
        except OSError as exc:
            if exc.errno == errno.ENOMEM:
                # The file is fine; the memory is short now. A miss, and the entry stays for later.
                log.warning("disk tier: no memory to read %s now: %s", record.path.name, exc)
                return None
            log.warning("disk tier: dropping %s: %s", record.path.name, exc)
            self._drop(record)
            return None
        self._records.move_to_end(record.path)
        return entry

    def _drop(self, record: DiskRecord) -> None:
        """Forget ``record``; its file, if any is left, is moved aside so that no later scan indexes it again."""
        self._indexes[(record.namespace, record.fingerprint)].remove(record)
        self._forget(record)
        if record.path.exists():
            record.path.replace(record.path.with_suffix(CORRUPT_SUFFIX))

    @locked
    def clear(self, namespace: str | None = None) -> int:
        """Delete every entry file (of ``namespace`` only, if given); return how many entry files went.

        Besides the files this tier indexed, the directory's other entry files of that namespace go too (written
        by another process sharing the directory since the scan), and so do files moved aside as corrupt whose
        header still names that namespace (every one, without a namespace): a tenant's forgotten prompts must not
        survive in a file nobody loads. A file whose header does not even name its namespace any more cannot be
        attributed to a tenant and stays, unless everything is cleared.
        """
        removed = 0
        for record in list(self._records.values()):
            if namespace is None or record.namespace == namespace:
                self._remove(record)
                removed += 1
        with os.scandir(self.directory) as items:
            paths = [pathlib.Path(item.path) for item in items
                     if item.is_file(follow_symlinks=False) and not item.name.startswith(".")]
        for path in paths:
            if path.suffix not in (SUFFIX, CORRUPT_SUFFIX) or path in self._records:
                continue
            if namespace is not None and self._namespace_of(path) != namespace:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed += path.suffix == SUFFIX
        return removed

    @staticmethod
    def _namespace_of(path: pathlib.Path) -> str | None:
        """The namespace a file's header records (even a file that fails validation), or ``None``."""
        return read_recorded_namespace(path)
