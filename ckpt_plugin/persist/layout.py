"""The entry file's layout: magic numbers, versions, limits, the fixed-size headers and records, flags."""

from __future__ import annotations
import re
import struct
from dataclasses import dataclass
import numpy as np
from ckpt_plugin.core.checkpoint import DRAFT, SPECULATIVE, TARGET

__all__ = [
    "ALIGNMENT",
    "BLOBS_V1",
    "CHUNK_SIZE",
    "DIGEST_SIZE",
    "END_MAGIC",
    "EXTRA_KIND",
    "EXTRA_RECORD",
    "EntryHeader",
    "FILE_BLOB_REFS",
    "FILE_FLAGS_REQUIRED",
    "FIXED_HEADER",
    "FORMAT_VERSION",
    "INT32_RANGE",
    "MAGIC",
    "MAX_EXTRAS",
    "MAX_NAME_BYTES",
    "MAX_RECORDS",
    "MAX_TEXT_BYTES",
    "MIN_FILE_SIZE",
    "READ_VERSIONS",
    "RECORD_V1",
    "REC_KNOWN_V1",
    "REC_PARTIAL",
    "REC_TARGET",
    "Record",
    "SAFE_NAME",
    "STATE_KIND",
    "STATE_RECORD",
    "TEMP_PREFIX",
    "TOKEN_DTYPE",
    "TRAILER",
    "U32",
    "U64",
    "ZEROS",
    "pad",
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
FIXED_HEADER = struct.Struct("<8sHHIII")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
# Version 2: a state record's header: kind, flags, n_tokens, pos_min, pos_max, target length, extra records, reserved.
STATE_RECORD = struct.Struct("<4sIqqqQI20s")
# Version 2: an extra record's header: kind, name length, blob length, name (zero-padded).
EXTRA_RECORD = struct.Struct(f"<4sIQ{MAX_NAME_BYTES}s")
STATE_KIND = b"STAT"
"""Kind of a state record (version 2): a checkpoint or the full state, with its target blob."""
EXTRA_KIND = b"XTRA"
"""Kind of an extra record (version 2): one named extra state of the state record before it."""
# Version 1: a state record's header: n_tokens, pos_min, pos_max, flags, reserved, 3 blob lengths, reserved.
RECORD_V1 = struct.Struct("<qqqIIQQQQ")
# Trailer: offset of the trailer (= bytes before it), digest of those bytes, end magic.
TRAILER = struct.Struct(f"<Q{DIGEST_SIZE}s8s")
assert STATE_RECORD.size == EXTRA_RECORD.size == RECORD_V1.size == ALIGNMENT

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
REC_KNOWN_V1 = REC_PARTIAL | REC_TARGET | REC_DRAFT | REC_SPECULATIVE
BLOBS_V1 = ((TARGET, REC_TARGET), (DRAFT, REC_DRAFT), (SPECULATIVE, REC_SPECULATIVE))

TOKEN_DTYPE = np.dtype("<i4")
INT32_RANGE = np.iinfo(np.int32)
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
MIN_FILE_SIZE = 2 * ALIGNMENT + STATE_RECORD.size + TRAILER.size
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


def pad(n: int) -> int:
    """Bytes of padding after ``n`` bytes to reach the next multiple of :data:`ALIGNMENT`."""
    return -n % ALIGNMENT


ZEROS = bytes(ALIGNMENT)

# (offset after the record, n_tokens, pos_min, pos_max, partial, [(name, offset, length) per blob, the target first])
Record = tuple[int, int, int, int, bool, list[tuple[str, int, int]]]
