"""Extra state by name: a plugin's own blob rides with every checkpoint through RAM, disk files and the shared tier,
files and manifests of format 2.0 store each extra state with its name, and those of 1.0 (a draft and a speculative
blob in fixed places) still load."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from ckpt_plugin import persist
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint, ExtraState
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.plugins.hookspecs import hookimpl, restored_extra
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.persist import decode_entry, encode_entry, read_entry, read_header, write_entry
from ckpt_plugin.services.publishing import publish
from ckpt_plugin.tiers.shared.format import Partition, blob_digest, decode_manifest, encode_manifest
from ckpt_plugin.tiers.shared.tier import SharedTier
from ckpt_plugin.testing import fake_manager, run_prompt
from ckpt_plugin.tiers.protocol import Query

from support import factories
from support.factories import checkpoint, random_bytes, token_run
from support.redis_servers import RedisServer

FP = "model-a/ctx=1024"


def blob(seed: int, n: int) -> np.ndarray:
    return random_bytes(n, seed)


def make_entry(extra: dict[str, int], n_tokens: int = 40, namespace: str = "ns") -> CacheEntry:
    """An entry whose full state and two checkpoints carry an extra state of each name (of that many bytes)."""

    def record(n: int, seed: int, partial: bool) -> Checkpoint:
        named = {name: blob(seed * 100 + i, size) for i, (name, size) in enumerate(extra.items())}
        return checkpoint(n, pos_min=max(-1, n - 32), partial=partial, target=blob(seed, 300 + seed), fingerprint=FP,
                          extra=named)

    return factories.entry(token_run(7, n_tokens), state=record(n_tokens, 1, False),
                           checkpoints=(record(16, 2, True), record(32, 3, True)), namespace=namespace)


def assert_same(read: CacheEntry, original: CacheEntry) -> None:
    assert np.array_equal(read.tokens, original.tokens) and read.namespace == original.namespace
    for got, want in zip((read.state, *read.checkpoints), (original.state, *original.checkpoints), strict=True):
        assert (got.n_tokens, got.pos_min, got.pos_max, got.partial) == (
            want.n_tokens, want.pos_min, want.pos_max, want.partial)
        assert np.array_equal(got.target, want.target)
        assert list(got.extra) == sorted(want.extra)
        for name, buffer in want.extra.items():
            assert np.array_equal(got.extra[name], buffer) and not got.extra[name].flags.writeable


# ---------------------------------------------------------------------------------------------------------------------
# format 1.0, as earlier versions wrote it


def _pad(out: bytearray) -> None:
    out += bytes(-len(out) % 64)


def encode_v1(entry: CacheEntry, blob_refs: bool = False) -> bytes:
    """``entry`` in the 1.0 layout: the header of every version (version 1.0), then per state record a 64-byte header
    with three blob lengths (target, draft, speculative) and flags saying which are present, then their payloads."""
    tokens = np.ascontiguousarray(entry.tokens, dtype="<i4")
    fingerprint, namespace = entry.fingerprint.encode(), entry.namespace.encode()
    records = (entry.state, *entry.checkpoints)
    out = bytearray(struct.pack("<8sHHIII", b"CKPTSLOT", 1, 0, int(blob_refs), len(records), len(fingerprint)))
    out += fingerprint + struct.pack("<I", len(namespace)) + namespace + struct.pack("<Q", len(tokens))
    _pad(out)
    out += tokens.tobytes()
    out += hashlib.blake2b(bytes(out), digest_size=32).digest()
    _pad(out)
    for record in records:
        assert set(record.extra) <= {"draft", "speculative"}, "1.0 had no other extra states"
        blobs = [record.target, record.draft, record.speculative]
        flags = int(record.partial) | sum(1 << (i + 1) for i, b in enumerate(blobs) if b is not None)
        lengths = [0 if b is None else b.nbytes for b in blobs]
        out += struct.pack("<qqqIIQQQQ", record.n_tokens, record.pos_min, record.pos_max, flags, 0, *lengths, 0)
        for b in blobs:
            if b is not None:
                out += b.tobytes()
                _pad(out)
    body = len(out)
    out += struct.pack("<Q32s8s", body, hashlib.blake2b(bytes(out), digest_size=32).digest(), b"CKPT_END")
    return bytes(out)


@pytest.mark.parametrize("extra", [{}, {"draft": 70}, {"speculative": 0}, {"draft": 129, "speculative": 64}])
def test_files_of_version_1_still_load(tmp_path: Path, extra: dict[str, int]) -> None:
    entry = make_entry(extra)
    path = tmp_path / "old.ckpt"
    path.write_bytes(encode_v1(entry))
    assert read_header(path, expected_fingerprint=FP).version == (1, 0)
    assert_same(read_entry(path, expected_fingerprint=FP), entry)
    assert_same(decode_entry(path.read_bytes(), expected_fingerprint=FP), entry)
    # A disk tier indexes and serves the files an earlier version left in its directory.
    tier = DiskTier(tmp_path, 1 << 20)
    assert len(tier) == 1 and tier.corrupt_files == 0
    (hit,) = tier.find(Query("ns", FP, entry.tokens, None, len(entry.tokens) - 1))
    loaded = hit.fetch()
    assert loaded is not None
    assert_same(loaded, entry)
    # Writing it again writes the newest version, which reads back the same.
    write_entry(tmp_path / "new", loaded, model_fingerprint=FP)
    assert read_header(tmp_path / "new").version == persist.FORMAT_VERSION == (2, 0)
    assert_same(read_entry(tmp_path / "new"), entry)


def test_a_forged_version_1_record_is_still_refused() -> None:
    data = bytearray(encode_v1(make_entry({"draft": 10})))
    data[records_offset(bytes(data)) + 24] |= 1 << 5  # an unknown record flag
    with pytest.raises(CorruptFileError, match="unknown flags"):
        decode_entry(resealed(data))


# ---------------------------------------------------------------------------------------------------------------------
# format 2.0: extra states by name


def test_every_extra_state_is_stored_with_its_name(tmp_path: Path) -> None:
    entry = make_entry({"mytool": 33, "draft": 12, "a.b:c-d_9": 0, "speculative": 5})
    data = encode_entry(entry, model_fingerprint=FP)
    for name in (b"mytool", b"draft", b"a.b:c-d_9", b"speculative"):
        assert name in data
    read = decode_entry(data, expected_fingerprint=FP)
    assert_same(read, entry)
    assert list(read.state.extra) == ["a.b:c-d_9", "draft", "mytool", "speculative"]  # name order
    assert read.state.draft is read.state.extra["draft"] and read.state.speculative is read.state.extra["speculative"]
    path = tmp_path / "slot"
    write_entry(path, entry, model_fingerprint=FP)
    assert path.read_bytes() == data and read_header(path).version == (2, 0)
    assert_same(read_entry(path), entry)


def one_token_checkpoint(**named: Any) -> Checkpoint:
    return Checkpoint(n_tokens=1, pos_min=0, pos_max=0, partial=True, target=blob(1, 3), fingerprint=FP, **named)


def test_extra_state_names_are_checked() -> None:
    for name in ("", "target", "x" * 49, "has space", ".hidden", "-dash", "é", "a/b"):
        with pytest.raises(ValueError):
            ExtraState(name, np.zeros(1, np.uint8))
        with pytest.raises(ValueError):
            one_token_checkpoint(extra={name: blob(2, 1)})
    assert ExtraState("x" * 48, np.zeros(1, np.uint8)).name == "x" * 48
    with pytest.raises(ValueError, match="frozen"):
        one_token_checkpoint(extra={"mytool": np.zeros(2, np.uint8)})
    # The shorthands are names of the mapping.
    both = one_token_checkpoint(extra={"mytool": blob(2, 1)}, draft=blob(3, 2))
    assert list(both.extra) == ["draft", "mytool"] and both.speculative is None
    assert both.nbytes == 3 + 1 + 2 and len(list(both.buffers())) == 3
    assert dataclasses.replace(both, target=blob(4, 5)).extra == both.extra


def records_offset(data: bytes) -> int:
    """Where the first state record of a file starts."""
    fp_len = struct.unpack_from("<I", data, 20)[0]
    ns_len = struct.unpack_from("<I", data, 24 + fp_len)[0]
    offset = 28 + fp_len + ns_len
    n_tokens = struct.unpack_from("<Q", data, offset)[0]
    offset += 8
    offset += -offset % 64 + 4 * n_tokens + 32
    return offset + -offset % 64


def resealed(data: bytearray) -> bytes:
    """``data`` with the trailer's digest recomputed: a forged file, refused for what it holds, not its digest."""
    body = len(data) - 48
    data[body:] = struct.pack("<Q32s8s", body, hashlib.blake2b(bytes(data[:body]), digest_size=32).digest(),
                              b"CKPT_END")
    return bytes(data)


def extra_records(data: bytes) -> list[int]:
    """Offsets of the extra records of a 2.0 file."""
    offset = records_offset(data)
    found = []
    for _ in range(struct.unpack_from("<I", data, 16)[0]):
        length, n_extras = struct.unpack_from("<QI", data, offset + 32)
        offset += 64 + length + -length % 64
        for _ in range(n_extras):
            found.append(offset)
            length = struct.unpack_from("<Q", data, offset + 8)[0]
            offset += 64 + length + -length % 64
    assert offset == len(data) - 48
    return found


@pytest.mark.parametrize("forge, problem", [
    (lambda d, at: d.__setitem__(slice(at, at + 4), b"STAT"), "not an extra record"),
    (lambda d, at: struct.pack_into("<I", d, at + 4, 0), "malformed name"),
    (lambda d, at: struct.pack_into("<I", d, at + 4, 49), "malformed name"),
    (lambda d, at: d.__setitem__(at + 16 + 20, 1), "malformed name"),  # a byte past the name's length
    (lambda d, at: d.__setitem__(at + 16, ord(" ")), "invalid name"),
    (lambda d, at: d.__setitem__(slice(at + 16, at + 17), b"z"), "out of order"),  # "alpha" -> "zlpha" > "beta"
    (lambda d, at: (struct.pack_into("<I", d, at + 4, 4), d.__setitem__(slice(at + 16, at + 21), b"beta\0")),
     "out of order or repeated"),  # a name twice
    (lambda d, at: struct.pack_into("<Q", d, at + 8, 1 << 40), "exceeds"),
])
def test_malformed_extra_records_are_refused(tmp_path: Path, forge: Callable[[bytearray, int], None],
                                             problem: str) -> None:
    entry = make_entry({"alpha": 5, "beta": 7})
    data = bytearray(encode_entry(entry, model_fingerprint=FP))
    forge(data, extra_records(bytes(data))[0])
    forged = resealed(data)
    with pytest.raises(CorruptFileError, match=problem) as info:
        decode_entry(forged)
    assert info.value.offset is not None
    (tmp_path / "f").write_bytes(forged)
    with pytest.raises(CorruptFileError, match=problem):
        read_entry(tmp_path / "f")


def test_too_many_extra_states_are_refused() -> None:
    extra = {f"n{i:02d}": 1 for i in range(persist.MAX_EXTRAS + 1)}
    with pytest.raises(ValueError, match="extra states"):
        encode_entry(make_entry(extra), model_fingerprint=FP)


# ---------------------------------------------------------------------------------------------------------------------
# the shared tier's manifests


def test_manifests_name_every_extra_state_and_those_of_version_1_still_decode() -> None:
    partition = Partition("ckpt", FP, "ns")
    entry = make_entry({"mytool": 20, "draft": 9})
    encoded = encode_manifest(entry, blob_digest)
    manifest = decode_manifest(encoded.data, partition, "k")
    assert set(manifest.refs[id(manifest.entry.state)]) == {"target", "mytool", "draft"}
    checkpoint = manifest.entry.checkpoints[1]
    wanted = manifest.blobs_of([manifest.entry.state, checkpoint])
    restored = manifest.materialize(checkpoint, {digest: encoded.blobs[digest] for digest in wanted})
    assert np.array_equal(restored.checkpoints[0].extra["mytool"], entry.checkpoints[1].extra["mytool"])
    assert restored.state.extra["mytool"] is encoded.blobs[blob_digest(entry.state.extra["mytool"])]
    # A manifest an earlier replica wrote (1.0: draft and speculative references in fixed places).
    old = make_entry({"draft": 9, "speculative": 4})
    refs = encode_manifest(old, blob_digest)
    old_manifest = decode_manifest(encode_v1(refs.manifest.entry, blob_refs=True), partition, "k")
    assert set(old_manifest.refs[id(old_manifest.entry.state)]) == {"target", "draft", "speculative"}
    records = [old_manifest.entry.state, *old_manifest.entry.checkpoints]
    whole = old_manifest.materialize(old_manifest.entry.checkpoints[0], refs.blobs)
    assert len(old_manifest.blobs_of(records)) == len(refs.blobs)
    assert np.array_equal(whole.state.draft, old.state.draft)
    assert np.array_equal(whole.checkpoints[0].speculative, old.checkpoints[0].speculative)


# ---------------------------------------------------------------------------------------------------------------------
# a plugin's own state through every tier


class MyTool:
    """Contributes an extra state named ``mytool`` to every capture (the tokens it was taken on), and checks what
    comes back with every restore."""

    def __init__(self) -> None:
        self.restored: list[int] = []

    @hookimpl
    def on_checkpoint_capture(self, manager: Any, slot: Any, n_tokens: int, partial: bool) -> ExtraState:
        return ExtraState("mytool", np.asarray([n_tokens, *slot.tokens[:n_tokens]], np.int32).view(np.uint8))

    @hookimpl
    def on_slot_restore(self, manager: Any, slot: Any, checkpoint: Checkpoint | None, entry: CacheEntry | None,
                        n_tokens: int) -> None:
        data = restored_extra("mytool", checkpoint, entry)
        state = checkpoint if checkpoint is not None else entry.state if entry is not None else None
        assert data is not None and state is not None
        values = np.frombuffer(data, np.int32)
        assert int(values[0]) == state.n_tokens
        lineage = entry.tokens if entry is not None else slot.lineage
        assert np.array_equal(values[1:], lineage[: state.n_tokens])
        self.restored.append(state.n_tokens)


def holds_mytool(record: Checkpoint, tokens: np.ndarray) -> bool:
    values = np.frombuffer(record.extra["mytool"], np.int32)
    return int(values[0]) == record.n_tokens and np.array_equal(values[1:], tokens[: record.n_tokens])


@pytest.mark.parametrize("kind", ["gemma3", "mamba"])
def test_a_plugins_extra_state_round_trips_through_ram_disk_and_the_shared_tier(
    make_llama: Callable[..., Any], redis_server: RedisServer, tmp_path: Path, kind: str
) -> None:
    from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceContext

    llama = make_llama(kind)
    rng = np.random.default_rng(3)
    prompt = rng.integers(5, 300, 200).astype(np.int32)
    follow_up = np.concatenate([prompt, rng.integers(5, 300, 10).astype(np.int32)])
    branch = np.concatenate([prompt[:150], rng.integers(5, 300, 20).astype(np.int32)])
    made: list[tuple[CheckpointManager, Any]] = []

    def engine(disk: bool, shared: bool) -> tuple[CheckpointManager, MyTool]:
        context = SequenceContext(llama, n_seq=1)
        tier = SharedTier(redis_server.url, prefix=f"named-{kind}", timeout=2.0) if shared else None
        manager = CheckpointManager(context.sequence(0), load_entrypoints=False, checkpoint_min_step=32,
                                    disk_dir=str(tmp_path / "disk") if disk else None, shared=tier)
        plugin = MyTool()
        manager.plugins.register(plugin, name="mytool")
        made.append((manager, context))
        return manager, plugin

    def serve(manager: CheckpointManager, tokens: np.ndarray) -> int:
        n_keep = manager.primary.prepare(tokens)
        manager.primary.process(tokens[n_keep:])
        return n_keep

    try:
        writer, _ = engine(disk=True, shared=True)
        serve(writer, prompt)
        entry = writer.primary.save_to_cache()  # RAM, written through to disk, queued for the shared tier
        assert entry is not None and writer.store.shared is not None and writer.store.shared.drain(20)
        assert all(holds_mytool(r, prompt) for r in (entry.state, *entry.checkpoints))
        assert len(entry.checkpoints) >= 2
        # RAM: the writer serves another prompt, then comes back.
        serve(writer, rng.integers(5, 300, 120).astype(np.int32))
        hits = writer.counters.cache_hits
        plugin = writer.plugins.get_plugin("mytool")
        assert serve(writer, follow_up) == len(prompt) and writer.counters.cache_hits == hits + 1
        assert plugin.restored[-1] == len(prompt)
        # Disk: a new engine with a RAM tier of its own reads the file.
        reader, plugin = engine(disk=True, shared=False)
        assert serve(reader, follow_up) == len(prompt) and reader.counters.disk_hits == 1
        assert plugin.restored == [len(prompt)]
        # Shared tier: an engine with neither restores from Redis, the full state and a checkpoint of a branch.
        remote, plugin = engine(disk=False, shared=True)
        kept = serve(remote, branch)
        assert 0 < kept <= 150 and remote.store.shared is not None and remote.store.shared.counters.hits == 1
        assert plugin.restored and plugin.restored[0] <= 150
        assert serve(remote, follow_up) == len(prompt) and plugin.restored[-1] == len(prompt)
    finally:
        for manager, context in made:
            if manager.store.shared is not None:
                manager.store.shared.close()
            manager.close()
            context.close()


def test_a_manifest_of_version_1_on_the_server_is_restored(redis_server: RedisServer) -> None:
    """A replica restores what a replica of the earlier version wrote: its 1.0 manifest, with a speculative
    state, stands in for the one the writer here wrote."""

    class Speculative:
        def __init__(self) -> None:
            self.restored: list[tuple[int, int]] = []  # (tokens of the state restored, tokens its extra state says)

        @hookimpl
        def on_checkpoint_capture(self, manager: Any, slot: Any, n_tokens: int, partial: bool) -> ExtraState:
            return ExtraState("speculative", np.asarray([n_tokens], np.int64).view(np.uint8))

        @hookimpl
        def on_slot_restore(self, manager: Any, slot: Any, checkpoint: Any, entry: Any, n_tokens: int) -> None:
            data = restored_extra("speculative", checkpoint, entry)
            state = checkpoint if checkpoint is not None else entry.state
            self.restored.append((state.n_tokens, -1 if data is None else int(np.frombuffer(data, np.int64)[0])))

    prompt = list(range(10, 210))

    def replica() -> CheckpointManager:
        manager = fake_manager("swa", shared=SharedTier(redis_server.url, prefix="old", timeout=2.0),
                               checkpoint_min_step=64)
        manager.plugins.register(Speculative(), name="speculative")
        return manager

    writer, reader = replica(), replica()
    try:
        run_prompt(writer, prompt, 2)
        assert publish(writer) and writer.store.shared is not None and writer.store.shared.drain(20)
        client = redis_server.client()
        (key,) = [k for k in client.scan_iter(match="old:*") if k.split(b":")[-2] == b"e3"]
        partition = Partition("old", writer.fingerprint, "default")
        manifest = decode_manifest(client.get(key), partition, key.decode())
        client.set(key, encode_v1(manifest.entry, blob_refs=True))
        kept = len(prompt) + 3 - run_prompt(reader, prompt + [7, 8, 99], 0)
        assert kept >= len(prompt) and reader.store.shared is not None
        assert reader.store.shared.counters.hits == 1 and reader.store.shared.counters.corrupt == 0
        restored = reader.plugins.get_plugin("speculative").restored
        assert restored and all(n_state == n_saved for n_state, n_saved in restored)
    finally:
        for manager in (writer, reader):
            assert manager.store.shared is not None
            manager.store.shared.close()
            manager.close()
