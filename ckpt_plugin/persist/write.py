"""Writing an entry: atomically to a file (:func:`write_entry`), or to bytes (:func:`encode_entry`); any file
atomically (:func:`write_atomically`)."""

from __future__ import annotations
import errno
import hashlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable
import numpy as np
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint, check_extra_name
from ckpt_plugin.core.errors import IncompatibleStateError
from ckpt_plugin.core.pages import PagedState
from ckpt_plugin.persist.page_map import encode_page_map

from ckpt_plugin.persist.layout import (
    CHUNK_SIZE,
    DIGEST_SIZE,
    END_MAGIC,
    EXTRA_KIND,
    EXTRA_RECORD,
    FILE_BLOB_REFS,
    FILE_PAGED,
    FIXED_HEADER,
    FORMAT_VERSION,
    INT32_RANGE,
    MAGIC,
    MAX_EXTRAS,
    MAX_NAME_BYTES,
    MAX_RECORDS,
    MAX_TEXT_BYTES,
    PAGED_VERSION,
    REC_PAGED,
    REC_PARTIAL,
    STATE_KIND,
    STATE_RECORD,
    TEMP_PREFIX,
    TOKEN_DTYPE,
    TRAILER,
    U32,
    U64,
    ZEROS,
    pad,
)

__all__ = ["encode_entry", "fsync_directory", "write_all", "write_atomically", "write_entry"]

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


def write_all(file: BinaryIO, data: bytes | memoryview) -> int:
    """Write ``data`` to ``file`` whole, in chunks, without copying it; return its length."""
    return _emit(file, (), data)


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
    if array.size and array.dtype != TOKEN_DTYPE:
        if array.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
        if int(array.min()) < INT32_RANGE.min or int(array.max()) > INT32_RANGE.max:
            raise ValueError("token ids must fit in int32")
    return np.ascontiguousarray(array, dtype=TOKEN_DTYPE)


def fsync_directory(directory: Path) -> None:
    """``fsync`` ``directory``, so that the names created or renamed in it last (where the platform allows)."""
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


def write_entry(path: str | os.PathLike[str], entry: CacheEntry, *, model_fingerprint: str,
                paged: bool = False) -> int:
    """Write ``entry`` to ``path`` atomically; return the bytes written (the file's size).

    The data goes to a temporary file in the same directory (named ``.ckpt-tmp-*.tmp``), is flushed and
    ``fsync``-ed, then renamed onto ``path`` and the directory is ``fsync``-ed: a crash at any point leaves either the
    earlier file or the new one, both complete. State bytes are written from the buffers themselves, in chunks of
    :data:`CHUNK_SIZE`, never copied. The file is created with mode ``0600``.

    :param path: Destination. Pass a client-supplied name through :func:`safe_path` first.
    :param entry: The entry; its state and checkpoints must all belong to ``model_fingerprint``.
    :param model_fingerprint: The fingerprint of the model/context the states were captured on.
    :param paged: Write each paged target state as its page map (a file of :data:`PAGED_VERSION`), not its bytes:
        the caller stores the pages (the disk tier's page directory, :mod:`ckpt_plugin.persist.page_files`) and
        reads the file back with that directory. Without it every state is written whole, in
        :data:`FORMAT_VERSION`.
    :raises IncompatibleStateError: A state of the entry belongs to another fingerprint.
    :raises ValueError: The entry cannot be represented (non-uint8 blobs, oversized strings, too many records...).
    :raises OSError: Writing failed; nothing was replaced and the temporary file was removed.
    """
    # Validate every record before creating any file.
    parts = _entry_parts(entry, model_fingerprint, 0, paged)
    return write_atomically(path, lambda file: _emit_parts(file, parts))


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], int], *,
                     sync_directory: bool = True) -> int:
    """Create ``path`` (mode ``0600``) with what ``write`` writes into an unbuffered file, atomically; return what
    ``write`` returns (the bytes it wrote).

    A temporary file in the same directory is written, ``fsync``-ed and renamed onto ``path``: a crash leaves the
    earlier file or the new one, never a part of one. Then the directory is ``fsync``-ed, unless
    ``sync_directory`` is false (a caller writing many files there syncs it once, with :func:`fsync_directory`).

    :raises OSError: Writing failed; nothing was replaced and the temporary file was removed.
    """
    path = Path(path)
    directory = path.parent
    temp = tempfile.NamedTemporaryFile(dir=directory, prefix=TEMP_PREFIX, suffix=".tmp", delete=False, buffering=0)
    try:
        with temp as file:
            written = write(file)
            file.flush()  # unbuffered: a no-op today, kept so a buffered file would still be complete before fsync
            os.fsync(file.fileno())
        os.replace(temp.name, path)
    except BaseException:
        try:
            os.unlink(temp.name)
        except OSError:
            pass
        raise
    if sync_directory:
        fsync_directory(directory)
    return written


def encode_entry(entry: CacheEntry, *, model_fingerprint: str, blob_refs: bool = False) -> bytes:
    """``entry`` in the file format, as bytes (what :func:`write_entry` would write).

    :param blob_refs: Set :data:`FILE_BLOB_REFS`: the entry's blobs are references to state bytes stored elsewhere
        (the shared tier's manifests, see :mod:`ckpt_plugin.tiers.shared.format`), not the state bytes themselves.
    :raises IncompatibleStateError: A state of the entry belongs to another fingerprint.
    :raises ValueError: The entry cannot be represented.
    """
    out = io.BytesIO()
    _emit_parts(out, _entry_parts(entry, model_fingerprint, FILE_BLOB_REFS if blob_refs else 0, False))
    return out.getvalue()


def _entry_parts(entry: CacheEntry, model_fingerprint: str, file_flags: int,
                 paged: bool) -> list[bytes | memoryview]:
    """Everything before the trailer, in order, after validating the whole entry (state bytes as views; with
    ``paged``, each paged target as its page map)."""
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
        flags = REC_PARTIAL if record.partial else 0
        if paged and isinstance(record.target, PagedState):
            target = memoryview(encode_page_map(record.target))
            flags |= REC_PAGED
            file_flags |= FILE_PAGED
        else:
            target = _check_blob(f"target of record {index}", record.target_bytes())
        encoded.append((STATE_RECORD.pack(STATE_KIND, flags, record.n_tokens, record.pos_min, record.pos_max,
                                    target.nbytes, len(extras), bytes(20)), target))
        for name, buffer in extras:
            encoded_name = _encode_name(name).ljust(MAX_NAME_BYTES, b"\0")
            view = _check_blob(f"{name} of record {index}", buffer)
            encoded.append((EXTRA_RECORD.pack(EXTRA_KIND, len(name), view.nbytes, encoded_name), view))

    # The oldest version that holds the entry: files of whole states stay readable by every 2.x reader.
    major, minor = PAGED_VERSION if file_flags & FILE_PAGED else FORMAT_VERSION
    prefix = bytearray(FIXED_HEADER.pack(MAGIC, major, minor, file_flags, len(records), len(fingerprint)))
    prefix += fingerprint + U32.pack(len(namespace)) + namespace + U64.pack(n_tokens)
    prefix += bytes(pad(len(prefix)))
    token_view = memoryview(tokens).cast("B")
    header_digest = hashlib.blake2b(prefix, digest_size=DIGEST_SIZE)
    header_digest.update(token_view)
    header_end = len(prefix) + token_view.nbytes + DIGEST_SIZE
    parts: list[bytes | memoryview] = [prefix, token_view, header_digest.digest(), ZEROS[: pad(header_end)]]
    for head, view in encoded:
        parts += [head, view, ZEROS[: pad(view.nbytes)]]
    return parts


def _emit_parts(file: BinaryIO, parts: list[bytes | memoryview]) -> int:
    """Write ``parts`` and the trailer (the digest of everything before it); return the bytes written."""
    whole = hashlib.blake2b(digest_size=DIGEST_SIZE)
    written = 0
    for part in parts:
        written += _emit(file, (whole,), part)
    return written + _emit(file, (), TRAILER.pack(written, whole.digest(), END_MAGIC))
