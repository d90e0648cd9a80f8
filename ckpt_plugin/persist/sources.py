"""Bounded random access to an entry's bytes (in memory, read privately, or ``pread`` from a file), every
access checked against the bytes there are: a short or corrupt file raises :class:`CorruptFileError`."""

from __future__ import annotations
import bisect
import errno
import hashlib
import io
import os
import struct
from typing import Iterator
import numpy as np
from ckpt_plugin.core.checkpoint import StateBufferPool, allocate_state_buffer
from ckpt_plugin.core.errors import CorruptFileError

from ckpt_plugin.persist.layout import ALIGNMENT, DIGEST_SIZE, Record

__all__ = ["FileSource", "MappedSource", "PrivateSource", "Source", "private_layout", "read_fully"]

class Source:
    """Bounded random access to a file's bytes (in memory, or ``pread``s), raising :class:`CorruptFileError`."""

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        self.path = path
        self.size = size

    def fail(self, problem: str, offset: int | None) -> CorruptFileError:
        where = f" at offset {offset}" if offset is not None else ""
        return CorruptFileError(f"corrupt slot file {os.fspath(self.path)!r}: {problem}{where}", path=self.path,
                                offset=offset)

    def need(self, offset: int, n: int, limit: int, what: str) -> None:
        """Check that ``n`` bytes of ``what`` at ``offset`` end before ``limit`` (nothing is read)."""
        if n < 0 or offset + n > limit:
            left = max(0, limit - offset)
            raise self.fail(f"{what} needs {n} bytes but only {left} are left (up to {limit})", offset)

    def read(self, offset: int, n: int) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def hash(self, start: int, end: int) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def unpack(self, layout: struct.Struct, offset: int, limit: int, what: str) -> tuple:
        self.need(offset, layout.size, limit, what)
        return layout.unpack(self.read(offset, layout.size))


class MappedSource(Source):
    """Bytes already in memory (``decode_entry``'s data)."""

    def __init__(self, path: str | os.PathLike[str], mapping: bytes | bytearray | memoryview) -> None:
        super().__init__(path, len(mapping))
        self.mapping = mapping

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.mapping[offset : offset + n])

    def unpack(self, layout: struct.Struct, offset: int, limit: int, what: str) -> tuple:
        self.need(offset, layout.size, limit, what)
        return layout.unpack_from(self.mapping, offset)

    def hash(self, start: int, end: int) -> bytes:
        with memoryview(self.mapping) as view, view[start:end] as part:
            return hashlib.blake2b(part, digest_size=DIGEST_SIZE).digest()


class PrivateSource(Source):
    """A file's bytes as :func:`read_entry` read them into private memory: consecutive segments in file order (the
    blobs in their own buffers, the rest in between), so that validation sees exactly the bytes the entry will use."""

    def __init__(self, path: str | os.PathLike[str], size: int, segments: list[tuple[int, memoryview]]) -> None:
        super().__init__(path, size)
        kept = [(start, view) for start, view in segments if len(view)]  # empty blobs hold no byte to find
        self._starts = [start for start, _ in kept]
        self._views = [view for _, view in kept]

    def _pieces(self, start: int, end: int) -> Iterator[memoryview]:
        index = bisect.bisect_right(self._starts, start) - 1
        while start < end:
            base, view = self._starts[index], self._views[index]
            stop = min(end, base + len(view))
            yield view[start - base : stop - base]
            start, index = stop, index + 1

    def read(self, offset: int, n: int) -> bytes:
        # Callers check bounds first (need/unpack), so the pieces exist; a field may straddle two segments only
        # where a blob's neighbours meet, never inside a blob.
        return b"".join(self._pieces(offset, offset + n)) if n > 0 else b""

    def hash(self, start: int, end: int) -> bytes:
        hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
        for piece in self._pieces(start, end):
            hasher.update(piece)
        return hasher.digest()


class FileSource(Source):
    def __init__(self, path: str | os.PathLike[str], fd: int, size: int) -> None:
        super().__init__(path, size)
        self.fd = fd

    def read(self, offset: int, n: int) -> bytes:
        if hasattr(os, "pread"):
            data = os.pread(self.fd, n, offset)
        else:  # Windows
            os.lseek(self.fd, offset, os.SEEK_SET)
            data = os.read(self.fd, n)
        if len(data) != n:  # the file shrank under us
            raise self.fail(f"short read ({len(data)} of {n} bytes): the file changed while being read", offset)
        return data

    def hash(self, start: int, end: int) -> bytes:
        hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
        offset = start
        while offset < end:
            n = min(end - offset, 1 << 20)
            hasher.update(self.read(offset, n))
            offset += n
        return hasher.digest()


def aligned_buffer(n_bytes: int) -> np.ndarray:
    """A writable ``uint8`` array of ``n_bytes`` starting on an :data:`ALIGNMENT` boundary (as a file offset of 0
    is), so that the tokens keep the alignment the format gives them."""
    raw = np.empty(n_bytes + ALIGNMENT, dtype=np.uint8)
    shift = -raw.ctypes.data % ALIGNMENT
    return raw[shift : shift + n_bytes]


def private_layout(size: int, records: list[Record], pool: StateBufferPool | None
                    ) -> tuple[np.ndarray, dict[int, np.ndarray], list[tuple[int, memoryview]]]:
    """Private memory for a validated layout: a state buffer per non-empty blob (by file offset) and one aligned
    array for everything between blobs (header, record headers, padding, trailer); returns them and the ``(file
    offset, view)`` segments, in file order, that together cover the file's ``size`` bytes exactly."""
    blobs: dict[int, np.ndarray] = {}
    gaps: list[tuple[int, int]] = []
    position = 0
    try:
        for record in records:
            for _, offset, length in record.blobs:
                if length == 0:
                    continue
                gaps.append((position, offset))
                blobs[offset] = allocate_state_buffer(length, pool)
                position = offset + length
    except MemoryError as exc:
        raise OSError(errno.ENOMEM, f"no memory for a state of the file: {exc}") from exc
    gaps.append((position, size))
    meta = aligned_buffer(sum(end - start for start, end in gaps))
    meta_view = memoryview(meta)
    segments: list[tuple[int, memoryview]] = []
    used = 0
    for index, (start, end) in enumerate(gaps):
        segments.append((start, meta_view[used : used + end - start]))
        used += end - start
        if index < len(gaps) - 1:
            blob_offset = end
            segments.append((blob_offset, memoryview(blobs[blob_offset])))
    return meta, blobs, segments


_IOV_MAX = 1024
"""Buffers per vectored read: POSIX guarantees at least 16, Linux and the BSDs take 1024."""


def read_fully(source: FileSource, views: list[memoryview]) -> None:
    """Fill ``views`` with the file's bytes from offset 0, in order: one vectored read where the platform has
    ``preadv`` (a few for records by the thousand), else one ``readinto`` per view. A file shorter than the views
    (truncated since it was measured) is refused."""
    pending = [view for view in views if len(view)]
    offset = index = 0
    with io.FileIO(source.fd, "rb", closefd=False) as file:
        while index < len(pending):
            if hasattr(os, "preadv"):
                n = os.preadv(source.fd, pending[index : index + _IOV_MAX], offset)
            else:  # Windows, older macOS
                file.seek(offset)
                n = file.readinto(pending[index]) or 0
            if n <= 0:
                raise source.fail(f"short read (the file ends at {offset} of {source.size} bytes): it was truncated "
                                  "while being read", offset)
            offset += n
            while n and index < len(pending):  # a partial read leaves the rest of a view for the next call
                if n >= len(pending[index]):
                    n -= len(pending[index])
                    index += 1
                else:
                    pending[index] = pending[index][n:]
                    n = 0
