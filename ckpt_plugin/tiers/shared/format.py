"""How the shared tier lays cache entries out as key-value pairs (pure: no network here).

An entry of partition (model fingerprint, namespace) is stored as

- a **manifest** under ``<prefix>:<fp>:<ns>:e3:<entry id>``: the entry in the persistence format of
  :mod:`ckpt_plugin.persist` (versioned, fingerprinted, BLAKE2b digests of the header and of the whole) with the
  required file flag :data:`~ckpt_plugin.persist.FILE_BLOB_REFS`: each blob payload is a 24-byte reference (the
  XXH3-128 digest of the blob and its length) instead of the bytes;
- one **blob** per distinct state buffer under ``<prefix>:<fp>:<ns>:b:<xxh3-128>``: the raw state bytes (an extra
  state of any name: a draft model's, a speculative decoder's, a plugin's; a target state the engine keeps whole), or
  a paged target state's **page map** (:mod:`ckpt_plugin.persist.page_map`: the state's literal headers and its
  pages by id), checked against the digest that names them;
- one **page** per distinct page under ``<prefix>:<fp>:<ns>:b:<page id>``: its bytes and their XXH3-128 digest.
  A page's id names the tokens, model and tenant behind its cells (:mod:`ckpt_plugin.core.pages`), so the pages of
  a shared system prompt are stored once for every conversation of the namespace, and a turn writes only the pages
  it added: the cells after the previous turn and the page it ended inside. A fetch reads the pages this process
  does not hold live already;
- one **index** key per whole block of :data:`BLOCK_TOKENS` tokens of the entry, under
  ``<prefix>:<fp>:<ns>:i3:<chained hash>``, whose value is the id of the newest entry holding that prefix. The
  chained hash of block ``j`` covers every token up to the end of block ``j`` (and the partition), so one
  ``MGET`` of a prompt's block hashes tells how deep a stored prefix goes, in one round trip, whatever the number
  of entries.

``<fp>`` and ``<ns>`` are digests of the fingerprint and the namespace: replicas of other models, other context
settings or other tenants compute other keys and never read each other's values, and the manifest records both in
full, checked on every read. Nothing is ever unpickled: manifests are parsed field by field by :mod:`persist`, blobs
are bytes checked by their digest.

Manifests are written in :data:`WIRE_VERSION` (the persistence format's 2.0: each extra state a named reference);
manifests of 1.0, whose records referenced a draft and a speculative blob in fixed places, are read as well. Since
target states are paged, manifests and index keys take the letters ``e3`` and ``i3`` instead of ``e`` and ``i``: a
replica that does not read page maps would hand one to llama.cpp as a state (refused, the slot cleared), so the two
never see each other's entries. Entries written under ``e`` are not read any more (a miss); the server's TTL or
``maxmemory`` policy drops them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - the redis extra is missing: SharedTier refuses to start without it
    xxhash = None

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import TARGET, Checkpoint, StateBuffer, as_state_buffer
from ckpt_plugin.core.pages import PagedState
from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.persist.layout import FORMAT_VERSION
from ckpt_plugin.persist.page_map import encode_page_map
from ckpt_plugin.persist.read import decode_entry
from ckpt_plugin.persist.write import encode_entry
from ckpt_plugin.policy.eviction import checkpoints_to_erase
from ckpt_plugin.core.memory import common_prefix

__all__ = [
    "BLOCK_TOKENS",
    "MAX_LOOKUP_BLOCKS",
    "Manifest",
    "Partition",
    "blob_digest",
    "check_blob",
    "decode_manifest",
    "encode_manifest",
    "parse_entry_id",
]

WIRE_VERSION = (2, 0)
"""The manifest layout written: the persistence format's version (extra states as named blob references). Values of
1.0 are read too (see the module docstring)."""
assert WIRE_VERSION == FORMAT_VERSION, "manifests are written in the persistence format's newest version"
BLOCK_TOKENS = 32
"""Tokens per index block: a stored prefix is found to the block, its exact length read from the manifest."""
MAX_LOOKUP_BLOCKS = 1024
"""Index keys asked for at most per lookup (32,768 tokens of prompt): one ``MGET`` of at most this many keys."""
MANIFEST_TAG = "e3"
"""The key letter of manifests whose target states may be page maps (see the module docstring): replicas that do not
read page maps use ``e`` and never see them, nor these replicas theirs."""
INDEX_TAG = "i3"
"""The key letter of the index keys that point at :data:`MANIFEST_TAG` manifests."""
_REF = struct.Struct("<16sQ")
_MAX_BLOB_BYTES = 1 << 40
_ID = re.compile(rb"[0-9a-f]{32}")


def blob_digest(buffer: StateBuffer | bytes) -> bytes:
    """The digest naming ``buffer``'s bytes: XXH3-128, which hashes 20 MB in 1.4 ms on the test machine where SHA-256
    takes 19 ms and BLAKE2b 46 ms. Blobs are written after responses and checked before restores, both on every
    turn, so the digest is a cost of every request. It detects corruption, not forgery (neither does the file
    format's BLAKE2b: anyone who can write the server can write anything); what names and checks a blob is the
    manifest, itself checked by BLAKE2b."""
    return xxhash.xxh3_128_digest(buffer)


@dataclass(frozen=True, slots=True)
class BlobRef:
    """A manifest's reference to one blob."""

    digest: bytes
    length: int

    def encode(self) -> StateBuffer:
        return as_state_buffer(_REF.pack(self.digest, self.length))

    @classmethod
    def decode(cls, data: StateBuffer, where: str) -> BlobRef:
        if data.nbytes != _REF.size:
            raise CorruptFileError(f"{where}: a blob reference is {data.nbytes} bytes, not {_REF.size}")
        digest, length = _REF.unpack(data.tobytes())
        if length > _MAX_BLOB_BYTES:
            raise CorruptFileError(f"{where}: a blob reference names {length} bytes")
        return cls(digest, length)


def check_blob(data: bytes, ref: BlobRef, where: str) -> StateBuffer:
    """``data`` as a read-only state buffer if it is the blob ``ref`` names (length and digest), without copying."""
    if len(data) != ref.length:
        raise CorruptFileError(f"{where}: {len(data)} bytes where the manifest names {ref.length}")
    if blob_digest(data) != ref.digest:
        raise CorruptFileError(f"{where}: digest mismatch (the value is corrupted)")
    return as_state_buffer(data)


def _short(text: str, person: bytes) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8, person=person).hexdigest()


@dataclass(frozen=True)
class Partition:
    """The keys of one (model fingerprint, namespace) partition under ``prefix``.

    ``tagged`` (a cluster's layout) puts the partition's manifests and index keys in one hash slot, with the hash
    tag ``{<fp>:<ns>}``: a lookup's ``MGET`` of index keys, then of manifests, is one node's command whatever the
    number of nodes, and an entry's manifest lands before its index keys (one connection, in order). Blobs carry
    no tag: each is in the slot of its own key, so the bytes spread evenly over the nodes, and a blob several
    entries share (the checkpoints of a conversation, of a system prompt) is still stored once. A single server's
    keys have no tag, as written before clusters were supported.
    """

    prefix: str
    fingerprint: str
    namespace: str
    tagged: bool = False

    @functools.cached_property
    def base(self) -> str:
        """Key prefix of the partition's blobs (and, untagged, of all its keys); its identity in bookkeeping."""
        return f"{self.prefix}:{_short(self.fingerprint, b'ckpt-fp')}:{_short(self.namespace, b'ckpt-ns')}:"

    @functools.cached_property
    def head(self) -> str:
        """Key prefix of the partition's manifests and index keys."""
        if not self.tagged:
            return self.base
        return f"{self.prefix}:{{{_short(self.fingerprint, b'ckpt-fp')}:{_short(self.namespace, b'ckpt-ns')}}}:"

    def key_prefixes(self, every_namespace: bool = False) -> list[str]:
        """The prefixes of the keys of this partition (of every namespace of its model with ``every_namespace``):
        the untagged one (the partition's or model's :attr:`base`, every key of a single server's layout) and the
        tagged one (manifests and index keys in a cluster's)."""
        fp = _short(self.fingerprint, b"ckpt-fp")
        if every_namespace:
            return [f"{self.prefix}:{fp}:", f"{self.prefix}:{{{fp}:"]
        ns = _short(self.namespace, b"ckpt-ns")
        return [f"{self.prefix}:{fp}:{ns}:", f"{self.prefix}:{{{fp}:{ns}}}:"]

    @functools.cached_property
    def _seed(self) -> bytes:
        # The partition is part of every hash, not only of the key's text.
        return f"{len(self.fingerprint)}:{self.fingerprint}\0{len(self.namespace)}:{self.namespace}\0".encode()

    def entry_id(self, tokens: np.ndarray) -> str:
        """The id of the entry holding exactly ``tokens`` (32 hex digits)."""
        digest = hashlib.blake2b(self._seed, digest_size=16, person=b"ckpt-entry")
        digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
        return digest.hexdigest()

    def entry_key(self, entry_id: str) -> str:
        return f"{self.head}{MANIFEST_TAG}:{entry_id}"

    def blob_key(self, digest: bytes) -> str:
        return f"{self.base}b:{digest.hex()}"

    def index_key(self, chained: bytes) -> str:
        return f"{self.head}{INDEX_TAG}:{chained.hex()}"

    def chain(self, tokens: np.ndarray, n_blocks: int | None = None) -> list[bytes]:
        """The chained hashes of the first ``n_blocks`` whole blocks of ``tokens`` (all of them by default)."""
        data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        count = len(tokens) // BLOCK_TOKENS if n_blocks is None else min(n_blocks, len(tokens) // BLOCK_TOKENS)
        hasher = hashlib.blake2b(self._seed, digest_size=16, person=b"ckpt-index")
        step = BLOCK_TOKENS * 4
        out = []
        for block in range(count):
            hasher.update(data[block * step : (block + 1) * step])
            out.append(hasher.copy().digest())
        return out


def parse_entry_id(value: bytes | None) -> str | None:
    """The entry id an index key holds, ``None`` for a missing or malformed value."""
    if value is None or not _ID.fullmatch(value):
        return None
    return value.decode()


MAX_MANIFEST_CHECKPOINTS = 64
"""Checkpoints a manifest names at most (its own and those carried from its lineage, spread as a slot's are)."""


@dataclass(frozen=True)
class Manifest:
    """A manifest as a reader decodes it: an entry whose buffers are blob references (it plans like any candidate:
    tokens, positions and checkpoints are all there), and the references of each of its records."""

    entry: CacheEntry
    refs: Mapping[int, dict[str, BlobRef]]  # id(record) -> {"target": ref, <extra name>: ref, ...}

    @classmethod
    def of(cls, entry: CacheEntry, where: str) -> Manifest:
        """The manifest of ``entry``, whose buffers are encoded :class:`BlobRef` objects."""
        refs = {}
        for record in (entry.state, *entry.checkpoints):
            refs[id(record)] = {TARGET: BlobRef.decode(record.target, where),
                                **{name: BlobRef.decode(buffer, where) for name, buffer in record.extra.items()}}
        return cls(entry, refs)

    def blobs_of(self, records: Sequence[Checkpoint]) -> dict[bytes, BlobRef]:
        """The distinct blobs ``records`` (records of this manifest) reference, by digest."""
        return {ref.digest: ref for record in records for ref in self.refs[id(record)].values()}

    def resolve(self, record: Checkpoint, blobs: Mapping[bytes, StateBuffer]) -> Checkpoint:
        """``record`` with its state bytes (the target's and every extra state's)."""
        refs = self.refs[id(record)]
        return dataclasses.replace(record, target=blobs[refs[TARGET].digest],
                                   extra={name: blobs[ref.digest] for name, ref in refs.items() if name != TARGET})

    def materialize(self, checkpoint: Checkpoint | None, blobs: Mapping[bytes, StateBuffer]) -> CacheEntry:
        """The entry restoring its full state and ``checkpoint`` (one of its records, or ``None``); the other
        checkpoints stay behind, never fetched."""
        entry = self.entry
        checkpoints = (self.resolve(checkpoint, blobs),) if checkpoint is not None else ()
        return CacheEntry(entry.tokens, self.resolve(entry.state, blobs), checkpoints, entry.namespace)


@dataclass(frozen=True)
class Encoded:
    """What writing an entry to the shared tier takes.

    :ivar data: The manifest's bytes.
    :ivar blobs: The state bytes of the entry's own buffers, by digest (written unless the server has them); a paged
        state's page map among them.
    :ivar pages: The pages of the entry's paged states, by id (written, sealed, unless the server has them).
    :ivar paged: The entry's paged states by their page map's digest.
    :ivar carried: Digests of blobs the manifest names from its lineage (stored by earlier entries, not re-sent).
    :ivar manifest: The manifest as a reader will decode it (the lineage of later entries).
    """

    data: bytes
    blobs: dict[bytes, StateBuffer]
    pages: dict[bytes, StateBuffer]
    paged: dict[bytes, PagedState]
    carried: list[bytes]
    manifest: Manifest


def encode_manifest(entry: CacheEntry, digest_of: Callable[[StateBuffer], bytes],
                    lineage: Sequence[Manifest] = ()) -> Encoded:
    """The manifest of ``entry`` (``digest_of`` names a buffer).

    A replica restores one checkpoint of a shared entry and never fetches the others, so its slot holds fewer
    checkpoints than the lineage has. The manifest names them all the same: each checkpoint of a ``lineage``
    manifest taken on a prefix ``entry`` shares is carried over by reference, so a later branch from any replica
    still finds its restore point. At most :data:`MAX_MANIFEST_CHECKPOINTS` are named, spread over the prompt.
    """
    blobs: dict[bytes, StateBuffer] = {}
    pages: dict[bytes, StateBuffer] = {}
    paged: dict[bytes, PagedState] = {}

    def ref(buffer: StateBuffer | PagedState) -> StateBuffer:
        if isinstance(buffer, PagedState):
            page_map = as_state_buffer(encode_page_map(buffer))
            digest = blob_digest(page_map)
            paged[digest] = buffer
            pages.update(buffer.pages_by_id())
            buffer = page_map
        else:
            digest = digest_of(buffer)
        blobs[digest] = buffer
        return BlobRef(digest, int(buffer.nbytes)).encode()

    state, *own = [dataclasses.replace(c, target=ref(c.target),
                                       extra={name: ref(buffer) for name, buffer in c.extra.items()})
                   for c in (entry.state, *entry.checkpoints)]
    by_position = {c.n_tokens: c for c in own}
    carried_from: dict[int, Manifest] = {}
    for manifest in lineage:
        shared = common_prefix(manifest.entry.tokens, entry.tokens)
        for checkpoint in manifest.entry.checkpoints:
            if checkpoint.n_tokens <= shared and checkpoint.n_tokens not in by_position:
                by_position[checkpoint.n_tokens] = checkpoint
                carried_from[id(checkpoint)] = manifest
    checkpoints = sorted(by_position.values(), key=lambda c: c.n_tokens)
    erased = {id(c) for c in checkpoints_to_erase(checkpoints, MAX_MANIFEST_CHECKPOINTS)}
    checkpoints = [c for c in checkpoints if id(c) not in erased]
    carried = [ref.digest for c in checkpoints if id(c) in carried_from
               for ref in carried_from[id(c)].refs[id(c)].values()]
    ref_entry = CacheEntry(entry.tokens, state, tuple(checkpoints), entry.namespace)
    data = encode_entry(ref_entry, model_fingerprint=entry.fingerprint, blob_refs=True)
    return Encoded(data, blobs, pages, paged, carried, Manifest.of(ref_entry, "<written>"))


def decode_manifest(data: bytes, partition: Partition, where: str) -> Manifest:
    """The manifest in ``data``, read from ``partition``'s key ``where``.

    :raises CorruptFileError: Malformed, or recording another namespace than its key's.
    :raises IncompatibleStateError: It records another fingerprint than its key's.
    """
    entry = decode_entry(data, expected_fingerprint=partition.fingerprint, blob_refs=True, label=where)
    if entry.namespace != partition.namespace:
        raise CorruptFileError(f"{where}: the manifest records another namespace than its key")
    return Manifest.of(entry, where)
