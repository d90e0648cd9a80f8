"""Parsing an entry's bytes field by field, each length checked against the bytes left before anything is sliced,
and validating them: the header and its digest, the fingerprint, every state record of either format version with its
blobs, and the digest of the whole (:func:`validate`). What was parsed becomes an entry in
:mod:`ckpt_plugin.persist.read`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckpt_plugin.core.checkpoint import TARGET, check_extra_name
from ckpt_plugin.core.errors import IncompatibleStateError
from ckpt_plugin.persist.layout import (
    BLOBS_V1,
    DIGEST_SIZE,
    END_MAGIC,
    EXTRA_KIND,
    EXTRA_RECORD,
    FILE_FLAGS_REQUIRED,
    FILE_PAGED,
    FIXED_HEADER,
    MAGIC,
    MAX_EXTRAS,
    MAX_NAME_BYTES,
    MAX_RECORDS,
    MAX_TEXT_BYTES,
    MIN_FILE_SIZE,
    PAGED_VERSION,
    READ_VERSIONS,
    RECORD_V1,
    REC_KNOWN_V1,
    REC_PAGED,
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
from ckpt_plugin.persist.sources import Source

__all__ = ["FileHeader", "check_fingerprint", "parse_header", "parse_records", "validate"]


@dataclass
class FileHeader:
    """What a file's header says, as parsed: where its tokens and records are, and where its trailer starts."""

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


def parse_header(source: Source, known_flags: int = 0) -> FileHeader:
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
    if flags & FILE_PAGED and (major, minor) < PAGED_VERSION:
        raise source.fail(f"paged records in a file of version {major}.{minor} (they came with "
                          f"{'.'.join(map(str, PAGED_VERSION))})", 12)
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
    return FileHeader((major, minor), flags, n_records, fingerprint, namespace, n_tokens, tokens_offset, offset,
                      body_end)


def check_fingerprint(path: str | os.PathLike[str], found: str, expected: str | None) -> None:
    if expected is not None and found != expected:
        raise IncompatibleStateError(
            f"slot file {os.fspath(path)!r} holds state of model/context {found!r}, "
            f"but {expected!r} was expected; refusing to load it"
        )


def parse_records(source: Source, header: FileHeader) -> list[Record]:
    """The state records of a file of either version, each with its blobs, checked to end exactly at the trailer."""
    parse = _parse_state_v1 if header.version[0] == 1 else _parse_state
    records: list[Record] = []
    offset, end = header.records_offset, header.body_end
    for index in range(header.n_records):
        record = parse(source, header, index, offset)
        records.append(record)
        offset = record.end
    if offset != end:
        raise source.fail(f"{end - offset} unexpected bytes after the last record", offset)
    return records


def _check_state(source: Source, header: FileHeader, index: int, offset: int, n_tokens: int, pos_min: int,
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


def _parse_state(source: Source, header: FileHeader, index: int, offset: int) -> Record:
    """A version 2 state record at ``offset``: its header, its target blob, then its extra records."""
    what, end = f"record {index}", header.body_end
    kind, flags, n_tokens, pos_min, pos_max, length, n_extras, reserved = source.unpack(STATE_RECORD, offset, end, what)
    if kind != STATE_KIND:
        raise source.fail(f"{what} is not a state record (kind {kind!r})", offset)
    known = REC_PARTIAL | (REC_PAGED if header.flags & FILE_PAGED else 0)
    if flags & ~known:
        raise source.fail(f"{what} has unknown flags {flags & ~known:#x}", offset + 4)
    if reserved.count(0) != len(reserved):
        raise source.fail(f"{what} has non-zero reserved fields", offset + 44)
    _check_state(source, header, index, offset + 8, n_tokens, pos_min, pos_max)
    if n_extras > MAX_EXTRAS:
        raise source.fail(f"{what} names {n_extras} extra states, more than {MAX_EXTRAS}", offset + 40)
    paged = bool(flags & REC_PAGED)
    if paged and length == 0:
        raise source.fail(f"{what} is paged but holds no page map", offset + 32)
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
    return Record(offset, n_tokens, pos_min, pos_max, bool(flags & REC_PARTIAL), blobs, paged)


def _valid_name(name: bytes) -> bool:
    try:
        check_extra_name(name.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def _parse_state_v1(source: Source, header: FileHeader, index: int, offset: int) -> Record:
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
    return Record(offset, n_tokens, pos_min, pos_max, bool(flags & REC_PARTIAL), blobs)


def validate(source: Source, expected_fingerprint: str | None, known_flags: int) -> tuple[FileHeader, list[Record]]:
    """Parse and verify everything: header, fingerprint, records and the digest of the whole."""
    header = parse_header(source, known_flags)
    check_fingerprint(source.path, header.fingerprint, expected_fingerprint)
    records = parse_records(source, header)
    stored = source.unpack(TRAILER, header.body_end, source.size, "trailer")[1]
    if source.hash(0, header.body_end) != stored:
        raise source.fail("digest mismatch (the file is corrupted)", header.body_end + 8)
    return header, records
