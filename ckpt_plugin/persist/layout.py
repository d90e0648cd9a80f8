"""The entry file's layout: magic numbers, versions, limits, the fixed-size headers and records, flags."""

from __future__ import annotations
import re
import struct
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple
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
    "FILE_PAGED",
    "FIXED_HEADER",
    "FORMAT_VERSION",
    "INT32_RANGE",
    "MAGIC",
    "MAX_EXTRAS",
    "MAX_NAME_BYTES",
    "MAX_RECORDS",
    "MAX_TEXT_BYTES",
    "MIN_FILE_SIZE",
    "PAGED_VERSION",
    "READ_VERSIONS",
    "RECORD_V1",
    "REC_KNOWN_V1",
    "REC_PAGED",
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
"""(major, minor) of the files whose states are all whole (slot files, disk-tier entries of whole states, the shared
tier's manifests): byte for byte what every 2.x reader reads. Readers refuse a major version they do not know (this
one reads 1 and 2). A minor version keeps the layout and only adds file flags: optional ones (bits 16-31), which
older readers ignore, and required ones (bits 0-15), which mark data a reader must not take for an ordinary file:
a reader refuses every required flag it does not know, so an older reader refuses such a file, never misreads it."""
PAGED_VERSION = (2, 1)
"""(major, minor) of the files with paged records (:data:`FILE_PAGED`): the disk tier's entries whose target states
are page maps, their pages stored as files of their own. A file is written in the oldest version that holds it."""
READ_VERSIONS = (1, 2)
"""Major versions this module reads: 1.x (draft and speculative blobs in fixed places of each record) and 2.x
(extra states as named blob records; since 2.1, paged records)."""
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
FILE_PAGED = 1 << 1
"""Required file flag (version 2.1 and later): the records flagged :data:`REC_PAGED` hold a page map
(:mod:`ckpt_plugin.persist.page_map`) as their target payload, whose pages are files of a page directory
(:mod:`ckpt_plugin.persist.page_files`); only :func:`read_entry` given that directory reads their states."""
REC_PARTIAL = 1 << 0
"""Record flag (both versions): the state is partial."""
REC_PAGED = 1 << 1
"""State record flag (version 2, files with :data:`FILE_PAGED` only): the target payload is a page map, not the
state's bytes."""
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
    :ivar pages: The pages the file's paged records name: their ids and sizes in bytes (read only when asked, see
        :func:`~ckpt_plugin.persist.read_header`; empty for a file whose states are whole).
    """

    fingerprint: str
    namespace: str
    n_tokens: int
    tokens: np.ndarray
    file_size: int
    n_checkpoints: int
    version: tuple[int, int]
    pages: Mapping[bytes, int] = field(default_factory=dict)


def pad(n: int) -> int:
    """Bytes of padding after ``n`` bytes to reach the next multiple of :data:`ALIGNMENT`."""
    return -n % ALIGNMENT


ZEROS = bytes(ALIGNMENT)

class Record(NamedTuple):
    """A parsed state record."""

    end: int
    """Offset after the record (its extra records included)."""
    n_tokens: int
    pos_min: int
    pos_max: int
    partial: bool
    blobs: list[tuple[str, int, int]]
    """``(name, offset, length)`` per blob, the target first."""
    paged: bool = False
    """The target payload is a page map (:data:`REC_PAGED`)."""
