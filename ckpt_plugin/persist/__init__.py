"""The versioned on-disk format of slot files and disk-tier cache entries (see ``docs/persistence-format.md``).

A file holds one :class:`~ckpt_plugin.core.entry.CacheEntry`: the model fingerprint, the namespace, the tokens, the full
state and the checkpoints of its lineage, each state record with its target blob and its extra states, each a blob
stored with its name (a draft model's, a speculative decoder's, any plugin's). Blob payloads start on 64-byte
boundaries. Files of version 1.0, whose records had a draft and a speculative blob in fixed places, are still read.
Since 2.1 a record's target may be a page map instead of the state's bytes (:data:`FILE_PAGED`): the disk tier
stores each page once, as a file of its page directory (:class:`PageFiles`), and an entry file names its pages.

:func:`read_entry` reads the file once, in one pass, into private anonymous memory: each blob straight into a state
buffer of its own (from a :class:`~ckpt_plugin.core.checkpoint.StateBufferPool`), the rest into one small buffer; then
validates those bytes and returns an entry whose buffers are that memory, frozen read-only. It never maps the file:
pages of a mapped file that shrinks under the mapping (truncated by another process, an operator, a full disk) raise
``SIGBUS`` on the next access, which would kill the whole server in the middle of a restore. Reading costs little
more than mapping did, since the digest check reads every byte once either way (+17% on a 22 MB entry with recycled
buffers, ``docs/persistence-format.md``), and a buffer of its own per blob lets the RAM cache count, keep and free
each state like any capture.

Safety rules (docs/persistence-format.md, "Security and safety rules"):

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

from ckpt_plugin.persist.layout import (
    ALIGNMENT,
    EntryHeader,
    FILE_BLOB_REFS,
    FILE_PAGED,
    FORMAT_VERSION,
    MAGIC,
    MAX_EXTRAS,
    MAX_RECORDS,
    PAGED_VERSION,
    READ_VERSIONS,
)
from ckpt_plugin.persist.write import encode_entry, write_entry
from ckpt_plugin.persist.read import decode_entry, read_entry, read_header, read_recorded_namespace
from ckpt_plugin.persist.paths import iter_entry_files, remove_stale_temp_files, safe_path
from ckpt_plugin.persist.page_files import PageFileError, PageFiles

from ckpt_plugin.core.errors import CorruptFileError, UnsafePathError

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_EXTRAS",
    "MAX_RECORDS",
    "PAGED_VERSION",
    "READ_VERSIONS",
    "CorruptFileError",
    "EntryHeader",
    "FILE_BLOB_REFS",
    "FILE_PAGED",
    "PageFileError",
    "PageFiles",
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
