"""Pages stored as files, one per page id (the disk tier's page directory).

A page of a paged state (:mod:`ckpt_plugin.core.pages`) is stored once, whatever the number of entry files whose
page maps name it, as ``<directory>/<first 2 hex digits of its id>/<its id in hex>``: its bytes sealed with their
XXH3-128 digest (:func:`~ckpt_plugin.persist.page_map.seal_page`), written atomically like entry files (a temporary
file, ``fsync``, a rename). The id names what the bytes are (model, tenant, the tokens up to the page's end), so a
file of that name never needs rewriting; the digest checks that they were read back whole. 256 subdirectories keep
any one directory small: a long conversation's pages number in the thousands.

Reading takes a page live in this process's page store first (:data:`~ckpt_plugin.core.pages.PAGES`): an entry read
from disk shares its pages with every state in RAM that holds them, and only the pages nobody holds are read, each
into a state buffer of the given pool and put into the store (:func:`~ckpt_plugin.persist.page_map.open_page`).
What pages are on disk and who references them is the caller's bookkeeping (:class:`~ckpt_plugin.tiers.disk.DiskTier`).
"""

from __future__ import annotations

import errno
import os
import pathlib
import threading
from typing import Mapping

import numpy as np

from ckpt_plugin.core.checkpoint import StateBufferPool, allocate_state_buffer
from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.core.pages import PAGES, PagedState, PageStore
from ckpt_plugin.persist import page_map as _page_map
from ckpt_plugin.persist.page_map import PageMap, open_page, seal_page
from ckpt_plugin.persist.paths import remove_stale_temp_files
from ckpt_plugin.persist.read import open_regular
from ckpt_plugin.persist.sources import FileSource, read_fully
from ckpt_plugin.persist.write import fsync_directory, write_all, write_atomically

__all__ = ["PAGE_SEAL_BYTES", "PageFileError", "PageFiles", "page_file_size", "sealing_available"]

PAGE_SEAL_BYTES = 16
"""Bytes a page file holds besides the page: its digest."""
_ID_BYTES = 16
_HEX = frozenset("0123456789abcdef")


def page_file_size(page_bytes: int) -> int:
    """The size of the file of a page of ``page_bytes`` bytes."""
    return page_bytes + PAGE_SEAL_BYTES


def sealing_available() -> bool:
    """Whether pages can be sealed and checked here: the digest is XXH3-128, from the ``xxhash`` package (the
    ``redis`` extra)."""
    return _page_map.xxhash is not None


class PageFileError(CorruptFileError):
    """A page an entry file names is missing, or its file does not hold that page (truncated, corrupted).

    :ivar page_id: The page's id.
    """

    def __init__(self, message: str, page_id: bytes, path: pathlib.Path) -> None:
        super().__init__(message, path=path)
        self.page_id = page_id


class PageFiles:
    """The page files under ``directory`` (created with the first page written).

    :param store: The live pages a read takes first and puts what it reads into.
    :ivar pages_read: Pages read from their files (since this object was made).
    :ivar pages_held: Pages a read found live in ``store`` instead of reading them.
    """

    def __init__(self, directory: str | os.PathLike[str], store: PageStore = PAGES) -> None:
        self.directory = pathlib.Path(directory)
        self.store = store
        self.pages_read = 0
        self.pages_held = 0
        self._unsynced: set[pathlib.Path] = set()
        self._lock = threading.Lock()

    def path_of(self, page_id: bytes) -> pathlib.Path:
        """Where the page ``page_id`` names is stored."""
        name = page_id.hex()
        return self.directory / name[:2] / name

    # writing

    def write(self, page_id: bytes, page: np.ndarray) -> int:
        """Store ``page`` under ``page_id`` (atomically; the directory entry is made durable by :meth:`sync`);
        return the bytes written."""
        path = self.path_of(page_id)
        folder = path.parent
        if not folder.is_dir():
            created = [d for d in (self.directory, folder) if not d.is_dir()]
            folder.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._unsynced.update(d.parent for d in created)  # where the new folders' names are
        sealed = seal_page(page)
        written = write_atomically(path, lambda file: write_all(file, sealed), sync_directory=False)
        with self._lock:
            self._unsynced.add(folder)
        return written

    def sync(self) -> None:
        """Make the pages written since the last call durable under their names: ``fsync`` each directory they were
        renamed into, once. Call it before writing an entry file that names them."""
        with self._lock:
            folders, self._unsynced = self._unsynced, set()
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):  # a new folder before its parent
            fsync_directory(folder)

    def remove(self, page_id: bytes) -> None:
        """Delete the page's file, if there is one."""
        self.path_of(page_id).unlink(missing_ok=True)

    # reading

    def bind(self, maps: Mapping[int, PageMap], pool: StateBufferPool | None = None) -> dict[int, PagedState]:
        """The paged states of ``maps`` (by any key), their pages taken live from :attr:`store` where it holds
        them, else read from their files into buffers of ``pool``; each page read once however many maps name it.

        :raises PageFileError: A page is missing, or its file does not hold it.
        :raises OSError: A file cannot be read, or no memory could be had for it (``ENOMEM``); ``ENOTSUP`` where
            pages cannot be checked here (see :func:`sealing_available`).
        """
        sizes = {page_id: size for page_map in maps.values() for page_id, size in page_map.page_sizes.items()}
        pages = {}
        for page_id, size in sizes.items():
            page = self.store.get(page_id)
            if page is not None and page.nbytes == size:
                self.pages_held += 1
            else:
                page = self.read(page_id, size, pool)
                self.pages_read += 1
            pages[page_id] = page
        return {key: page_map.bind(pages) for key, page_map in maps.items()}

    def read(self, page_id: bytes, size: int, pool: StateBufferPool | None = None) -> np.ndarray:
        """The page ``page_id`` names, of ``size`` bytes, read from its file and put into :attr:`store` (or the live
        page of that id, if another read put one there meanwhile).

        :raises PageFileError: The file is missing or does not hold that page.
        :raises OSError: As :meth:`bind`.
        """
        if not sealing_available():
            raise OSError(errno.ENOTSUP, "reading page files needs the xxhash package (a dependency of ckpt_plugin)")
        path = self.path_of(page_id)
        try:
            fd, file_size = open_regular(path)
        except FileNotFoundError:
            raise PageFileError(f"page file {str(path)!r} is missing", page_id, path) from None
        except CorruptFileError as exc:
            raise PageFileError(str(exc), page_id, path) from None
        try:
            if file_size != page_file_size(size):
                raise PageFileError(f"page file {str(path)!r} is {file_size} bytes, not the {page_file_size(size)} "
                                    "its page map names", page_id, path)
            try:
                buffer = allocate_state_buffer(file_size, pool)
            except MemoryError as exc:
                raise OSError(errno.ENOMEM, f"no memory for a page: {exc}") from exc
            try:
                read_fully(FileSource(path, fd, file_size), [memoryview(buffer)])
            except CorruptFileError as exc:
                raise PageFileError(str(exc), page_id, path) from None
        finally:
            os.close(fd)
        try:
            page = open_page(memoryview(buffer), page_id, size, self.store, str(path))
        except CorruptFileError as exc:
            raise PageFileError(str(exc), page_id, path) from None
        if page.nbytes != size:  # a live page of that id but another size: the page map is not what wrote it
            raise PageFileError(f"page {page_id.hex()} is live with {page.nbytes} bytes, not {size}", page_id, path)
        return page

    # the directory as a whole

    def listing(self) -> dict[bytes, int]:
        """Every page file under the directory: its page id and its size (names that are not a page's are left
        alone)."""
        found: dict[bytes, int] = {}
        for folder in self._folders():
            with os.scandir(folder) as items:
                for item in items:
                    name = item.name
                    if len(name) != 2 * _ID_BYTES or not _HEX.issuperset(name) or name[:2] != folder.name:
                        continue
                    try:
                        if item.is_file(follow_symlinks=False):
                            found[bytes.fromhex(name)] = item.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        return found

    def remove_stale_temp_files(self) -> list[pathlib.Path]:
        """Delete temporary files that interrupted page writes left (see
        :func:`~ckpt_plugin.persist.remove_stale_temp_files`); return them."""
        removed = []
        for folder in self._folders():
            removed += remove_stale_temp_files(folder)
        return removed

    def prune(self) -> None:
        """Remove the folders no page file is left in (the directory itself too, if it is empty then)."""
        for folder in [*self._folders(), self.directory]:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): it stays
                continue

    def _folders(self) -> list[pathlib.Path]:
        if not self.directory.is_dir():
            return []
        with os.scandir(self.directory) as items:
            return [pathlib.Path(item.path) for item in items
                    if len(item.name) == 2 and _HEX.issuperset(item.name) and item.is_dir(follow_symlinks=False)]

