"""The versioned on-disk format of slot files and disk-tier cache entries (see ``docs/persistence-format.md``).

A file holds one :class:`~ckpt_plugin.tiers.ram.CacheEntry`: the model fingerprint, the namespace, the tokens, the full
state and the checkpoints of its lineage, each state record with its target blob and its extra states, each a blob
stored with its name (a draft model's, a speculative decoder's, any plugin's). Blob payloads start on 64-byte
boundaries. Files of version 1.0, whose records had a draft and a speculative blob in fixed places, are still read.

:func:`read_entry` reads the file once, in one pass, into private anonymous memory: each blob straight into a state
buffer of its own (from a :class:`~ckpt_plugin.core.checkpoint.StateBufferPool`), the rest into one small buffer; then
validates those bytes and returns an entry whose buffers are that memory, frozen read-only. It never maps the file:
pages of a mapped file that shrinks under the mapping (truncated by another process, an operator, a full disk) raise
``SIGBUS`` on the next access, which would kill the whole server in the middle of a restore. Reading costs little
more than mapping did, since the digest check reads every byte once either way (+17% on a 22 MB entry with recycled
buffers, ``docs/persistence-format.md``), and a buffer of its own per blob lets the RAM cache count, keep and free
each state like any capture.

Safety rules (DESIGN.md section 5):

- nothing is unpickled; the file is parsed field by field and every length is checked against the bytes left before
  anything is sliced or allocated, so allocations are bounded by the file's real size, never by a length field;
- a BLAKE2b digest in the header covers the header, one in the trailer covers everything before it; truncation and
  corruption raise :class:`CorruptFileError` (with the offset), never an ``IndexError``/``struct.error``/...;
- the fingerprint is checked: another model's state raises :class:`~ckpt_plugin.core.errors.IncompatibleStateError`;
- writes are atomic (temporary file in the same directory, ``fsync``, ``os.replace``, directory ``fsync``): a crash
  mid-write leaves the earlier file intact; an entry read is private memory, independent of its file afterwards;
- client-supplied file names go through :func:`safe_path` (plain names only, no symlink escape).
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import os
import re
import stat
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import (
    DRAFT,
    SPECULATIVE,
    TARGET,
    Checkpoint,
    StateBufferPool,
    allocate_state_buffer,
    check_extra_name,
    freeze,
)
from ckpt_plugin.core.errors import CorruptFileError, IncompatibleStateError, UnsafePathError

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_EXTRAS",
    "MAX_RECORDS",
    "READ_VERSIONS",
    "CorruptFileError",
    "EntryHeader",
    "FILE_BLOB_REFS",
    "UnsafePathError",
    "iter_entry_files",
    "decode_entry",
    "encode_entry",
    "read_entry",
    "read_header",
    "read_recorded_namespace",
    "remove_stale_temp_files",
    "safe_path",
    "write_entry",
]

MAGIC = b"CKPTSLOT"
"""First 8 bytes of every file."""
END_MAGIC = b"CKPT_END"
"""Last 8 bytes of every completely written file."""
FORMAT_VERSION = (2, 0)
"""(major, minor) written by this module. Readers refuse a major version they do not know (this one reads 1 and 2);
minor versions only add optional file flags (bits 16-31), which older readers ignore. Required flags (bits 0-15)
mark data a reader must not take for an ordinary file; a reader refuses every one it does not know."""
READ_VERSIONS = (1, 2)
"""Major versions this module reads: 1.x (draft and speculative blobs in fixed places of each record) and 2.x
(extra states as named blob records)."""
ALIGNMENT = 64
"""Tokens, records and blob payloads start at multiples of this offset (and so of the mapping's address)."""
MAX_TEXT_BYTES = 4096
"""Largest fingerprint or namespace, in UTF-8 bytes."""
MAX_RECORDS = 4096
"""Most state records in a file (the full state plus checkpoints); bounds the reader's per-record object overhead."""
MAX_EXTRAS = 64
"""Most extra states of one state record (version 2)."""
MAX_NAME_BYTES = 48
"""Longest extra state name (the name field of an extra record, see :data:`~ckpt_plugin.core.checkpoint.EXTRA_NAME`)."""
DIGEST_SIZE = 32
"""BLAKE2b digest size of the header and of the whole file."""
TEMP_PREFIX = ".ckpt-tmp-"
"""Prefix of the temporary files of atomic writes (a dot name: never a valid entry name, see :func:`safe_path`)."""
CHUNK_SIZE = 8 << 20
"""Blobs are written (and hashed) in chunks of this many bytes."""

# Fixed part of the header: magic, major, minor, flags, n_records, fingerprint length.
_FIXED = struct.Struct("<8sHHIII")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Version 2: a state record's header: kind, flags, n_tokens, pos_min, pos_max, target length, extra records, reserved.
_STATE = struct.Struct("<4sIqqqQI20s")
# Version 2: an extra record's header: kind, name length, blob length, name (zero-padded).
_EXTRA = struct.Struct(f"<4sIQ{MAX_NAME_BYTES}s")
STATE_KIND = b"STAT"
"""Kind of a state record (version 2): a checkpoint or the full state, with its target blob."""
EXTRA_KIND = b"XTRA"
"""Kind of an extra record (version 2): one named extra state of the state record before it."""
# Version 1: a state record's header: n_tokens, pos_min, pos_max, flags, reserved, 3 blob lengths, reserved.
_RECORD_V1 = struct.Struct("<qqqIIQQQQ")
# Trailer: offset of the trailer (= bytes before it), digest of those bytes, end magic.
_TRAILER = struct.Struct(f"<Q{DIGEST_SIZE}s8s")
assert _STATE.size == _EXTRA.size == _RECORD_V1.size == ALIGNMENT

FILE_FLAGS_REQUIRED = 0x0000FFFF
"""File flag bits a reader must understand."""
FILE_BLOB_REFS = 1 << 0
"""Required file flag: every blob payload is a reference to state bytes stored elsewhere, not the bytes (the
shared tier's manifests); only :func:`decode_entry` with ``blob_refs=True`` reads such data."""
REC_PARTIAL = 1 << 0
"""Record flag (both versions): the state is partial."""
# Version 1 record flags: which of the three fixed blobs are present.
REC_TARGET = 1 << 1
REC_DRAFT = 1 << 2
REC_SPECULATIVE = 1 << 3
_REC_KNOWN_V1 = REC_PARTIAL | REC_TARGET | REC_DRAFT | REC_SPECULATIVE
_BLOBS_V1 = ((TARGET, REC_TARGET), (DRAFT, REC_DRAFT), (SPECULATIVE, REC_SPECULATIVE))

_TOKEN_DTYPE = np.dtype("<i4")
_INT32 = np.iinfo(np.int32)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
MIN_FILE_SIZE = 2 * ALIGNMENT + _STATE.size + _TRAILER.size
"""Smallest well-formed file: one record with empty blobs, no tokens, empty strings."""


@dataclass(frozen=True)
class EntryHeader:
    """What :func:`read_header` reads: enough to index a file without mapping its blobs.

    :ivar fingerprint: The model/context fingerprint the states belong to.
    :ivar namespace: The tenant partition.
    :ivar n_tokens: Tokens the full state holds.
    :ivar tokens: Read-only ``int32`` token ids.
    :ivar file_size: Size of the file in bytes.
    :ivar n_checkpoints: Checkpoints stored besides the full state.
    :ivar version: ``(major, minor)`` format version of the file.
    """

    fingerprint: str
    namespace: str
    n_tokens: int
    tokens: np.ndarray
    file_size: int
    n_checkpoints: int
    version: tuple[int, int]


def _pad(n: int) -> int:
    """Bytes of padding after ``n`` bytes to reach the next multiple of :data:`ALIGNMENT`."""
    return -n % ALIGNMENT


_ZEROS = bytes(ALIGNMENT)

# ---------------------------------------------------------------------------------------------------------------------
# writing


def _write_chunk(file: BinaryIO, chunk: memoryview) -> int:
    """Write part of ``chunk`` (one ``write`` call); return the bytes written. The single place data hits the file."""
    written = file.write(chunk)
    if written is None:  # a non-blocking raw file would return None; ours never is
        raise OSError(errno.EAGAIN, "write would block")
    return written


def _emit(file: BinaryIO, hashers: tuple, data: bytes | memoryview) -> int:
    """Write ``data`` in chunks without copying it, feeding each chunk to ``hashers``; return its length."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    total = len(view)
    offset = 0
    while offset < total:
        chunk = view[offset : offset + CHUNK_SIZE]
        for hasher in hashers:
            hasher.update(chunk)
        done = 0
        while done < len(chunk):
            done += _write_chunk(file, chunk[done:])
        offset += len(chunk)
    return total


def _check_blob(name: str, buffer: np.ndarray) -> memoryview:
    if not isinstance(buffer, np.ndarray) or buffer.dtype != np.uint8 or buffer.ndim != 1:
        raise ValueError(f"state blob {name} must be a one-dimensional uint8 array")
    if not buffer.flags.c_contiguous:
        raise ValueError(f"state blob {name} must be C-contiguous")
    return memoryview(buffer)


def _encode_text(what: str, text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > MAX_TEXT_BYTES:
        raise ValueError(f"{what} is {len(data)} UTF-8 bytes, more than the {MAX_TEXT_BYTES} the format allows")
    return data


def _encode_name(name: str) -> bytes:
    """An extra state's name as stored (ASCII, at most :data:`MAX_NAME_BYTES`)."""
    return check_extra_name(name).encode("ascii")


def _tokens_for_disk(tokens: np.ndarray) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype != _TOKEN_DTYPE:
        if array.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
        if int(array.min()) < _INT32.min or int(array.max()) > _INT32.max:
            raise ValueError("token ids must fit in int32")
    return np.ascontiguousarray(array, dtype=_TOKEN_DTYPE)


def _fsync_directory(directory: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:
        if sys.platform == "win32":  # directories cannot be opened (nor need syncing) there
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_entry(path: str | os.PathLike[str], entry: CacheEntry, *, model_fingerprint: str) -> int:
    """Write ``entry`` to ``path`` atomically; return the bytes written (the file's size).

    The data goes to a temporary file in the same directory (named ``.ckpt-tmp-*.tmp``), is flushed and
    ``fsync``-ed, then renamed onto ``path`` and the directory is ``fsync``-ed: a crash at any point leaves either the
    earlier file or the new one, both complete. State bytes are written from the buffers themselves, in chunks of
    :data:`CHUNK_SIZE`, never copied. The file is created with mode ``0600``.

    :param path: Destination. Pass a client-supplied name through :func:`safe_path` first.
    :param entry: The entry; its state and checkpoints must all belong to ``model_fingerprint``.
    :param model_fingerprint: The fingerprint of the model/context the states were captured on.
    :raises IncompatibleStateError: A state of the entry belongs to another fingerprint.
    :raises ValueError: The entry cannot be represented (non-uint8 blobs, oversized strings, too many records...).
    :raises OSError: Writing failed; nothing was replaced and the temporary file was removed.
    """
    path = Path(path)
    # Validate every record before creating any file.
    parts = _entry_parts(entry, model_fingerprint, 0)
    directory = path.parent
    temp = tempfile.NamedTemporaryFile(dir=directory, prefix=TEMP_PREFIX, suffix=".tmp", delete=False, buffering=0)
    try:
        with temp as file:
            written = _emit_parts(file, parts)
            file.flush()  # unbuffered: a no-op today, kept so a buffered file would still be complete before fsync
            os.fsync(file.fileno())
        os.replace(temp.name, path)
    except BaseException:
        try:
            os.unlink(temp.name)
        except OSError:
            pass
        raise
    _fsync_directory(directory)
    return written


def encode_entry(entry: CacheEntry, *, model_fingerprint: str, blob_refs: bool = False) -> bytes:
    """``entry`` in the file format, as bytes (what :func:`write_entry` would write).

    :param blob_refs: Set :data:`FILE_BLOB_REFS`: the entry's blobs are references to state bytes stored elsewhere
        (the shared tier's manifests, see :mod:`ckpt_plugin.tiers.shared.format`), not the state bytes themselves.
    :raises IncompatibleStateError: A state of the entry belongs to another fingerprint.
    :raises ValueError: The entry cannot be represented.
    """
    out = io.BytesIO()
    _emit_parts(out, _entry_parts(entry, model_fingerprint, FILE_BLOB_REFS if blob_refs else 0))
    return out.getvalue()


def _entry_parts(entry: CacheEntry, model_fingerprint: str, file_flags: int) -> list[bytes | memoryview]:
    """Everything before the trailer, in order, after validating the whole entry (state bytes as views)."""
    records: list[Checkpoint] = [entry.state, *entry.checkpoints]
    for record in records:
        if record.fingerprint != model_fingerprint:
            raise IncompatibleStateError(
                f"refusing to write a state of model/context {record.fingerprint!r} as {model_fingerprint!r}"
            )
    if len(records) > MAX_RECORDS:
        raise ValueError(f"{len(records)} state records exceed the format's limit of {MAX_RECORDS}")
    tokens = _tokens_for_disk(entry.tokens)
    n_tokens = len(tokens)
    if entry.state.n_tokens != n_tokens:
        raise ValueError(f"the full state holds {entry.state.n_tokens} tokens but the entry has {n_tokens}")
    fingerprint = _encode_text("fingerprint", model_fingerprint)
    namespace = _encode_text("namespace", entry.namespace)

    # (record or extra header, its blob), in file order
    encoded: list[tuple[bytes, memoryview]] = []
    for index, record in enumerate(records):
        if not 0 <= record.n_tokens <= n_tokens:
            raise ValueError(f"record {index} holds {record.n_tokens} tokens, outside 0..{n_tokens}")
        if record.pos_min < -1 or record.pos_max < -1:
            raise ValueError(f"record {index} has negative positions ({record.pos_min}, {record.pos_max})")
        extras = sorted(record.extra.items())  # name order: one entry, one encoding
        if len(extras) > MAX_EXTRAS:
            raise ValueError(f"record {index} has {len(extras)} extra states, more than the format's {MAX_EXTRAS}")
        target = _check_blob(f"target of record {index}", record.target)
        flags = REC_PARTIAL if record.partial else 0
        encoded.append((_STATE.pack(STATE_KIND, flags, record.n_tokens, record.pos_min, record.pos_max,
                                    target.nbytes, len(extras), bytes(20)), target))
        for name, buffer in extras:
            encoded_name = _encode_name(name).ljust(MAX_NAME_BYTES, b"\0")
            view = _check_blob(f"{name} of record {index}", buffer)
            encoded.append((_EXTRA.pack(EXTRA_KIND, len(name), view.nbytes, encoded_name), view))

    major, minor = FORMAT_VERSION
    prefix = bytearray(_FIXED.pack(MAGIC, major, minor, file_flags, len(records), len(fingerprint)))
    prefix += fingerprint + _U32.pack(len(namespace)) + namespace + _U64.pack(n_tokens)
    prefix += bytes(_pad(len(prefix)))
    token_view = memoryview(tokens).cast("B")
    header_digest = hashlib.blake2b(prefix, digest_size=DIGEST_SIZE)
    header_digest.update(token_view)
    header_end = len(prefix) + token_view.nbytes + DIGEST_SIZE
    parts: list[bytes | memoryview] = [prefix, token_view, header_digest.digest(), _ZEROS[: _pad(header_end)]]
    for head, view in encoded:
        parts += [head, view, _ZEROS[: _pad(view.nbytes)]]
    return parts


def _emit_parts(file: BinaryIO, parts: list[bytes | memoryview]) -> int:
    """Write ``parts`` and the trailer (the digest of everything before it); return the bytes written."""
    whole = hashlib.blake2b(digest_size=DIGEST_SIZE)
    written = 0
    for part in parts:
        written += _emit(file, (whole,), part)
    return written + _emit(file, (), _TRAILER.pack(written, whole.digest(), END_MAGIC))


# ---------------------------------------------------------------------------------------------------------------------
# reading


class _Source:
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


class _MappedSource(_Source):
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


class _PrivateSource(_Source):
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


class _FileSource(_Source):
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


@dataclass
class _Header:
    version: tuple[int, int]
    flags: int
    n_records: int
    fingerprint: str
    namespace: str
    n_tokens: int
    tokens_offset: int
    records_offset: int
    body_end: int


def _decode_text(source: _Source, data: bytes, offset: int, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise source.fail(f"{what} is not valid UTF-8 ({exc.reason})", offset + exc.start) from None


def _check_zero(source: _Source, offset: int, n: int, limit: int, what: str) -> None:
    if n:
        source.need(offset, n, limit, what)
        data = source.read(offset, n)
        if data.count(0) != n:
            raise source.fail(f"{what} is not zero", offset + next(i for i, b in enumerate(data) if b))


def _parse_header(source: _Source, known_flags: int = 0) -> _Header:
    """Parse and verify everything up to the first record, and the trailer's framing (not its digest).

    :param known_flags: Required file flags the caller reads (any other required flag is refused).
    """
    size = source.size
    if size >= len(MAGIC) and source.read(0, len(MAGIC)) != MAGIC:
        raise source.fail("not a slot file (bad magic)", 0)
    if size < MIN_FILE_SIZE:
        raise source.fail(f"file is {size} bytes, shorter than the smallest slot file ({MIN_FILE_SIZE} bytes)",
                          None if size < len(MAGIC) else size)
    _, major, minor, flags, n_records, fp_len = source.unpack(_FIXED, 0, size, "header")
    if major not in READ_VERSIONS:
        readable = " and ".join(f"{known}.x" for known in READ_VERSIONS)
        raise source.fail(f"unsupported format version {major}.{minor} (this reader reads {readable})", 8)
    if flags & FILE_FLAGS_REQUIRED & ~known_flags:
        raise source.fail(f"unknown required file flags {flags & FILE_FLAGS_REQUIRED & ~known_flags:#06x}", 12)
    body_end = size - _TRAILER.size
    trailer_offset, _, end_magic = source.unpack(_TRAILER, body_end, size, "trailer")
    if end_magic != END_MAGIC:
        raise source.fail("end marker missing: the file is truncated or was not completely written", size - 8)
    if trailer_offset != body_end:
        raise source.fail(f"trailer records {trailer_offset} bytes of data but the file holds {body_end}", body_end)
    if not 1 <= n_records <= MAX_RECORDS:
        raise source.fail(f"record count {n_records} outside 1..{MAX_RECORDS}", 16)
    offset = _FIXED.size
    if fp_len > MAX_TEXT_BYTES:
        raise source.fail(f"fingerprint length {fp_len} exceeds {MAX_TEXT_BYTES}", 20)
    source.need(offset, fp_len, body_end, "fingerprint")
    fingerprint = _decode_text(source, source.read(offset, fp_len), offset, "fingerprint")
    offset += fp_len
    (ns_len,) = source.unpack(_U32, offset, body_end, "namespace length")
    if ns_len > MAX_TEXT_BYTES:
        raise source.fail(f"namespace length {ns_len} exceeds {MAX_TEXT_BYTES}", offset)
    offset += _U32.size
    source.need(offset, ns_len, body_end, "namespace")
    namespace = _decode_text(source, source.read(offset, ns_len), offset, "namespace")
    offset += ns_len
    n_tokens_offset = offset
    (n_tokens,) = source.unpack(_U64, offset, body_end, "token count")
    offset += _U64.size
    _check_zero(source, offset, _pad(offset), body_end, "header padding")
    offset += _pad(offset)
    tokens_offset = offset
    if n_tokens > (body_end - offset) // _TOKEN_DTYPE.itemsize:
        raise source.fail(
            f"token count {n_tokens} needs {n_tokens * _TOKEN_DTYPE.itemsize} bytes but only "
            f"{max(0, body_end - offset)} are left",
            n_tokens_offset,
        )
    offset += n_tokens * _TOKEN_DTYPE.itemsize
    source.need(offset, DIGEST_SIZE, body_end, "header digest")
    if source.read(offset, DIGEST_SIZE) != source.hash(0, offset):
        raise source.fail("header digest mismatch (the header is corrupted)", offset)
    offset += DIGEST_SIZE
    _check_zero(source, offset, _pad(offset), body_end, "header padding")
    offset += _pad(offset)
    return _Header((major, minor), flags, n_records, fingerprint, namespace, n_tokens, tokens_offset, offset, body_end)


def _check_fingerprint(path: str | os.PathLike[str], found: str, expected: str | None) -> None:
    if expected is not None and found != expected:
        raise IncompatibleStateError(
            f"slot file {os.fspath(path)!r} holds state of model/context {found!r}, "
            f"but {expected!r} was expected; refusing to load it"
        )


def _open_regular(path: str | os.PathLike[str]) -> tuple[int, int]:
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


# (offset after the record, n_tokens, pos_min, pos_max, partial, [(name, offset, length) per blob, the target first])
_Record = tuple[int, int, int, int, bool, list[tuple[str, int, int]]]


def _parse_records(source: _Source, header: _Header) -> list[_Record]:
    """The state records of a file of either version, each with its blobs, checked to end exactly at the trailer."""
    parse = _parse_state_v1 if header.version[0] == 1 else _parse_state
    records: list[_Record] = []
    offset, end = header.records_offset, header.body_end
    for index in range(header.n_records):
        record = parse(source, header, index, offset)
        records.append(record)
        offset = record[0]
    if offset != end:
        raise source.fail(f"{end - offset} unexpected bytes after the last record", offset)
    return records


def _check_state(source: _Source, header: _Header, index: int, offset: int, n_tokens: int, pos_min: int,
                 pos_max: int) -> None:
    """What both versions require of a state record's counts (``offset``: where its token count is)."""
    what = f"record {index}"
    if not 0 <= n_tokens <= header.n_tokens or (index == 0 and n_tokens != header.n_tokens):
        raise source.fail(f"{what} holds {n_tokens} tokens, inconsistent with the entry's {header.n_tokens}", offset)
    if pos_min < -1 or pos_max < -1:
        raise source.fail(f"{what} has invalid positions ({pos_min}, {pos_max})", offset + 8)


def _blob(source: _Source, what: str, offset: int, length: int, length_offset: int, end: int) -> int:
    """Check a blob of ``length`` bytes at ``offset`` and its zero padding; return the offset after them."""
    if length > end - offset:
        raise source.fail(f"{what} blob length {length} exceeds the {max(0, end - offset)} bytes left", length_offset)
    offset += length
    _check_zero(source, offset, _pad(offset), end, f"{what} padding")
    return offset + _pad(offset)


def _parse_state(source: _Source, header: _Header, index: int, offset: int) -> _Record:
    """A version 2 state record at ``offset``: its header, its target blob, then its extra records."""
    what, end = f"record {index}", header.body_end
    kind, flags, n_tokens, pos_min, pos_max, length, n_extras, reserved = source.unpack(_STATE, offset, end, what)
    if kind != STATE_KIND:
        raise source.fail(f"{what} is not a state record (kind {kind!r})", offset)
    if flags & ~REC_PARTIAL:
        raise source.fail(f"{what} has unknown flags {flags & ~REC_PARTIAL:#x}", offset + 4)
    if reserved.count(0) != len(reserved):
        raise source.fail(f"{what} has non-zero reserved fields", offset + 44)
    _check_state(source, header, index, offset + 8, n_tokens, pos_min, pos_max)
    if n_extras > MAX_EXTRAS:
        raise source.fail(f"{what} names {n_extras} extra states, more than {MAX_EXTRAS}", offset + 40)
    start = offset + _STATE.size
    blobs = [(TARGET, start, length)]
    offset = _blob(source, f"{what} target", start, length, offset + 32, end)
    previous = b""
    for number in range(n_extras):
        extra = f"{what} extra {number}"
        kind, name_length, length, name = source.unpack(_EXTRA, offset, end, extra)
        if kind != EXTRA_KIND:
            raise source.fail(f"{extra} is not an extra record (kind {kind!r})", offset)
        if not 1 <= name_length <= MAX_NAME_BYTES or name[name_length:].count(0) != MAX_NAME_BYTES - name_length:
            raise source.fail(f"{extra} has a malformed name (length {name_length})", offset + 4)
        name = name[:name_length]
        if not _valid_name(name):
            raise source.fail(f"{extra} has an invalid name {name!r}", offset + 16)
        if name <= previous:  # strictly ascending: no name twice, and one entry has one encoding
            raise source.fail(f"{extra} name {name.decode()!r} is out of order or repeated", offset + 16)
        previous = name
        blobs.append((name.decode("ascii"), offset + _EXTRA.size, length))
        offset = _blob(source, f"{extra} ({name.decode()})", offset + _EXTRA.size, length, offset + 8, end)
    return offset, n_tokens, pos_min, pos_max, bool(flags & REC_PARTIAL), blobs


def _valid_name(name: bytes) -> bool:
    try:
        check_extra_name(name.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def _parse_state_v1(source: _Source, header: _Header, index: int, offset: int) -> _Record:
    """A version 1 state record at ``offset``: target, draft and speculative blobs in fixed places."""
    what, end = f"record {index}", header.body_end
    n_tokens, pos_min, pos_max, flags, reserved, *lengths, reserved2 = source.unpack(_RECORD_V1, offset, end, what)
    if flags & ~_REC_KNOWN_V1:
        raise source.fail(f"{what} has unknown flags {flags & ~_REC_KNOWN_V1:#x}", offset + 24)
    if reserved or reserved2:
        raise source.fail(f"{what} has non-zero reserved fields", offset)
    if not flags & REC_TARGET:
        raise source.fail(f"{what} has no target state", offset + 24)
    _check_state(source, header, index, offset, n_tokens, pos_min, pos_max)
    blobs: list[tuple[str, int, int]] = []
    length_offset = offset + 32
    offset += _RECORD_V1.size
    for (name, bit), length in zip(_BLOBS_V1, lengths):
        if not flags & bit:
            if length:
                raise source.fail(f"{what} has a length for its absent {name} blob", length_offset)
        else:
            blobs.append((name, offset, length))
            offset = _blob(source, f"{what} {name}", offset, length, length_offset, end)
        length_offset += 8
    return offset, n_tokens, pos_min, pos_max, bool(flags & REC_PARTIAL), blobs


def read_entry(path: str | os.PathLike[str], *, expected_fingerprint: str | None = None,
               pool: StateBufferPool | None = None) -> CacheEntry:
    """Read the file at ``path`` into private memory and return its entry, whose buffers are that memory.

    The structure is parsed from the file with bounded reads (magic, version, each length against the bytes left,
    the header digest, the fingerprint when ``expected_fingerprint`` is given); then the whole file is read once,
    each blob into a state buffer of its own from ``pool`` (the process's default pool if ``None``), and everything
    is validated again on those private bytes, the whole-file digest included: the entry holds exactly the bytes
    that were checked. Allocations are bounded by the file's real size, never by a length field.

    The file is never mapped, so nothing done to it later (truncated, rewritten, deleted) can fault the process or
    change the entry: a file that shrinks or changes while it is read is refused like any corrupt file.

    :param pool: Where the state buffers come from: pass the RAM cache's pool (``cache.pool``) so that the memory
        is recycled within its budget once the entry's buffers die.
    :raises CorruptFileError: The file is malformed or changed while being read (message and ``offset`` say what
        and where).
    :raises IncompatibleStateError: The file's fingerprint is not ``expected_fingerprint``.
    :raises OSError: The file cannot be opened or read, or no memory could be had for it (``ENOMEM``).
    """
    fd, size = _open_regular(path)
    try:
        source = _FileSource(path, fd, size)
        # The layout first (a forged length is refused here, before anything is allocated for it).
        header = _parse_header(source)
        _check_fingerprint(path, header.fingerprint, expected_fingerprint)
        records = _parse_records(source, header)
        meta, blobs, segments = _private_layout(size, records, pool)
        _read_fully(source, [view for _, view in segments])
    finally:
        os.close(fd)
    private = _PrivateSource(path, size, segments)
    checked = _validate(private, expected_fingerprint, 0)
    if checked != (header, records):  # rewritten in place between the two reads: take neither
        raise private.fail("the file changed while being read", None)
    whole_meta = freeze(meta)
    # The header (tokens included) lies in the first meta segment, which starts at file offset 0 and meta offset 0.
    tokens = whole_meta[header.tokens_offset : header.tokens_offset + header.n_tokens * _TOKEN_DTYPE.itemsize]
    frozen = {offset: freeze(buffer) for offset, buffer in blobs.items()}
    return _entry_of(tokens, header, records,
                     lambda offset, length: frozen[offset] if length else _EMPTY_BLOB[:0])


_EMPTY_BLOB = np.frombuffer(b"", dtype=np.uint8)
"""Empty blobs are views of this (each a new array object: buffers are told apart by identity)."""


def _aligned(n_bytes: int) -> np.ndarray:
    """A writable ``uint8`` array of ``n_bytes`` starting on an :data:`ALIGNMENT` boundary (as a file offset of 0
    is), so that the tokens keep the alignment the format gives them."""
    raw = np.empty(n_bytes + ALIGNMENT, dtype=np.uint8)
    shift = -raw.ctypes.data % ALIGNMENT
    return raw[shift : shift + n_bytes]


def _private_layout(size: int, records: list[_Record], pool: StateBufferPool | None
                    ) -> tuple[np.ndarray, dict[int, np.ndarray], list[tuple[int, memoryview]]]:
    """Private memory for a validated layout: a state buffer per non-empty blob (by file offset) and one aligned
    array for everything between blobs (header, record headers, padding, trailer); returns them and the ``(file
    offset, view)`` segments, in file order, that together cover the file's ``size`` bytes exactly."""
    blobs: dict[int, np.ndarray] = {}
    gaps: list[tuple[int, int]] = []
    position = 0
    try:
        for *_, record_blobs in records:
            for _, offset, length in record_blobs:
                if length == 0:
                    continue
                gaps.append((position, offset))
                blobs[offset] = allocate_state_buffer(length, pool)
                position = offset + length
    except MemoryError as exc:
        raise OSError(errno.ENOMEM, f"no memory for a state of the file: {exc}") from exc
    gaps.append((position, size))
    meta = _aligned(sum(end - start for start, end in gaps))
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


def _read_fully(source: _FileSource, views: list[memoryview]) -> None:
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
    source = _MappedSource(label, data)
    header, records = _validate(source, expected_fingerprint, FILE_BLOB_REFS if blob_refs else 0)
    if blob_refs and not header.flags & FILE_BLOB_REFS:
        raise source.fail("blob references expected, found state bytes", 12)
    whole = np.frombuffer(data, dtype=np.uint8)
    whole.flags.writeable = False  # a bytearray would give writable views; states are shared read-only
    tokens = whole[header.tokens_offset : header.tokens_offset + header.n_tokens * _TOKEN_DTYPE.itemsize]
    return _entry_of(tokens, header, records, lambda offset, length: whole[offset : offset + length])


def _validate(source: _Source, expected_fingerprint: str | None, known_flags: int) -> tuple[_Header, list[_Record]]:
    """Parse and verify everything: header, fingerprint, records and the digest of the whole."""
    header = _parse_header(source, known_flags)
    _check_fingerprint(source.path, header.fingerprint, expected_fingerprint)
    records = _parse_records(source, header)
    stored = source.unpack(_TRAILER, header.body_end, source.size, "trailer")[1]
    if source.hash(0, header.body_end) != stored:
        raise source.fail("digest mismatch (the file is corrupted)", header.body_end + 8)
    return header, records


def _entry_of(token_bytes: np.ndarray, header: _Header, records: list[_Record],
              blob: Callable[[int, int], np.ndarray]) -> CacheEntry:
    """The entry of validated bytes: ``token_bytes`` (read-only ``uint8``) and ``blob(offset, length)``, the
    read-only buffer of the blob at that file offset; only views are made."""
    tokens = token_bytes.view(_TOKEN_DTYPE)
    if not _TOKEN_DTYPE.isnative:  # big-endian host: one small copy of the tokens
        tokens = tokens.astype(np.int32)
        tokens.flags.writeable = False
    states = []
    for _, n_tokens, pos_min, pos_max, partial, blobs in records:
        (_, *target), *extras = blobs
        states.append(
            Checkpoint(
                n_tokens=n_tokens,
                pos_min=pos_min,
                pos_max=pos_max,
                partial=partial,
                target=blob(*target),
                fingerprint=header.fingerprint,
                extra={name: blob(offset, length) for name, offset, length in extras},
            )
        )
    return CacheEntry(tokens, states[0], tuple(states[1:]), header.namespace)


def read_header(path: str | os.PathLike[str], *, expected_fingerprint: str | None = None) -> EntryHeader:
    """Read and verify only the header of the file at ``path`` (for indexing a directory without mapping blobs).

    Checks the magic, version, lengths, the header digest and the trailer's framing (a truncated file is refused);
    the blobs and the whole-file digest are only checked by :func:`read_entry`.

    :raises CorruptFileError: The header is malformed or the file truncated.
    :raises IncompatibleStateError: The file's fingerprint is not ``expected_fingerprint``.
    """
    fd, size = _open_regular(path)
    try:
        source = _FileSource(path, fd, size)
        header = _parse_header(source)
        _check_fingerprint(path, header.fingerprint, expected_fingerprint)
        data = source.read(header.tokens_offset, header.n_tokens * _TOKEN_DTYPE.itemsize)
    finally:
        os.close(fd)
    tokens = np.frombuffer(data, dtype=_TOKEN_DTYPE)
    if not _TOKEN_DTYPE.isnative:
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
    )


def read_recorded_namespace(path: str | os.PathLike[str]) -> str | None:
    """The namespace the header of the file at ``path`` records, read without checking digests or the trailer;
    ``None`` if not even that much is readable.

    For attributing a file that failed validation (a truncated one, one moved aside as corrupt) to its tenant, e.g.
    to delete it when that tenant asks to be forgotten. Never use what it returns to load anything.
    """
    try:
        fd, size = _open_regular(path)
    except (CorruptFileError, OSError):
        return None
    try:
        source = _FileSource(path, fd, size)
        if size < _FIXED.size or source.read(0, len(MAGIC)) != MAGIC:
            return None
        _, major, _, _, _, fp_len = source.unpack(_FIXED, 0, size, "header")
        if major not in READ_VERSIONS or fp_len > MAX_TEXT_BYTES:
            return None
        offset = _FIXED.size + fp_len
        (ns_len,) = source.unpack(_U32, offset, size, "namespace length")
        if ns_len > MAX_TEXT_BYTES:
            return None
        source.need(offset + _U32.size, ns_len, size, "namespace")
        return source.read(offset + _U32.size, ns_len).decode("utf-8")
    except (CorruptFileError, UnicodeDecodeError, OSError):
        return None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------------
# file names


def safe_path(directory: str | os.PathLike[str], filename: str) -> Path:
    """Confine a client-supplied ``filename`` to ``directory``; return ``directory / filename``.

    Only a plain name of ``[A-Za-z0-9._-]`` (1 to 255 characters, not starting with ``.``) is accepted: no absolute
    path, separator, ``..``, NUL or hidden name (temporary files are hidden names). If the name exists as a symlink,
    its real path must still lie inside the directory's real path.

    The check cannot stop a symlink created afterwards by someone with write access to the directory; keep the
    directory writable by the server only.

    :raises UnsafePathError: The name is refused.
    """
    if not isinstance(filename, str):
        raise UnsafePathError(f"file name must be a string, got {type(filename).__name__}")
    if not _SAFE_NAME.fullmatch(filename):
        shown = filename if len(filename) <= 80 else filename[:80] + "..."
        raise UnsafePathError(
            f"refusing file name {shown!r}: only a plain name of letters, digits, '.', '_' and '-' "
            f"(1 to 255 characters, not starting with '.') is allowed"
        )
    base = Path(directory)
    candidate = base / filename
    real_directory = Path(os.path.realpath(base))
    real = Path(os.path.realpath(candidate))
    if real == real_directory or not real.is_relative_to(real_directory):
        raise UnsafePathError(
            f"refusing file name {filename!r}: it resolves to {str(real)!r}, outside {str(real_directory)!r}"
        )
    return candidate


def iter_entry_files(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Regular files of ``directory`` whose names :func:`safe_path` accepts (temporary files of writes are skipped)."""
    with os.scandir(directory) as entries:
        for item in entries:
            if _SAFE_NAME.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                yield Path(directory) / item.name


def remove_stale_temp_files(directory: str | os.PathLike[str], *, min_age_seconds: float = 3600.0) -> list[Path]:
    """Delete temporary files left by writes that crashed, if older than ``min_age_seconds``; return them.

    Younger ones may belong to a write in progress (in this or another process) and are kept.
    """
    removed = []
    now = time.time()
    with os.scandir(directory) as entries:
        for item in entries:
            if not (item.name.startswith(TEMP_PREFIX) and item.name.endswith(".tmp")):
                continue
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                if now - item.stat(follow_symlinks=False).st_mtime < min_age_seconds:
                    continue
                os.unlink(item.path)
            except FileNotFoundError:
                continue
            removed.append(Path(directory) / item.name)
    return removed
