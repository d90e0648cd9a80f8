"""The shared tier's keys and values without a server: manifests in the persistence format with blob references,
content-addressed blobs, chained block hashes, and refusal of anything malformed or foreign."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.errors import CorruptFileError, IncompatibleStateError
from ckpt_plugin.persist import FILE_BLOB_REFS, decode_entry, encode_entry, read_entry, write_entry
from ckpt_plugin.tiers.shared.format import (
    BLOCK_TOKENS,
    Partition,
    blob_digest,
    check_blob,
    decode_manifest,
    encode_manifest,
    parse_entry_id,
)

from support import factories
from support.factories import checkpoint, random_bytes

FP = "fingerprint-a"


def make_entry(n_tokens: int = 100, namespace: str = "default", shared: Checkpoint | None = None) -> CacheEntry:
    first = shared or checkpoint(40, pos_min=9, target=random_bytes(300, seed=1), fingerprint=FP,
                                 draft=random_bytes(50, seed=2))
    last = checkpoint(n_tokens - 1, pos_min=n_tokens - 32, target=random_bytes(310, seed=3), fingerprint=FP,
                      speculative=random_bytes(7, seed=4))
    state = checkpoint(n_tokens, partial=False, target=random_bytes(900, seed=5), fingerprint=FP,
                       draft=random_bytes(60, seed=6))
    return factories.entry(np.arange(5, 5 + n_tokens), state=state, checkpoints=(first, last), namespace=namespace)


def test_encode_entry_is_what_write_entry_writes_and_decodes_without_copies(tmp_path: Path) -> None:
    entry = make_entry()
    data = encode_entry(entry, model_fingerprint=FP)
    write_entry(tmp_path / "e", entry, model_fingerprint=FP)
    assert (tmp_path / "e").read_bytes() == data
    decoded = decode_entry(data, expected_fingerprint=FP)
    assert np.array_equal(decoded.tokens, entry.tokens) and decoded.namespace == "default"
    for got, want in zip(decoded.buffers(), entry.buffers()):
        assert np.array_equal(got, want) and not got.flags.writeable and not got.flags.owndata
    with pytest.raises(CorruptFileError, match="blob references expected"):
        decode_entry(data, blob_refs=True)
    with pytest.raises(IncompatibleStateError):
        decode_entry(data, expected_fingerprint="another")


def test_a_manifest_references_each_distinct_buffer_once_and_resolves_only_what_is_asked() -> None:
    entry = make_entry()
    encoded = encode_manifest(entry, blob_digest)
    manifest_bytes, blobs = encoded.data, encoded.blobs
    unique = {id(b): b for b in entry.buffers()}
    assert len(blobs) == len(unique)
    assert len(manifest_bytes) < 2000  # tokens and references: no state bytes
    partition = Partition("ckpt", FP, "default")
    manifest = decode_manifest(manifest_bytes, partition, "key")
    records = [manifest.entry.state, manifest.entry.checkpoints[1]]
    wanted = manifest.blobs_of(records)
    assert len(wanted) == 4  # full state + draft, last checkpoint + speculative
    restored = manifest.materialize(manifest.entry.checkpoints[1], {d: blobs[d] for d in wanted})
    assert restored.n_tokens == entry.n_tokens and len(restored.checkpoints) == 1
    assert restored.checkpoints[0].n_tokens == entry.checkpoints[1].n_tokens
    assert restored.checkpoints[0].speculative is blobs[blob_digest(entry.checkpoints[1].speculative)]
    assert restored.state.draft is not None and np.array_equal(restored.state.target, entry.state.target)


def test_entries_sharing_a_checkpoint_share_its_blob() -> None:
    shared = checkpoint(40, pos_min=9, target=random_bytes(300, seed=1), fingerprint=FP)
    blobs_a = encode_manifest(make_entry(100, shared=shared), blob_digest).blobs
    blobs_b = encode_manifest(make_entry(120, shared=shared), blob_digest).blobs
    assert blob_digest(shared.target) in blobs_a and blob_digest(shared.target) in blobs_b


def test_a_manifest_names_the_checkpoints_of_its_lineage_that_the_slot_no_longer_holds() -> None:
    first = encode_manifest(make_entry(100), blob_digest)
    # a replica restored the last checkpoint only, then went on: its entry has that one and a new one
    restored = first.manifest.entry.checkpoints[1]
    tokens = np.concatenate((np.arange(5, 104, dtype=np.int32), np.arange(900, 950, dtype=np.int32)))
    state = checkpoint(len(tokens), partial=False, target=random_bytes(800, seed=7), fingerprint=FP)
    newer = checkpoint(140, pos_min=100, target=random_bytes(300, seed=8), fingerprint=FP)
    held = checkpoint(restored.n_tokens, pos_min=restored.pos_min, pos_max=restored.pos_max,
                      target=random_bytes(310, seed=3), fingerprint=FP)
    second = encode_manifest(factories.entry(tokens, state=state, checkpoints=(held, newer)), blob_digest,
                             [first.manifest])
    positions = [c.n_tokens for c in second.manifest.entry.checkpoints]
    assert positions == [40, 99, 140]  # the lineage's first checkpoint is named again, by reference
    assert set(second.carried) == set(first.manifest.blobs_of([first.manifest.entry.checkpoints[0]]))
    assert not set(second.carried) & set(second.blobs)  # carried blobs are not sent again
    # a lineage that left the prompt earlier carries nothing past the divergence
    diverged = np.concatenate((np.arange(5, 30, dtype=np.int32), np.arange(700, 800, dtype=np.int32)))
    other = factories.entry(diverged, state=checkpoint(len(diverged), partial=False, target=random_bytes(80, seed=9),
                                                       fingerprint=FP))
    assert encode_manifest(other, blob_digest, [first.manifest]).manifest.entry.checkpoints == ()


def test_manifests_refuse_files_foreign_partitions_and_malformed_references(tmp_path: Path) -> None:
    entry = make_entry(namespace="key:aaaa")
    data = encode_manifest(entry, blob_digest).data
    # a manifest is not a slot file: the required flag stops the file reader
    (tmp_path / "m").write_bytes(data)
    with pytest.raises(CorruptFileError, match="unknown required file flags"):
        read_entry(tmp_path / "m")
    with pytest.raises(CorruptFileError, match="another namespace"):
        decode_manifest(data, Partition("ckpt", FP, "key:bbbb"), "k")
    with pytest.raises(IncompatibleStateError):
        decode_manifest(data, Partition("ckpt", "other-model", "key:aaaa"), "k")
    for cut in (0, 7, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptFileError):
            decode_manifest(data[:cut], Partition("ckpt", FP, "key:aaaa"), "k")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    with pytest.raises(CorruptFileError):
        decode_manifest(bytes(flipped), Partition("ckpt", FP, "key:aaaa"), "k")
    # a well-formed entry whose "references" are not 24 bytes
    plain = encode_entry(entry, model_fingerprint=FP)
    forged = bytearray(plain)
    struct.pack_into("<I", forged, 12, FILE_BLOB_REFS)  # header digest now wrong: refused either way
    with pytest.raises(CorruptFileError):
        decode_manifest(bytes(forged), Partition("ckpt", FP, "key:aaaa"), "k")
    wrong_size = factories.entry(entry.tokens, namespace="key:aaaa",
                                 state=checkpoint(100, partial=False, target=random_bytes(39, seed=9), fingerprint=FP))
    with pytest.raises(CorruptFileError, match="blob reference"):
        decode_manifest(encode_entry(wrong_size, model_fingerprint=FP, blob_refs=True),
                        Partition("ckpt", FP, "key:aaaa"), "k")


def test_blobs_are_checked_by_length_and_digest() -> None:
    entry = make_entry()
    encoded = encode_manifest(entry, blob_digest)
    digest, buffer = next(iter(encoded.blobs.items()))
    manifest = decode_manifest(encoded.data, Partition("ckpt", FP, "default"), "k")
    ref = manifest.blobs_of([manifest.entry.state, *manifest.entry.checkpoints])[digest]
    data = buffer.tobytes()
    checked = check_blob(data, ref, "k")
    assert np.array_equal(checked, buffer) and not checked.flags.writeable
    with pytest.raises(CorruptFileError, match="bytes where"):
        check_blob(data[:-1], ref, "k")
    with pytest.raises(CorruptFileError, match="digest"):
        check_blob(bytes([data[0] ^ 1]) + data[1:], ref, "k")


def test_keys_and_chained_hashes_separate_partitions_and_prefixes() -> None:
    tokens = np.arange(3 * BLOCK_TOKENS + 5, dtype=np.int32)
    a = Partition("ckpt", FP, "default")
    chain = a.chain(tokens)
    assert len(chain) == 3 and len(set(chain)) == 3
    # the hash of block j depends on every earlier token
    edited = tokens.copy()
    edited[0] += 1
    assert not set(a.chain(edited)) & set(chain)
    assert a.chain(tokens[: 2 * BLOCK_TOKENS]) == chain[:2]
    assert a.chain(tokens, 1) == chain[:1]
    others = [Partition("ckpt", FP, "key:1"), Partition("ckpt", "fp-b", "default"), Partition("other", FP, "default")]
    for other in others:
        assert other.base != a.base
        assert other.entry_id(tokens) != a.entry_id(tokens) or other.prefix != a.prefix
        assert other.index_key(other.chain(tokens)[0]) != a.index_key(chain[0])
    assert a.entry_id(tokens) != a.entry_id(tokens[:-1])
    assert parse_entry_id(a.entry_id(tokens).encode()) == a.entry_id(tokens)
    for garbage in (None, b"", b"x" * 32, b"0" * 31, b"0" * 33, b"../../etc"):
        assert parse_entry_id(garbage) is None
