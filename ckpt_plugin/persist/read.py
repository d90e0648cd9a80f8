"""Reading an entry: parsed field by field and validated (:func:`read_entry`, :func:`decode_entry`,
:func:`read_header`), into private memory."""

from __future__ import annotations
import os
import stat
from dataclasses import dataclass
from typing import Callable
import numpy as np
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import TARGET, Checkpoint, StateBufferPool, check_extra_name, freeze
from ckpt_plugin.core.errors import CorruptFileError, IncompatibleStateError

from ckpt_plugin.persist.layout import (
    BLOBS_V1,
    DIGEST_SIZE,
    END_MAGIC,
    EXTRA_KIND,
    EXTRA_RECORD,
    EntryHeader,
    FILE_BLOB_REFS,
    FILE_FLAGS_REQUIRED,
    FIXED_HEADER,
    MAGIC,
    MAX_EXTRAS,
    MAX_NAME_BYTES,
    MAX_RECORDS,
    MAX_TEXT_BYTES,
    MIN_FILE_SIZE,
    READ_VERSIONS,
    RECORD_V1,
    REC_KNOWN_V1,
    REC_PARTIAL,
    REC_TARGET,
    Record,
    STATE_KIND,
    STATE_RECORD,
    TOKEN_DTYPE,
    TRAILER,
    U32,
    U64,
    pad,
)
from ckpt_plugin.persist.sources import FileSource, MappedSource, PrivateSource, Source, private_layout, read_fully

__all__ = ["decode_entry", "read_entry", "read_header", "read_recorded_namespace"]

@dataclass
class Header:
    version: tuple[int, int]
    flags: int
    n_records: int
    fingerprint: str
    namespace: str
    n_tokens: int
    tokens_offset: int
    records_offset: int
    body_end: int


def _decode_text(source: Source, data: bytes, offset: int, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise source.fail(f"{what} is not valid UTF-8 ({exc.reason})", offset + exc.start) from None


def _check_zero(source: Source, offset: int, n: int, limit: int, what: str) -> None:
    if n:
        source.need(offset, n, limit, what)
        data = source.read(offset, n)
        if data.count(0) != n:
            raise source.fail(f"{what} is not zero", offset + next(i for i, b in enumerate(data) if b))


def _parse_header(source: Source, known_flags: int = 0) -> Header:
    """Parse and verify everything up to the first record, and the trailer's framing (not its digest).

    :param known_flags: Required file flags the caller reads (any other required flag is refused).
    """
    size = source.size
    if size >= len(MAGIC) and source.read(0, len(MAGIC)) != MAGIC:
        raise source.fail("not a slot file (bad magic)", 0)
    if size < MIN_FILE_SIZE:
        raise source.fail(f"file is {size} bytes, shorter than the smallest slot file ({MIN_FILE_SIZE} bytes)",
                          None if size < len(MAGIC) else size)
    _, major, minor, flags, n_records, fp_len = source.unpack(FIXED_HEADER, 0, size, "header")
    if major not in READ_VERSIONS:
        readable = " and ".join(f"{known}.x" for known in READ_VERSIONS)
        raise source.fail(f"unsupported format version {major}.{minor} (this reader reads {readable})", 8)
    if flags & FILE_FLAGS_REQUIRED & ~known_flags:
        raise source.fail(f"unknown required file flags {flags & FILE_FLAGS_REQUIRED & ~known_flags:#06x}", 12)
    body_end = size - TRAILER.size
    trailer_offset, _, end_magic = source.unpack(TRAILER, body_end, size, "trailer")
    if end_magic != END_MAGIC:
        raise source.fail("end marker missing: the file is truncated or was not completely written", size - 8)
    if trailer_offset != body_end:
        raise source.fail(f"trailer records {trailer_offset} bytes of data but the file holds {body_end}", body_end)
    if not 1 <= n_records <= MAX_RECORDS:
        raise source.fail(f"record count {n_records} outside 1..{MAX_RECORDS}", 16)
    offset = FIXED_HEADER.size
    if fp_len > MAX_TEXT_BYTES:
        raise source.fail(f"fingerprint length {fp_len} exceeds {MAX_TEXT_BYTES}", 20)
    source.need(offset, fp_len, body_end, "fingerprint")
    fingerprint = _decode_text(source, source.read(offset, fp_len), offset, "fingerprint")
    offset += fp_len
    (ns_len,) = source.unpack(U32, offset, body_end, "namespace length")
    if ns_len > MAX_TEXT_BYTES:
        raise source.fail(f"namespace length {ns_len} exceeds {MAX_TEXT_BYTES}", offset)
    offset += U32.size
    source.need(offset, ns_len, body_end, "namespace")
    namespace = _decode_text(source, source.read(offset, ns_len), offset, "namespace")
    offset += ns_len
    n_tokens_offset = offset
    (n_tokens,) = source.unpack(U64, offset, body_end, "token count")
    offset += U64.size
    _check_zero(source, offset, pad(offset), body_end, "header padding")
    offset += pad(offset)
    tokens_offset = offset
    if n_tokens > (body_end - offset) // TOKEN_DTYPE.itemsize:
        raise source.fail(
            f"token count {n_tokens} needs {n_tokens * TOKEN_DTYPE.itemsize} bytes but only "
            f"{max(0, body_end - offset)} are left",
            n_tokens_offset,
        )
    offset += n_tokens * TOKEN_DTYPE.itemsize
    source.need(offset, DIGEST_SIZE, body_end, "header digest")
    if source.read(offset, DIGEST_SIZE) != source.hash(0, offset):
        raise source.fail("header digest mismatch (the header is corrupted)", offset)
    offset += DIGEST_SIZE
    _check_zero(source, offset, pad(offset), body_end, "header padding")
    offset += pad(offset)
    return Header((major, minor), flags, n_records, fingerprint, namespace, n_tokens, tokens_offset, offset, body_end)


def _check_fingerprint(path: str | os.PathLike[str], found: str, expected: str | None) -> None:
    if expected is not None and found != expected:
        raise IncompatibleStateError(
            f"slot file {os.fspath(path)!r} holds state of model/context {found!r}, "
            f"but {expected!r} was expected; refusing to load it"
        )


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




def _parse_records(source: Source, header: Header) -> list[Record]:
    """The state records of a file of either version, each with its blobs, checked to end exactly at the trailer."""
    parse = _parse_state_v1 if header.version[0] == 1 else _parse_state
    records: list[Record] = []
    offset, end = header.records_offset, header.body_end
    for index in range(header.n_records):
        record = parse(source, header, index, offset)
        records.append(record)
        offset = record[0]
    if offset != end:
        raise source.fail(f"{end - offset} unexpected bytes after the last record", offset)
    return records


def _check_state(source: Source, header: Header, index: int, offset: int, n_tokens: int, pos_min: int,
                 pos_max: int) -> None:
    """What both versions require of a state record's counts (``offset``: where its token count is)."""
    what = f"record {index}"
    if not 0 <= n_tokens <= header.n_tokens or (index == 0 and n_tokens != header.n_tokens):
        raise source.fail(f"{what} holds {n_tokens} tokens, inconsistent with the entry's {header.n_tokens}", offset)
    if pos_min < -1 or pos_max < -1:
        raise source.fail(f"{what} has invalid positions ({pos_min}, {pos_max})", offset + 8)


def _blob(source: Source, what: str, offset: int, length: int, length_offset: int, end: int) -> int:
    """Check a blob of ``length`` bytes at ``offset`` and its zero padding; return the offset after them."""
    if length > end - offset:
        raise source.fail(f"{what} blob length {length} exceeds the {max(0, end - offset)} bytes left", length_offset)
    offset += length
    _check_zero(source, offset, pad(offset), end, f"{what} padding")
    return offset + pad(offset)


def _parse_state(source: Source, header: Header, index: int, offset: int) -> Record:
    """A version 2 state record at ``offset``: its header, its target blob, then its extra records."""
    what, end = f"record {index}", header.body_end
    kind, flags, n_tokens, pos_min, pos_max, length, n_extras, reserved = source.unpack(STATE_RECORD, offset, end, what)
    if kind != STATE_KIND:
        raise source.fail(f"{what} is not a state record (kind {kind!r})", offset)
    if flags & ~REC_PARTIAL:
        raise source.fail(f"{what} has unknown flags {flags & ~REC_PARTIAL:#x}", offset + 4)
    if reserved.count(0) != len(reserved):
        raise source.fail(f"{what} has non-zero reserved fields", offset + 44)
    _check_state(source, header, index, offset + 8, n_tokens, pos_min, pos_max)
    if n_extras > MAX_EXTRAS:
        raise source.fail(f"{what} names {n_extras} extra states, more than {MAX_EXTRAS}", offset + 40)
    start = offset + STATE_RECORD.size
    blobs = [(TARGET, start, length)]
    offset = _blob(source, f"{what} target", start, length, offset + 32, end)
    previous = b""
    for number in range(n_extras):
        extra = f"{what} extra {number}"
        kind, name_length, length, name = source.unpack(EXTRA_RECORD, offset, end, extra)
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
        blobs.append((name.decode("ascii"), offset + EXTRA_RECORD.size, length))
        offset = _blob(source, f"{extra} ({name.decode()})", offset + EXTRA_RECORD.size, length, offset + 8, end)
    return offset, n_tokens, pos_min, pos_max, bool(flags & REC_PARTIAL), blobs


def _valid_name(name: bytes) -> bool:
    try:
        check_extra_name(name.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def _parse_state_v1(source: Source, header: Header, index: int, offset: int) -> Record:
    """A version 1 state record at ``offset``: target, draft and speculative blobs in fixed places."""
    what, end = f"record {index}", header.body_end
    n_tokens, pos_min, pos_max, flags, reserved, *lengths, reserved2 = source.unpack(RECORD_V1, offset, end, what)
    if flags & ~REC_KNOWN_V1:
        raise source.fail(f"{what} has unknown flags {flags & ~REC_KNOWN_V1:#x}", offset + 24)
    if reserved or reserved2:
        raise source.fail(f"{what} has non-zero reserved fields", offset)
    if not flags & REC_TARGET:
        raise source.fail(f"{what} has no target state", offset + 24)
    _check_state(source, header, index, offset, n_tokens, pos_min, pos_max)
    blobs: list[tuple[str, int, int]] = []
    length_offset = offset + 32
    offset += RECORD_V1.size
    for (name, bit), length in zip(BLOBS_V1, lengths):
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
    fd, size = open_regular(path)
    try:
        source = FileSource(path, fd, size)
        # The layout first (a forged length is refused here, before anything is allocated for it).
        header = _parse_header(source)
        _check_fingerprint(path, header.fingerprint, expected_fingerprint)
        records = _parse_records(source, header)
        meta, blobs, segments = private_layout(size, records, pool)
        read_fully(source, [view for _, view in segments])
    finally:
        os.close(fd)
    private = PrivateSource(path, size, segments)
    checked = _validate(private, expected_fingerprint, 0)
    if checked != (header, records):  # rewritten in place between the two reads: take neither
        raise private.fail("the file changed while being read", None)
    whole_meta = freeze(meta)
    # The header (tokens included) lies in the first meta segment, which starts at file offset 0 and meta offset 0.
    tokens = whole_meta[header.tokens_offset : header.tokens_offset + header.n_tokens * TOKEN_DTYPE.itemsize]
    frozen = {offset: freeze(buffer) for offset, buffer in blobs.items()}
    return _entry_of(tokens, header, records,
                     lambda offset, length: frozen[offset] if length else _EMPTY_BLOB[:0])


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
    header, records = _validate(source, expected_fingerprint, FILE_BLOB_REFS if blob_refs else 0)
    if blob_refs and not header.flags & FILE_BLOB_REFS:
        raise source.fail("blob references expected, found state bytes", 12)
    whole = np.frombuffer(data, dtype=np.uint8)
    whole.flags.writeable = False  # a bytearray would give writable views; states are shared read-only
    tokens = whole[header.tokens_offset : header.tokens_offset + header.n_tokens * TOKEN_DTYPE.itemsize]
    return _entry_of(tokens, header, records, lambda offset, length: whole[offset : offset + length])


def _validate(source: Source, expected_fingerprint: str | None, known_flags: int) -> tuple[Header, list[Record]]:
    """Parse and verify everything: header, fingerprint, records and the digest of the whole."""
    header = _parse_header(source, known_flags)
    _check_fingerprint(source.path, header.fingerprint, expected_fingerprint)
    records = _parse_records(source, header)
    stored = source.unpack(TRAILER, header.body_end, source.size, "trailer")[1]
    if source.hash(0, header.body_end) != stored:
        raise source.fail("digest mismatch (the file is corrupted)", header.body_end + 8)
    return header, records


def _entry_of(token_bytes: np.ndarray, header: Header, records: list[Record],
              blob: Callable[[int, int], np.ndarray]) -> CacheEntry:
    """The entry of validated bytes: ``token_bytes`` (read-only ``uint8``) and ``blob(offset, length)``, the
    read-only buffer of the blob at that file offset; only views are made."""
    tokens = token_bytes.view(TOKEN_DTYPE)
    if not TOKEN_DTYPE.isnative:  # big-endian host: one small copy of the tokens
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
    fd, size = open_regular(path)
    try:
        source = FileSource(path, fd, size)
        header = _parse_header(source)
        _check_fingerprint(path, header.fingerprint, expected_fingerprint)
        data = source.read(header.tokens_offset, header.n_tokens * TOKEN_DTYPE.itemsize)
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
