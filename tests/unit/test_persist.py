"""The on-disk format without a model: round trips, reads into private buffers, refusal of malformed files, atomic writes."""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from typing import Any
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_plugin import persist
from ckpt_plugin.persist import layout, write as persist_write
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint, StateBufferPool, freeze
from ckpt_plugin.core.errors import CheckpointError, IncompatibleStateError
from ckpt_plugin.persist import (
    ALIGNMENT,
    CorruptFileError,
    UnsafePathError,
    iter_entry_files,
    read_entry,
    read_header,
    remove_stale_temp_files,
    safe_path,
    write_entry,
)

from support import factories
from support.factories import checkpoint, random_bytes, token_run

FP = "model-a/ctx=1024/f16"
SLACK = 64 * 1024
REPO = Path(__file__).resolve().parents[2]


def state(n_tokens: int, n_bytes: int, partial: bool, seed: int = 0, draft: int | None = None,
          speculative: int | None = None, fingerprint: str = FP) -> Checkpoint:
    return checkpoint(
        n_tokens, pos_min=max(-1, n_tokens - 32) if n_tokens else -1, partial=partial,
        target=random_bytes(n_bytes, seed), fingerprint=fingerprint,
        draft=None if draft is None else random_bytes(draft, seed + 1000),
        speculative=None if speculative is None else random_bytes(speculative, seed + 2000),
    )


def make_entry(n_tokens: int = 10, n_checkpoints: int = 2, n_bytes: int = 300, draft: int | None = None,
               speculative: int | None = None, namespace: str = "default", fingerprint: str = FP) -> CacheEntry:
    checkpoints = tuple(
        state(n_tokens * (i + 1) // (n_checkpoints + 1), n_bytes // 3 + i, True, seed=i + 1, draft=draft,
              speculative=speculative, fingerprint=fingerprint)
        for i in range(n_checkpoints)
    )
    return factories.entry(token_run(100, n_tokens), checkpoints=checkpoints, namespace=namespace,
                           state=state(n_tokens, n_bytes, False, draft=draft, speculative=speculative,
                                       fingerprint=fingerprint))


def mapping_of(array: np.ndarray) -> object:
    """The object at the end of ``array``'s base chain (a pool buffer's anonymous mmap)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def assert_same_entry(read: CacheEntry, original: CacheEntry, fingerprint: str = FP) -> None:
    assert read.tokens.dtype == np.int32 and read.tokens.ndim == 1
    assert np.array_equal(read.tokens, original.tokens)
    assert read.namespace == original.namespace
    assert read.fingerprint == fingerprint
    assert len(read.checkpoints) == len(original.checkpoints)
    for got, want in zip((read.state, *read.checkpoints), (original.state, *original.checkpoints)):
        assert (got.n_tokens, got.pos_min, got.pos_max, got.partial) == (
            want.n_tokens, want.pos_min, want.pos_max, want.partial)
        assert got.fingerprint == fingerprint
        for name in ("target", "draft", "speculative"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == np.uint8 and a.ndim == 1
                assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("n_checkpoints", [0, 1, 5])
@pytest.mark.parametrize("draft, speculative", [(None, None), (70, None), (None, 1), (129, 64), (0, 0)])
def test_round_trip(tmp_path: Path, n_checkpoints: int, draft: int | None, speculative: int | None) -> None:
    entry = make_entry(n_tokens=37, n_checkpoints=n_checkpoints, n_bytes=1000, draft=draft, speculative=speculative,
                       namespace="tenant-7")
    path = tmp_path / "slot.bin"
    written = write_entry(path, entry, model_fingerprint=FP)
    assert written == path.stat().st_size
    read = read_entry(path, expected_fingerprint=FP)
    assert_same_entry(read, entry)
    header = read_header(path, expected_fingerprint=FP)
    assert (header.fingerprint, header.namespace, header.n_tokens, header.file_size, header.n_checkpoints) == (
        FP, "tenant-7", 37, written, n_checkpoints)
    assert np.array_equal(header.tokens, entry.tokens) and not header.tokens.flags.writeable


@pytest.mark.parametrize("n_checkpoints", [0, 2])
def test_round_trip_of_empty_tokens_and_empty_blobs(tmp_path: Path, n_checkpoints: int) -> None:
    tokens = np.zeros(0, dtype=np.int32)
    empty = checkpoint(0, pos_min=-1, partial=False, n_bytes=0, fingerprint=FP)
    checkpoints = tuple(checkpoint(0, pos_min=-1, n_bytes=0, fingerprint=FP, draft=random_bytes(5))
                        for _ in range(n_checkpoints))
    entry = factories.entry(tokens, state=empty, checkpoints=checkpoints, namespace="")
    path = tmp_path / "empty"
    write_entry(path, entry, model_fingerprint=FP)
    read = read_entry(path)
    assert_same_entry(read, entry)
    assert read.n_tokens == 0 and read.state.target.nbytes == 0 and not read.tokens.flags.writeable
    assert read_header(path).n_tokens == 0
    if n_checkpoints == 0:
        assert path.stat().st_size == layout.MIN_FILE_SIZE


def test_read_buffers_are_read_only_aligned_private_buffers(tmp_path: Path) -> None:
    entry = make_entry(n_tokens=50, n_checkpoints=3, n_bytes=999, draft=77, speculative=3)
    path = tmp_path / "slot"
    write_entry(path, entry, model_fingerprint=FP)
    read = read_entry(path)
    blobs = list(read.buffers())
    # Each blob is a state buffer of its own (a private anonymous mapping of the pool), never the file's pages:
    # the cache counts and frees each one like a capture, and nothing done to the file can reach them.
    mappings = {id(mapping_of(b)) for b in blobs}
    assert len(mappings) == len(blobs) and all(isinstance(mapping_of(b), mmap.mmap) for b in blobs)
    for b in [read.tokens, *blobs]:
        assert not b.flags.writeable and not b.flags.owndata
        assert b.ctypes.data % ALIGNMENT == 0, "payloads must be 64-byte aligned for C consumers"
        with pytest.raises(ValueError):
            b[:1] = 0
    buffers = [read.tokens, *blobs]
    for i, a in enumerate(buffers):
        for b in buffers[i + 1:]:
            if a.nbytes and b.nbytes:
                assert not np.shares_memory(a, b)


def test_reading_puts_state_bytes_in_pool_buffers_not_the_heap(tmp_path: Path) -> None:
    big = checkpoint(4, partial=False, target=freeze(np.full(32 << 20, 7, np.uint8)), fingerprint=FP)
    entry = factories.entry(np.arange(4), state=big)
    path = tmp_path / "big"
    size = write_entry(path, entry, model_fingerprint=FP)
    peaks, reads = [], []
    # tracemalloc counts every thread's allocations: another thread's can land in the window, so the read is
    # measured up to three times (a read that allocates the state on the heap does so every time).
    for _ in range(3):
        pool = StateBufferPool(0, spares=False)
        tracemalloc.start()
        try:
            reads.append((read_entry(path, pool=pool), pool))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        if peaks[-1] < SLACK:
            break
    peak = min(peaks)
    read, pool = reads[peaks.index(peak)]
    assert peak < SLACK, f"reading a {size}-byte file allocated {peak} bytes on the heap"
    assert pool.mapped == 1, "the state went into one buffer of the given pool"
    assert read.state.target.nbytes == 32 << 20 and int(read.state.target[-1]) == 7


def test_writes_hand_the_buffers_themselves_to_the_file_in_chunks(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    entry = make_entry(n_checkpoints=1, n_bytes=1000, draft=200)
    chunks: list[memoryview] = []
    real = persist_write._write_chunk

    def recording(file, chunk):  # noqa: ANN001
        chunks.append(chunk)
        return real(file, chunk)

    monkeypatch.setattr(persist_write, "_write_chunk", recording)
    monkeypatch.setattr(persist_write, "CHUNK_SIZE", 256)
    path = tmp_path / "slot"
    write_entry(path, entry, model_fingerprint=FP)
    from_target = [c for c in chunks if c.obj is entry.state.target]
    assert len(from_target) == 4, "a 1000-byte blob in 256-byte chunks, each a view of the buffer itself"
    assert any(c.obj is entry.state.draft for c in chunks)
    assert max(len(c) for c in chunks) <= 256
    assert_same_entry(read_entry(path), entry)


def test_an_entry_read_stays_valid_when_the_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    first = make_entry(n_bytes=500)
    write_entry(path, first, model_fingerprint=FP)
    read = read_entry(path)
    write_entry(path, make_entry(n_tokens=3, n_checkpoints=0, n_bytes=100), model_fingerprint=FP)
    assert_same_entry(read, first)
    assert read_entry(path).n_tokens == 3


texts = st.text(max_size=20)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    blobs=st.lists(st.tuples(st.integers(0, 300), st.none() | st.integers(0, 130), st.none() | st.integers(0, 70),
                             st.booleans()), min_size=1, max_size=5),
    namespace=texts,
    fingerprint=texts,
)
def test_round_trip_property(tmp_path: Path, tokens: list[int], blobs: list, namespace: str, fingerprint: str) -> None:
    array = np.asarray(tokens, dtype=np.int32)
    n = len(array)
    states = [
        checkpoint(n if i == 0 else n * i // len(blobs), pos_min=-1, pos_max=max(-1, n - 1),
                   partial=partial and i > 0,
                   target=random_bytes(target, i), fingerprint=fingerprint,
                   draft=None if draft is None else random_bytes(draft, i + 10),
                   speculative=None if spec is None else random_bytes(spec, i + 20))
        for i, (target, draft, spec, partial) in enumerate(blobs)
    ]
    entry = factories.entry(array, state=states[0], checkpoints=states[1:], namespace=namespace)
    path = tmp_path / "prop"
    write_entry(path, entry, model_fingerprint=fingerprint)
    assert_same_entry(read_entry(path, expected_fingerprint=fingerprint), entry, fingerprint)


# ---------------------------------------------------------------------------------------------------------------------
# refusals


def test_fingerprint_mismatch_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    write_entry(path, make_entry(), model_fingerprint=FP)
    for reader in (read_entry, read_header):
        with pytest.raises(IncompatibleStateError) as info:
            reader(path, expected_fingerprint="model-b")
        assert FP in str(info.value) and "model-b" in str(info.value)


def test_writing_another_models_state_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    with pytest.raises(IncompatibleStateError):
        write_entry(path, make_entry(), model_fingerprint="model-b")
    assert list(tmp_path.iterdir()) == []


def written(tmp_path: Path, entry: CacheEntry | None = None) -> tuple[Path, bytearray]:
    path = tmp_path / "slot"
    write_entry(path, entry or make_entry(draft=20), model_fingerprint=FP)
    return path, bytearray(path.read_bytes())


def expect_corrupt(path: Path, data: bytes, *words: str) -> CorruptFileError:
    path.write_bytes(data)
    with pytest.raises(CorruptFileError) as info:
        read_entry(path)
    message = str(info.value)
    assert isinstance(info.value, CheckpointError)
    for word in words:
        assert word in message, message
    return info.value


def test_wrong_magic_and_version_are_refused(tmp_path: Path) -> None:
    path, data = written(tmp_path)
    bad = bytearray(data)
    bad[0:8] = b"GGUF\x03\x00\x00\x00"
    error = expect_corrupt(path, bad, "bad magic", "offset 0")
    assert error.offset == 0
    newer = bytearray(data)
    struct.pack_into("<H", newer, 8, 3)
    error = expect_corrupt(path, newer, "unsupported format version 3.0", "offset 8")
    with pytest.raises(CorruptFileError, match="version"):
        read_header(path)
    minor = bytearray(data)
    struct.pack_into("<H", minor, 10, 7)  # a newer minor version is read, but this byte is under the digest
    expect_corrupt(path, minor, "digest")
    flags = bytearray(data)
    struct.pack_into("<I", flags, 12, 1)
    expect_corrupt(path, flags, "unknown required file flags")


def test_truncation_and_corruption_are_detected(tmp_path: Path) -> None:
    path, data = written(tmp_path)
    expect_corrupt(path, b"", "0 bytes")
    expect_corrupt(path, data[:7], "shorter than")
    for cut in (len(data) - 1, len(data) - 48, len(data) // 2, 300):
        expect_corrupt(path, data[:cut])
    with pytest.raises(CorruptFileError, match="end marker"):
        read_header(path)
    entry = make_entry(draft=20)
    for blob in (entry.tokens, entry.state.target, entry.checkpoints[-1].draft):
        at = data.find(blob.tobytes()[:16])
        assert at > 0
        flipped = bytearray(data)
        flipped[at + 3] ^= 0x10
        expect_corrupt(path, flipped, "digest mismatch")
    flipped = bytearray(data)
    flipped[-20] ^= 1  # inside the stored digest
    expect_corrupt(path, flipped, "digest mismatch")
    expect_corrupt(path, data + b"\0" * 64, "end marker")


def reseal(data: bytearray) -> bytearray:
    """Recompute the header digest (where the damaged header says it is) and the trailer: a forged file."""
    data = bytearray(data)
    size = len(data)
    try:
        fp_len = struct.unpack_from("<I", data, 20)[0]
        ns_len = struct.unpack_from("<I", data, 24 + fp_len)[0]
        n_tokens_at = 28 + fp_len + ns_len
        n_tokens = struct.unpack_from("<Q", data, n_tokens_at)[0]
        tokens_at = n_tokens_at + 8 + (-(n_tokens_at + 8) % ALIGNMENT)
        digest_at = tokens_at + 4 * n_tokens
        if digest_at + 32 <= size - 48:
            data[digest_at:digest_at + 32] = hashlib.blake2b(bytes(data[:digest_at]), digest_size=32).digest()
    except struct.error:
        pass
    if size >= 48:
        body = size - 48
        data[body:] = struct.pack("<Q32s8s", body, hashlib.blake2b(bytes(data[:body]), digest_size=32).digest(),
                                  b"CKPT_END")
    return data


def length_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count and length field of a valid file."""
    fp_len = struct.unpack_from("<I", data, 20)[0]
    ns_len = struct.unpack_from("<I", data, 24 + fp_len)[0]
    n_tokens_at = 28 + fp_len + ns_len
    n_tokens = struct.unpack_from("<Q", data, n_tokens_at)[0]
    fields = [(16, 4), (20, 4), (24 + fp_len, 4), (n_tokens_at, 8), (len(data) - 48, 8)]
    offset = n_tokens_at + 8
    offset += -offset % ALIGNMENT + 4 * n_tokens + 32
    offset += -offset % ALIGNMENT
    for _ in range(struct.unpack_from("<I", data, 16)[0]):
        # a state record (token count, target length, extra count), then its extra records (name and blob length)
        fields += [(offset + 8, 8), (offset + 32, 8), (offset + 40, 4)]
        length, n_extras = struct.unpack_from("<QI", data, offset + 32)
        offset += 64 + length + (-length % ALIGNMENT)
        for _ in range(n_extras):
            fields += [(offset + 4, 4), (offset + 8, 8)]
            length = struct.unpack_from("<Q", data, offset + 8)[0]
            offset += 64 + length + (-length % ALIGNMENT)
    assert offset == len(data) - 48
    return fields


def test_forged_huge_lengths_are_refused_before_allocating(tmp_path: Path) -> None:
    path, data = written(tmp_path)
    trailer = len(data) - 48
    fields = [(offset, width) for offset, width in length_fields(bytes(data)) if offset != trailer]  # resealed
    tracemalloc.start()
    try:
        for offset, width in fields:
            for value in (2**(8 * width) - 1, 2**(8 * width - 1), len(data), 2**31):
                forged = bytearray(data)
                forged[offset:offset + width] = value.to_bytes(width, "little")
                forged = reseal(forged)
                path.write_bytes(forged)
                grown = []
                for _ in range(3):  # another thread's allocation can land in the window: measured again
                    tracemalloc.reset_peak()
                    before = tracemalloc.get_traced_memory()[0]
                    with pytest.raises(CorruptFileError) as info:
                        read_entry(path)
                    grown.append(tracemalloc.get_traced_memory()[1] - before)
                    if grown[-1] < len(data) + SLACK:
                        break
                assert min(grown) < len(data) + SLACK
                assert "offset" in str(info.value)
    finally:
        tracemalloc.stop()


def test_the_token_count_message_names_the_field(tmp_path: Path) -> None:
    path, data = written(tmp_path)
    n_tokens_at = [offset for offset, width in length_fields(bytes(data)) if width == 8][0]
    forged = bytearray(data)
    forged[n_tokens_at:n_tokens_at + 8] = (2**64 - 1).to_bytes(8, "little")
    error = expect_corrupt(path, reseal(forged), "token count", f"offset {n_tokens_at}")
    assert error.offset == n_tokens_at


def test_non_regular_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CorruptFileError, match="not a regular file"):
        read_entry(tmp_path)
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        with pytest.raises(CorruptFileError, match="not a regular file"):
            read_entry(fifo)
        with pytest.raises(CorruptFileError, match="not a regular file"):
            read_header(fifo)


# ---------------------------------------------------------------------------------------------------------------------
# fuzzing

HUGE = (0, 1, 63, 64, 65, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1)


def base_files() -> list[bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        files = []
        for entry in (
            make_entry(n_tokens=12, n_checkpoints=2, n_bytes=200, draft=40, speculative=9, namespace="ns"),
            make_entry(n_tokens=0, n_checkpoints=0, n_bytes=0),
            make_entry(n_tokens=5, n_checkpoints=1, n_bytes=64, speculative=0),
        ):
            path = Path(directory) / "f"
            write_entry(path, entry, model_fingerprint=FP)
            files.append(path.read_bytes())
        return files


BASES = base_files()
FIELDS = [length_fields(b) for b in BASES]

positions = st.integers(0, 1 << 20)
mutations = st.one_of(
    st.tuples(st.just("flip"), positions, st.integers(0, 7)),
    st.tuples(st.just("truncate"), positions),
    st.tuples(st.just("insert"), positions, st.binary(min_size=1, max_size=80)),
    st.tuples(st.just("delete"), positions, st.integers(1, 80)),
    st.tuples(st.just("overwrite"), positions, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("length"), positions, st.sampled_from(HUGE)),
)


def mutate(base: int, steps: list[tuple]) -> bytearray:
    data = bytearray(BASES[base])
    for step in steps:
        kind, where = step[0], step[1] % (len(data) + 1)
        if kind == "flip" and where < len(data):
            data[where] ^= 1 << step[2]
        elif kind == "truncate":
            del data[where:]
        elif kind == "insert":
            data[where:where] = step[2]
        elif kind == "delete":
            del data[where:where + step[2]]
        elif kind == "overwrite":
            data[where:where + len(step[2])] = step[2]
        elif kind == "length":
            offset, width = FIELDS[base][step[1] % len(FIELDS[base])]
            if offset + width <= len(data):
                data[offset:offset + width] = (step[2] % 2**(8 * width)).to_bytes(width, "little")
    return data


FUZZ_EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES", "2000"))


def test_fuzzed_files_are_refused_cleanly_within_the_file_size(tmp_path: Path) -> None:
    counter = {"examples": 0, "loaded": 0, "refused": 0}
    path = tmp_path / "fuzz"

    def traced_read(expected: str | None) -> tuple[Any, int]:
        """``read_entry`` of the file (``None`` where it is refused with a message), and the peak of what was
        allocated meanwhile."""
        tracemalloc.start()  # traced around the read only: tracing hypothesis itself would triple the runtime
        try:
            entry = read_entry(path, expected_fingerprint=expected)
        except (CorruptFileError, IncompatibleStateError) as exc:
            entry = None
            assert str(exc)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return entry, peak

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(base=st.integers(0, len(BASES) - 1), steps=st.lists(mutations, min_size=1, max_size=4),
           forge=st.booleans(), expected=st.sampled_from([None, FP, "model-b"]))
    def fuzz(base: int, steps: list[tuple], forge: bool, expected: str | None) -> None:
        counter["examples"] += 1
        data = mutate(base, steps)
        if forge:
            data = reseal(data)
        if path.exists():
            path.unlink()  # a new inode: entries of earlier examples stay mapped over their own file
        path.write_bytes(data)
        entry, peak = traced_read(expected)
        # tracemalloc counts every thread's allocations: a thread an earlier test left running (a shared tier's
        # probe, a writer) can land in the window. Reading again gives the read's own figure; a read that does
        # allocate by what the file claims does so every time.
        for _ in range(2):
            if peak < len(data) + SLACK:
                break
            peak = min(peak, traced_read(expected)[1])
        assert peak < len(data) + SLACK, f"read_entry allocated {peak} bytes for a {len(data)}-byte file"
        try:
            header = read_header(path, expected_fingerprint=expected)
        except (CorruptFileError, IncompatibleStateError):
            header = None
        if entry is None:
            counter["refused"] += 1
            return
        counter["loaded"] += 1
        assert header is not None, "read_header refused a file read_entry accepted"
        assert header.fingerprint == entry.fingerprint and np.array_equal(header.tokens, entry.tokens)
        if not forge:
            assert bytes(data) == BASES[base], "a modified file passed the digest"
        if expected is not None:
            assert entry.fingerprint == expected
        assert entry.state.n_tokens == entry.n_tokens
        for b in (entry.tokens, *entry.buffers()):
            assert not b.flags.writeable and not b.flags.owndata
        for held in entry.checkpoints:
            assert isinstance(held, Checkpoint) and 0 <= held.n_tokens <= entry.n_tokens

    started = time.perf_counter()
    fuzz()
    elapsed = time.perf_counter() - started
    print(f"fuzz: {counter} in {elapsed:.1f}s")
    assert counter["examples"] >= FUZZ_EXAMPLES * 0.9


# ---------------------------------------------------------------------------------------------------------------------
# atomic writes

CHILD = r"""
import sys, time
import numpy as np
from ckpt_plugin import persist
from ckpt_plugin.persist import layout, write as persist_write
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint, StateBufferPool, freeze

path, mode = sys.argv[1], sys.argv[2]

def entry(generation, n_bytes):
    tokens = np.full(generation, generation, dtype=np.int32)
    target = freeze(np.full(n_bytes, generation % 256, dtype=np.uint8))
    return CacheEntry(tokens, Checkpoint(n_tokens=generation, pos_min=0, pos_max=generation - 1, partial=False,
                                       target=target, fingerprint="fp"), ())

if mode == "slow":
    persist.write_entry(path, entry(1, 16 << 20), model_fingerprint="fp")
    print("done 1", flush=True)
    real = persist_write._write_chunk
    def slow(file, chunk):
        n = real(file, chunk)
        print("chunk", n, flush=True)
        time.sleep(0.05)
        return n
    persist_write._write_chunk = slow
    persist.write_entry(path, entry(2, 200 << 20), model_fingerprint="fp")
    print("done 2", flush=True)
else:
    generation = 1
    while True:
        persist.write_entry(path, entry(generation, (4 << 20) + generation * 4099), model_fingerprint="fp")
        print("done", generation, flush=True)
        generation += 1
"""


def spawn(path: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=str(path.parent))


def check_generation(path: Path, generation: int, n_bytes: int) -> None:
    entry = read_entry(path, expected_fingerprint="fp")
    assert entry.n_tokens == generation and np.all(entry.tokens == generation)
    target = entry.state.target
    assert target.nbytes == n_bytes
    assert int(target.min()) == int(target.max()) == generation % 256


def test_a_writer_killed_mid_save_leaves_the_earlier_file(tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    child = spawn(path, "slow")
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "done 1"
        big_chunks = 0
        while big_chunks < 3:
            line = child.stdout.readline().split()
            assert line and line[0] == "chunk", f"writer ended early: {line}"
            big_chunks += int(line[1]) == layout.CHUNK_SIZE
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        rest = child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL and "done 2" not in rest
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(layout.TEMP_PREFIX)]
    assert len(temps) == 1 and temps[0].stat().st_size >= 3 * layout.CHUNK_SIZE, "killed while writing the temp"
    check_generation(path, 1, 16 << 20)
    # The stray temporary file is never taken for an entry.
    assert list(iter_entry_files(tmp_path)) == [path]
    with pytest.raises(UnsafePathError):
        safe_path(tmp_path, temps[0].name)
    with pytest.raises(CorruptFileError, match="end marker"):
        read_entry(temps[0])
    assert remove_stale_temp_files(tmp_path) == []  # too young: might be a live write
    assert remove_stale_temp_files(tmp_path, min_age_seconds=0) == temps
    assert sorted(tmp_path.iterdir()) == [path]


def test_a_writer_killed_at_random_moments_always_leaves_a_complete_file(tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    rng = np.random.default_rng(1)
    for _ in range(4):
        child = spawn(path, "loop")
        try:
            assert child.stdout is not None
            assert child.stdout.readline().split()[0] == "done"
            time.sleep(float(rng.uniform(0.0, 0.3)))
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        header = read_header(path, expected_fingerprint="fp")
        check_generation(path, header.n_tokens, (4 << 20) + header.n_tokens * 4099)
        remove_stale_temp_files(tmp_path, min_age_seconds=0)


def test_a_failed_write_keeps_the_earlier_file_and_leaves_no_temp(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "slot"
    first = make_entry(n_bytes=400)
    write_entry(path, first, model_fingerprint=FP)
    calls = 0
    real = persist_write._write_chunk

    def failing(file, chunk):  # noqa: ANN001
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device")
        return real(file, chunk)

    monkeypatch.setattr(persist_write, "_write_chunk", failing)
    with pytest.raises(OSError, match="No space"):
        write_entry(path, make_entry(n_bytes=900), model_fingerprint=FP)
    assert sorted(tmp_path.iterdir()) == [path]
    assert_same_entry(read_entry(path), first)


def test_files_are_private_to_the_owner(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    write_entry(path, make_entry(), model_fingerprint=FP)
    assert path.stat().st_mode & 0o077 == 0


# ---------------------------------------------------------------------------------------------------------------------
# file names


@pytest.mark.parametrize("name", [
    "../x", "..", ".", "/etc/passwd", "a/b", "a\\b", ".hidden", "x\0y", "", "x\n", "x" * 256, "caf\u00e9",
    "a b", "~root", "x/../y", layout.TEMP_PREFIX + "abc.tmp",
])
def test_unsafe_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafePathError):
        safe_path(tmp_path, name)


def test_plain_names_join_the_directory(tmp_path: Path) -> None:
    assert safe_path(tmp_path, "slot-0_v1.bin") == tmp_path / "slot-0_v1.bin"
    assert safe_path(str(tmp_path), "x" * 255) == tmp_path / ("x" * 255)
    assert safe_path(tmp_path, "a..b") == tmp_path / "a..b"


def test_symlinks_may_not_escape(tmp_path: Path) -> None:
    directory = tmp_path / "slots"
    directory.mkdir()
    outside = tmp_path / "secret"
    outside.write_text("x")
    (directory / "escape").symlink_to(outside)
    (directory / "up").symlink_to(tmp_path)
    (directory / "self").symlink_to(directory)
    (directory / "dangling").symlink_to(tmp_path / "nowhere")
    (directory / "inside-target").write_text("y")
    (directory / "inside").symlink_to(directory / "inside-target")
    for name in ("escape", "up", "self", "dangling"):
        with pytest.raises(UnsafePathError, match="outside"):
            safe_path(directory, name)
    assert safe_path(directory, "inside") == directory / "inside"
    # The directory itself may be reached through a symlink.
    (tmp_path / "alias").symlink_to(directory)
    assert safe_path(tmp_path / "alias", "inside") == tmp_path / "alias" / "inside"
    with pytest.raises(UnsafePathError):
        safe_path(tmp_path / "alias", "escape")
    assert [p.name for p in iter_entry_files(directory)] == ["inside-target"]
