"""Reading an entry: parsed field by field and validated (:mod:`ckpt_plugin.persist.parse`), into private memory
(:func:`read_entry`) or as views of bytes (:func:`decode_entry`); a header alone (:func:`read_header`)."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Callable

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint, StateBuffer, StateBufferPool, freeze
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.core.pages import PagedState
from ckpt_plugin.persist.layout import (
    EntryHeader,
    FILE_BLOB_REFS,
    FILE_PAGED,
    FIXED_HEADER,
    MAGIC,
    MAX_TEXT_BYTES,
    READ_VERSIONS,
    Record,
    TOKEN_DTYPE,
    U32,
)
from ckpt_plugin.persist.page_map import PageMap, decode_page_map
from ckpt_plugin.persist.parse import FileHeader, check_fingerprint, parse_header, parse_records, validate
from ckpt_plugin.persist.sources import FileSource, MappedSource, PrivateSource, Source, private_layout, read_fully

if TYPE_CHECKING:
    from ckpt_plugin.persist.page_files import PageFiles

__all__ = ["decode_entry", "read_entry", "read_header", "read_recorded_namespace"]


def open_regular(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Open ``path`` read-only; return ``(fd, size)``; refuse anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptFileError(f"{os.fspath(path)!r} is not a regular file", path=path)
        return fd, info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_entry(path: str | os.PathLike[str], *, expected_fingerprint: str | None = None,
               pool: StateBufferPool | None = None, pages: PageFiles | None = None) -> CacheEntry:
    """Read the file at ``path`` into private memory and return its entry, whose buffers are that memory.

    The structure is parsed from the file with bounded reads (magic, version, each length against the bytes left,
    the header digest, the fingerprint when ``expected_fingerprint`` is given); then the whole file is read once,
    each blob into a state buffer of its own from ``pool`` (the process's default pool if ``None``), and everything
    is validated again on those private bytes, the whole-file digest included: the entry holds exactly the bytes
    that were checked. Allocations are bounded by the file's real size, never by a length field.

    The file is never mapped, so nothing done to it later (truncated, rewritten, deleted) can fault the process or
    change the entry: a file that shrinks or changes while it is read is refused like any corrupt file.

    A paged record's target (a file of version 2.1 written with ``paged=True``) becomes a
    :class:`~ckpt_plugin.core.pages.PagedState` whose pages are taken live from ``pages.store`` where this process
    holds them, else read from ``pages`` (each checked against its digest) and put there.

    :param pool: Where the state buffers come from: pass the RAM cache's pool (``cache.pool``) so that the memory
        is recycled within its budget once the entry's buffers die.
    :param pages: The page directory of a file with paged records (the disk tier's); such a file is refused
        without it.
    :raises CorruptFileError: The file is malformed or changed while being read (message and ``offset`` say what
        and where); :class:`~ckpt_plugin.persist.page_files.PageFileError` for a page that is missing or corrupt.
    :raises IncompatibleStateError: The file's fingerprint is not ``expected_fingerprint``.
    :raises OSError: The file cannot be opened or read, or no memory could be had for it (``ENOMEM``).
    """
    fd, size = open_regular(path)
    try:
        source = FileSource(path, fd, size)
        # The layout first (a forged length is refused here, before anything is allocated for it).
        header = parse_header(source, FILE_PAGED)
        if header.flags & FILE_PAGED and pages is None:
            raise source.fail("its states are paged: only the disk tier that holds their pages reads it", 12)
        check_fingerprint(path, header.fingerprint, expected_fingerprint)
        records = parse_records(source, header)
        meta, blobs, segments = private_layout(size, records, pool)
        read_fully(source, [view for _, view in segments])
    finally:
        os.close(fd)
    private = PrivateSource(path, size, segments)
    checked = validate(private, expected_fingerprint, FILE_PAGED)
    if checked != (header, records):  # rewritten in place between the two reads: take neither
        raise private.fail("the file changed while being read", None)
    whole_meta = freeze(meta)
    # The header (tokens included) lies in the first meta segment, which starts at file offset 0 and meta offset 0.
    tokens = whole_meta[header.tokens_offset : header.tokens_offset + header.n_tokens * TOKEN_DTYPE.itemsize]
    frozen: dict[int, StateBuffer | PagedState] = {offset: freeze(buffer) for offset, buffer in blobs.items()}
    maps = _page_maps(private, records, lambda offset, length: blobs[offset])
    if maps:
        assert pages is not None  # a file with paged records was refused above without them
        frozen.update(pages.bind(maps, pool))
    return _entry_of(tokens, header, records,
                     lambda offset, length: frozen[offset] if length else _EMPTY_BLOB[:0])


def _page_maps(source: Source, records: list[Record],
               target: Callable[[int, int], bytes | np.ndarray]) -> dict[int, PageMap]:
    """The page maps of the paged records, by their target's offset (``target(offset, length)``: its bytes)."""
    maps = {}
    for index, record in enumerate(records):
        if record.paged:
            _, offset, length = record.blobs[0]
            maps[offset] = decode_page_map(target(offset, length), f"{os.fspath(source.path)!r}, record {index}")
    return maps


_EMPTY_BLOB = np.frombuffer(b"", dtype=np.uint8)
"""Empty blobs are views of this (each a new array object: buffers are told apart by identity)."""


def decode_entry(data: bytes, *, expected_fingerprint: str | None = None, blob_refs: bool = False,
                 label: str = "<bytes>") -> CacheEntry:
    """The entry that :func:`encode_entry` encoded into ``data``, validated as :func:`read_entry` validates a file;
    its buffers are read-only views into ``data`` (nothing is copied).

    :param blob_refs: The data must carry :data:`FILE_BLOB_REFS` (its blobs are references); without it such data
        is refused.
    :param label: Names the data in error messages (e.g. the key it was read from).
    :raises CorruptFileError: The data is malformed.
    :raises IncompatibleStateError: Its fingerprint is not ``expected_fingerprint``.
    """
    source = MappedSource(label, data)
    header, records = validate(source, expected_fingerprint, FILE_BLOB_REFS if blob_refs else 0)
    if blob_refs and not header.flags & FILE_BLOB_REFS:
        raise source.fail("blob references expected, found state bytes", 12)
    whole = np.frombuffer(data, dtype=np.uint8)
    whole.flags.writeable = False  # a bytearray would give writable views; states are shared read-only
    tokens = whole[header.tokens_offset : header.tokens_offset + header.n_tokens * TOKEN_DTYPE.itemsize]
    return _entry_of(tokens, header, records, lambda offset, length: whole[offset : offset + length])


def _entry_of(token_bytes: np.ndarray, header: FileHeader, records: list[Record],
              blob: Callable[[int, int], StateBuffer | PagedState]) -> CacheEntry:
    """The entry of validated bytes: ``token_bytes`` (read-only ``uint8``) and ``blob(offset, length)``, the
    read-only buffer of the blob at that file offset (or, for a paged record's target, its paged state); only views
    are made."""
    tokens = token_bytes.view(TOKEN_DTYPE)
    if not TOKEN_DTYPE.isnative:  # big-endian host: one small copy of the tokens
        tokens = tokens.astype(np.int32)
        tokens.flags.writeable = False
    states = []
    for record in records:
        (_, *target), *extras = record.blobs
        states.append(
            Checkpoint(
                n_tokens=record.n_tokens,
                pos_min=record.pos_min,
                pos_max=record.pos_max,
                partial=record.partial,
                target=blob(*target),
                fingerprint=header.fingerprint,
                extra={name: blob(offset, length) for name, offset, length in extras},
            )
        )
    return CacheEntry(tokens, states[0], tuple(states[1:]), header.namespace)


def read_header(path: str | os.PathLike[str], *, expected_fingerprint: str | None = None,
                with_pages: bool = False) -> EntryHeader:
    """Read and verify only the header of the file at ``path`` (for indexing a directory without mapping blobs).

    Checks the magic, version, lengths, the header digest and the trailer's framing (a truncated file is refused);
    the blobs and the whole-file digest are only checked by :func:`read_entry`.

    :param with_pages: Also read the page maps of a file with paged records (its :attr:`EntryHeader.pages`): then
        its records are parsed and the whole-file digest is checked too (such a file holds no state bytes but its
        extra states: it is small).
    :raises CorruptFileError: The header is malformed or the file truncated.
    :raises IncompatibleStateError: The file's fingerprint is not ``expected_fingerprint``.
    """
    fd, size = open_regular(path)
    try:
        source = FileSource(path, fd, size)
        header = parse_header(source, FILE_PAGED)
        check_fingerprint(path, header.fingerprint, expected_fingerprint)
        data = source.read(header.tokens_offset, header.n_tokens * TOKEN_DTYPE.itemsize)
        pages: dict[bytes, int] = {}
        if with_pages and header.flags & FILE_PAGED:
            _, records = validate(source, expected_fingerprint, FILE_PAGED)
            for page_map in _page_maps(source, records, source.read).values():
                pages.update(page_map.page_sizes)
    finally:
        os.close(fd)
    tokens = np.frombuffer(data, dtype=TOKEN_DTYPE)
    if not TOKEN_DTYPE.isnative:
        tokens = tokens.astype(np.int32)
        tokens.flags.writeable = False
    return EntryHeader(
        fingerprint=header.fingerprint,
        namespace=header.namespace,
        n_tokens=header.n_tokens,
        tokens=tokens,
        file_size=size,
        n_checkpoints=header.n_records - 1,
        version=header.version,
        pages=pages,
    )


def read_recorded_namespace(path: str | os.PathLike[str]) -> str | None:
    """The namespace the header of the file at ``path`` records, read without checking digests or the trailer;
    ``None`` if not even that much is readable.

    For attributing a file that failed validation (a truncated one, one moved aside as corrupt) to its tenant, e.g.
    to delete it when that tenant asks to be forgotten. Never use what it returns to load anything.
    """
    try:
        fd, size = open_regular(path)
    except (CorruptFileError, OSError):
        return None
    try:
        source = FileSource(path, fd, size)
        if size < FIXED_HEADER.size or source.read(0, len(MAGIC)) != MAGIC:
            return None
        _, major, _, _, _, fp_len = source.unpack(FIXED_HEADER, 0, size, "header")
        if major not in READ_VERSIONS or fp_len > MAX_TEXT_BYTES:
            return None
        offset = FIXED_HEADER.size + fp_len
        (ns_len,) = source.unpack(U32, offset, size, "namespace length")
        if ns_len > MAX_TEXT_BYTES:
            return None
        source.need(offset + U32.size, ns_len, size, "namespace")
        return source.read(offset + U32.size, ns_len).decode("utf-8")
    except (CorruptFileError, UnicodeDecodeError, OSError):
        return None
    finally:
        os.close(fd)
