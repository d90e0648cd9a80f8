"""The disk tier of the prompt cache: entries as files that survive restarts, read back without copying (mmap).

Entries are written through when they enter the RAM cache (atomically, see :mod:`ckpt_plugin.persist`), indexed at
start-up from their headers, found by the same radix index as the RAM cache, and mapped read-only when chosen: the
state bytes handed to llama.cpp are the file's pages. The tier has its own byte budget; the least recently used files
go first. A file that fails validation is moved aside (``.corrupt``) and never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cache import CacheEntry, locked

from .errors import CheckpointError, CorruptFileError
from .persist import read_entry, read_header, remove_stale_temp_files, write_entry
from .radix import RadixIndex

log = logging.getLogger("ckpt_plugin")

SUFFIX = ".ckpt"


@dataclass(eq=False)
class DiskRecord:
    """An entry on disk, known by its header (``_node`` is its place in the tier's radix index)."""

    path: pathlib.Path
    tokens: np.ndarray
    namespace: str
    fingerprint: str
    size: int
    _node: Any = field(default=None, repr=False)


class DiskTier:
    """Prompt-cache entries in ``directory``, within ``max_bytes``.

    :param directory: Where the files live (created if missing).
    :param max_bytes: Byte budget of the files.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._indexes: dict[tuple[str, str], RadixIndex[DiskRecord]] = {}
        self._records: OrderedDict[pathlib.Path, DiskRecord] = OrderedDict()
        self.resident_bytes = 0
        # Several managers (threads) may share one tier; held for bookkeeping and one file write or map at a time.
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
                path.replace(path.with_suffix(".corrupt"))
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

    @locked
    def store(self, entry: CacheEntry) -> bool:
        """Write ``entry`` (unless a file of the same tokens exists); return whether it is on disk now."""
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
        self._add(DiskRecord(path, tokens, entry.namespace, entry.fingerprint, size))
        while self.resident_bytes > self.max_bytes and len(self._records) > 1:
            oldest = next(iter(self._records.values()))
            self._remove(oldest)
        return True

    @locked
    def lookup(self, namespace: str, fingerprint: str, prompt: np.ndarray) -> list[tuple[DiskRecord, int]]:
        """Records sharing the longest prefixes with ``prompt`` (see :meth:`RadixIndex.lookup`)."""
        index = self._indexes.get((namespace, fingerprint))
        if index is None or index.size == 0:
            return []
        return index.lookup(prompt)

    @locked
    def load(self, record: DiskRecord) -> CacheEntry | None:
        """Map ``record``'s file; ``None`` (and the file moved aside) if it no longer validates."""
        try:
            entry = read_entry(record.path, expected_fingerprint=record.fingerprint)
        except (CheckpointError, OSError) as exc:
            log.warning("disk tier: dropping %s: %s", record.path.name, exc)
            self._indexes[(record.namespace, record.fingerprint)].remove(record)
            self._forget(record)
            if record.path.exists():
                record.path.replace(record.path.with_suffix(".corrupt"))
            return None
        self._records.move_to_end(record.path)
        return entry

    @locked
    def clear(self) -> int:
        """Delete every entry file; return how many there were."""
        records = list(self._records.values())
        for record in records:
            self._remove(record)
        return len(records)
