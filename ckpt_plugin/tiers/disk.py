"""The disk tier of the prompt cache: entries as files that survive restarts, their pages stored once.

Entries are written through when they enter the RAM cache (atomically, see :mod:`ckpt_plugin.persist`), indexed at
start-up from their headers, found by the same radix index as the RAM cache, and read when chosen: one pass of the
file into state buffers of the RAM cache's pool, validated there (:func:`~ckpt_plugin.persist.read_entry`). The file
is never mapped: a mapped file truncated from outside would kill the process with ``SIGBUS`` on the next restore.

A paged state (:mod:`ckpt_plugin.core.pages`) is written as its page map, and each of its pages as a file of the
page directory ``pages/`` (:class:`~ckpt_plugin.persist.page_files.PageFiles`) unless that page is on disk already:
a conversation's next turn writes the pages it added and its entry file, and conversations on one system prompt
share that prompt's page files. Reading an entry takes the pages this process holds live first and reads the rest,
so an entry read from disk shares its pages with everything in RAM. A page file is counted once in the budget and
deleted when the last entry file naming it goes; the start-up scan rebuilds the reference counts from the entry
files and deletes the page files none of them names.

The tier has its own byte budget; the least recently used files go first. A file that fails validation (at the
start-up scan or when read), or whose pages are missing or corrupt, is moved aside (``.corrupt``), counted in
:attr:`DiskTier.corrupt_files` and never loaded: a miss, never a wrong restore. :meth:`DiskTier.clear` forgets a
namespace (or everything): its files are deleted, and the page files no entry file names any more.

The directory belongs to one process: another process's tier would delete page files its entries need.
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
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.ram import locked
from ckpt_plugin.core.checkpoint import StateBufferPool
from ckpt_plugin.core.pages import PAGES, PagedState
from ckpt_plugin.core.errors import CheckpointError, CorruptFileError
from ckpt_plugin.policy.eviction import Chooser, evict_until
from ckpt_plugin.policy.plan import Hit
from ckpt_plugin.persist.page_files import PageFileError, PageFiles, page_file_size, sealing_available
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
PAGES_DIRECTORY = "pages"
"""The page files' directory, inside the tier's."""


@dataclass(eq=False)
class DiskRecord:
    """An entry on disk, known by its header (``_node`` is its place in the tier's radix index).

    :ivar size: The entry file's size.
    :ivar pages: The page files its paged states name: their sizes by page id.
    """

    path: pathlib.Path
    tokens: np.ndarray
    namespace: str
    fingerprint: str
    size: int
    pages: Mapping[bytes, int] = field(default_factory=dict, repr=False)
    _node: Any = field(default=None, repr=False)
    _refs: Mapping[bytes, int] = field(default_factory=dict, repr=False)  # the tier's counts of files naming a page

    @property
    def nbytes(self) -> int:
        """What evicting it frees: the entry file, and the page files no other entry file names."""
        return self.size + sum(size for page_id, size in self.pages.items() if self._refs.get(page_id, 0) <= 1)

    @property
    def n_tokens(self) -> int:
        """Tokens of the entry."""
        return len(self.tokens)


class DiskTier:
    """Prompt-cache entries in ``directory``, within ``max_bytes``.

    :param directory: Where the files live (created if missing); page files in its ``pages/``.
    :param max_bytes: Byte budget of the files, each page file counted once.
    :ivar corrupt_files: Files that failed validation since the tier was made (start-up scan and reads), entry
        files whose pages were missing or corrupt among them.
    :ivar bytes_written: Bytes written to entry and page files since the tier was made.
    :ivar pages_written: Page files written since the tier was made.
    :ivar paged: Whether paged states are written as page maps and page files (the ``xxhash`` package seals pages;
        without it every state is written whole).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._indexes: dict[tuple[str, str], RadixIndex[DiskRecord]] = {}
        self._records: OrderedDict[pathlib.Path, DiskRecord] = OrderedDict()
        self.page_files = PageFiles(self.directory / PAGES_DIRECTORY)
        self._page_refs: dict[bytes, int] = {}  # entry files naming each page
        self._page_sizes: dict[bytes, int] = {}  # the page files on disk (known good) and their sizes
        self.resident_bytes = 0
        self.corrupt_files = 0
        self.bytes_written = 0
        self.pages_written = 0
        self.paged = sealing_available()
        if not self.paged:
            log.warning("disk tier: the xxhash package is missing (a dependency of ckpt_plugin: reinstall it): states are "
                        "written whole, not as pages")
        # Several managers (threads) may share one tier; held for bookkeeping and one file write or read at a time.
        self._lock = threading.RLock()
        self._scan()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def page_bytes(self) -> int:
        """Bytes of the page files on disk (each once)."""
        return sum(self._page_sizes.values())

    def stats(self) -> dict[str, int]:
        """Entry and page files, bytes on disk and written, pages read and found live, corrupt files."""
        with self._lock:
            return {"entries": len(self._records), "resident_bytes": self.resident_bytes,
                    "page_files": len(self._page_sizes), "page_bytes": self.page_bytes,
                    "bytes_written": self.bytes_written, "pages_written": self.pages_written,
                    "pages_read": self.page_files.pages_read, "pages_held": self.page_files.pages_held,
                    "corrupt_files": self.corrupt_files}

    def _scan(self) -> None:
        # A writer killed mid-save leaves its temporary file; an hour old, it belongs to no live write.
        for stale in remove_stale_temp_files(self.directory) + self.page_files.remove_stale_temp_files():
            log.info("disk tier: removed %s, left by an interrupted write", stale.name)
        on_disk = self.page_files.listing()
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                header = read_header(path, with_pages=True)
            except CorruptFileError as exc:
                self._move_aside(path, f"is not a valid entry ({exc})")
                continue
            pages = {page_id: page_file_size(size) for page_id, size in header.pages.items()}
            lacking = sum(on_disk.get(page_id) != size for page_id, size in pages.items())
            if lacking:
                self._move_aside(path, f"names {lacking} page files that are missing or of another size")
                continue
            self._add(DiskRecord(path, header.tokens, header.namespace, header.fingerprint, header.file_size, pages,
                                 _refs=self._page_refs))
        self._page_sizes = {page_id: size for page_id, size in on_disk.items() if page_id in self._page_refs}
        self.resident_bytes += self.page_bytes
        garbage = [page_id for page_id in on_disk if page_id not in self._page_refs]
        for page_id in garbage:
            self.page_files.remove(page_id)
        if garbage:
            log.info("disk tier: deleted %d page files that no entry names", len(garbage))

    def _move_aside(self, path: pathlib.Path, why: str) -> None:
        log.warning("disk tier: %s %s; moved aside", path.name, why)
        self.corrupt_files += 1
        path.replace(path.with_suffix(CORRUPT_SUFFIX))

    def _add(self, record: DiskRecord) -> None:
        key = (record.namespace, record.fingerprint)
        index = self._indexes.get(key) or self._indexes.setdefault(key, RadixIndex())
        replaced = index.insert(record)
        for page_id in record.pages:
            self._page_refs[page_id] = self._page_refs.get(page_id, 0) + 1
        if replaced is not None:
            # Only a scan meets two files of the same tokens (a store of known tokens writes nothing); the pages
            # only the older one named are garbage the end of the scan deletes, once every file has been counted.
            self._forget(replaced)
        self._records[record.path] = record
        self.resident_bytes += record.size

    def _forget(self, record: DiskRecord) -> list[bytes]:
        """Stop counting ``record`` and its references; return the pages no entry file names any more."""
        if self._records.pop(record.path, None) is None:
            return []
        self.resident_bytes -= record.size
        unnamed = []
        for page_id in record.pages:
            left = self._page_refs[page_id] - 1
            if left:
                self._page_refs[page_id] = left
            else:
                del self._page_refs[page_id]
                unnamed.append(page_id)
        return unnamed

    def _delete_pages(self, page_ids: Iterable[bytes]) -> None:
        """Delete the files of ``page_ids`` (pages no entry file names, or found corrupt)."""
        for page_id in page_ids:
            size = self._page_sizes.pop(page_id, None)
            if size is not None:
                self.resident_bytes -= size
            self.page_files.remove(page_id)

    def _remove(self, record: DiskRecord) -> None:
        self._indexes[(record.namespace, record.fingerprint)].remove(record)
        unnamed = self._forget(record)
        record.path.unlink(missing_ok=True)
        self._delete_pages(unnamed)  # after the file naming them: a crash between leaves garbage, never a dangling name

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
        pages = self._pages_of(entry)
        try:
            self._write_pages(pages)
            size = write_entry(path, entry, model_fingerprint=entry.fingerprint, paged=self.paged)
        except BaseException as exc:
            # No entry file names the pages this call wrote: they go, whatever stopped the write.
            self._delete_pages(page_id for page_id in pages if page_id not in self._page_refs)
            if not isinstance(exc, OSError):
                raise
            log.warning("disk tier: could not write %s: %s", path.name, exc)
            return False
        self.bytes_written += size
        tokens = np.array(entry.tokens, dtype=np.int32)
        tokens.flags.writeable = False
        record = DiskRecord(path, tokens, entry.namespace, entry.fingerprint, size,
                            {page_id: page_file_size(page.nbytes) for page_id, page in pages.items()},
                            _refs=self._page_refs)
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

    def _pages_of(self, entry: CacheEntry) -> dict[bytes, np.ndarray]:
        """The pages of ``entry``'s paged states, by id (none when states are written whole)."""
        if not self.paged:
            return {}
        return {page_id: page for record in (entry.state, *entry.checkpoints)
                if isinstance(record.target, PagedState) for page_id, page in record.target.pages_by_id().items()}

    def _write_pages(self, pages: Mapping[bytes, np.ndarray]) -> None:
        """Write the pages that are not on disk yet, and make them durable before an entry file names them."""
        written = []
        for page_id, page in pages.items():
            if page_id in self._page_sizes:
                continue
            size = self.page_files.write(page_id, page)
            self._page_sizes[page_id] = size
            self.resident_bytes += size
            self.bytes_written += size
            self.pages_written += 1
            written.append(page_id)
        self.page_files.sync()
        PAGES.tier_stored("disk", written)  # the KV events announce them

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
        """Read ``record``'s file into buffers of ``pool`` (see :func:`~ckpt_plugin.persist.read_entry`), its pages
        taken live from this process where it holds them, else read from their files; ``None`` if it cannot be had
        now, and the record forgotten (the file moved aside and counted, if it or one of its pages no longer
        validates)."""
        try:
            entry = read_entry(record.path, expected_fingerprint=record.fingerprint, pool=pool,
                               pages=self.page_files)
        except PageFileError as exc:
            # The message, not the error: a log handler keeping the record would keep the traceback's frames, and
            # with them the pages read before this one, alive.
            log.warning("disk tier: dropping %s: %s", record.path.name, str(exc))
            self.corrupt_files += 1
            # The page file goes (deleted, never read again); the next entry holding that page writes it anew.
            self._delete_pages([exc.page_id])
            self._drop(record)
            return None
        except CheckpointError as exc:
            log.warning("disk tier: dropping %s: %s", record.path.name, exc)
            self.corrupt_files += 1
            self._drop(record)
            return None
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.ENOTSUP):
                # The file is fine; the memory (or the means to check a page) is short here. A miss; it stays.
                log.warning("disk tier: cannot read %s now: %s", record.path.name, exc)
                return None
            log.warning("disk tier: dropping %s: %s", record.path.name, exc)
            self._drop(record)
            return None
        self._records.move_to_end(record.path)
        return entry

    def _drop(self, record: DiskRecord) -> None:
        """Forget ``record``; its file, if any is left, is moved aside so that no later scan indexes it again."""
        self._indexes[(record.namespace, record.fingerprint)].remove(record)
        unnamed = self._forget(record)
        if record.path.exists():
            record.path.replace(record.path.with_suffix(CORRUPT_SUFFIX))
        self._delete_pages(unnamed)

    @locked
    def clear(self, namespace: str | None = None) -> int:
        """Delete every entry file (of ``namespace`` only, if given); return how many entry files went.

        The page files that no entry file of this tier names any more go with them. Besides the files this tier
        indexed, the directory's other entry files of that namespace go too (written
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
        # Pages of the files deleted here that this tier never indexed: their prompts must not outlive them either.
        self._delete_pages(page_id for page_id in self.page_files.listing() if page_id not in self._page_refs)
        self.page_files.prune()
        return removed

    @staticmethod
    def _namespace_of(path: pathlib.Path) -> str | None:
        """The namespace a file's header records (even a file that fails validation), or ``None``."""
        return read_recorded_namespace(path)
