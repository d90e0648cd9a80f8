"""A tenant's DELETE forgets it in every tier; disk-tier and slot files are read into private memory, so truncating
them never kills the server (SIGBUS); files that fail validation are counted.

Real components only: llama.cpp contexts on the tiny models, real files, a real redis-server, real ckpt-serve
processes over HTTP. The truncation cases run in a subprocess: a regression to mapped files would kill that process
with SIGBUS, which fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint, freeze
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.persist import read_header
from ckpt_plugin.tiers.shared.format import Partition
from ckpt_plugin.tiers.shared.tier import SharedTier
from ckpt_plugin.core.counters import Cleared

from support import factories
from support.redis_servers import RedisServer
from support.servers import Server, model_args, run_server

REPO = Path(__file__).resolve().parents[2]
LLAMA_KWARGS: dict[str, Any] = dict(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, verbose=False, seed=0)

# ---------------------------------------------------------------------------------------------------------------------
# M4: truncated files never SIGBUS (subprocess)

CHILD = r'''
import json, os, sys
from pathlib import Path

from llama_cpp import Llama

import ckpt_plugin
from ckpt_plugin.core.errors import CorruptFileError

model, work, mode, kwargs = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
PROMPT = "the cat and the dog went to the house and the bird sat on the tree " * 6
disk = work / "disk"
slot_file = work / "slot.bin"
out = {"texts": []}


def complete(llama):
    return llama.create_completion(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]


def attached():
    llama = Llama(model_path=model, **kwargs)
    return llama, ckpt_plugin.attach(llama, disk_dir=str(disk), load_entrypoints=False)


def truncate(path, size):
    os.truncate(path, size)
    print("truncated", path.name, "to", size, flush=True)


plain = Llama(model_path=model, **kwargs)
out["fresh"] = complete(plain)
plain.close()

writer, manager = attached()
complete(writer)
if mode.startswith("disk"):
    manager.flush()                      # the live slot into the cache, written through to a disk-tier file
else:
    manager.save_slot(slot_file)
ckpt_plugin.detach(writer)
writer.close()

reader, manager = attached()             # a new process's view: the disk tier indexed from the files' headers
files = sorted(disk.glob("*.ckpt"))
out["disk_files"] = len(files)

if mode == "disk-before-load":
    truncate(files[0], files[0].stat().st_size // 2)   # the header still reads; the rest is gone
    out["texts"].append(complete(reader))              # the disk candidate is read, refused and moved aside
elif mode == "disk-after-load":
    out["texts"].append(complete(reader))              # disk hit: the entry is read and promoted to RAM
    truncate(files[0], 0)
    manager.erase_slot()                               # so that the next prompt restores the promoted entry
    out["texts"].append(complete(reader))
elif mode == "slot-before-load":
    truncate(slot_file, slot_file.stat().st_size // 2)
    try:
        manager.restore_slot(slot_file)
        out["refused"] = False
    except CorruptFileError:
        out["refused"] = True
    out["texts"].append(complete(reader))
elif mode == "slot-after-load":
    manager.restore_slot(slot_file)                   # the slot holds the file's state and checkpoints now
    truncate(slot_file, 0)
    manager.save_slot(work / "copy.bin")               # reads every byte of the restored full state
    out["texts"].append(complete(reader))
    try:
        manager.restore_slot(slot_file)
        out["refused"] = False
    except CorruptFileError:
        out["refused"] = True
    manager.erase_slot()
    manager.restore_slot(work / "copy.bin")
    out["texts"].append(complete(reader))
stats = manager.stats()
out["stats"] = {k: stats[k] for k in ("disk_hits", "cache_hits", "tokens_reused", "corrupt_files", "prompts")}
out["moved_aside"] = len(list(disk.glob("*.corrupt")))
print("RESULT", json.dumps(out), flush=True)
'''


def run_child(model: Path, work: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(work), mode, json.dumps(LLAMA_KWARGS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != -signal.SIGBUS, f"{mode}: the process died of SIGBUS:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, f"{mode}: exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_disk_entry_truncated_after_it_was_read_is_served_from_its_private_copy(tiny_model: Any,
                                                                                  tmp_path: Path) -> None:
    result = run_child(tiny_model("llama"), tmp_path, "disk-after-load")
    assert result["disk_files"] == 1
    assert result["texts"] == [result["fresh"]] * 2
    stats = result["stats"]
    assert stats["disk_hits"] == 1, stats
    assert stats["cache_hits"] >= 2 and stats["tokens_reused"] > 100, stats  # the second prompt restored it again
    assert stats["corrupt_files"] == 0 and result["moved_aside"] == 0


def test_a_disk_entry_truncated_before_it_is_read_is_dropped_as_corrupt(tiny_model: Any, tmp_path: Path) -> None:
    result = run_child(tiny_model("llama"), tmp_path, "disk-before-load")
    assert result["texts"] == [result["fresh"]]
    stats = result["stats"]
    assert stats["disk_hits"] == 0 and stats["tokens_reused"] == 0, stats
    assert stats["corrupt_files"] == 1 and result["moved_aside"] == 1, (stats, result)


def test_a_slot_file_truncated_after_it_was_restored_cannot_fault_the_slot(tiny_model: Any, tmp_path: Path) -> None:
    result = run_child(tiny_model("llama"), tmp_path, "slot-after-load")
    assert result["texts"] == [result["fresh"]] * 2
    assert result["refused"] is True  # the truncated file itself is refused on the next restore, and counted
    assert result["stats"]["corrupt_files"] == 1 and result["stats"]["tokens_reused"] > 100, result["stats"]


def test_a_slot_file_truncated_before_it_is_restored_is_refused(tiny_model: Any, tmp_path: Path) -> None:
    result = run_child(tiny_model("llama"), tmp_path, "slot-before-load")
    assert result["refused"] is True and result["texts"] == [result["fresh"]]
    assert result["stats"]["corrupt_files"] == 1 and result["stats"]["tokens_reused"] == 0, result["stats"]


# ---------------------------------------------------------------------------------------------------------------------
# M2 and L3 without HTTP: the disk tier's and the shared tier's forget, and the counts


FP = "model-x/ctx=1024"


def entry(namespace: str, first: int, n_tokens: int = 70, n_bytes: int = 4000, fingerprint: str = FP) -> CacheEntry:
    rng = np.random.default_rng(first)

    def state(n: int, partial: bool) -> Checkpoint:
        return factories.checkpoint(n, pos_min=max(-1, n - 32), partial=partial, fingerprint=fingerprint,
                                    target=freeze(rng.integers(0, 256, n_bytes, np.uint8)))

    return factories.entry(factories.token_run(first, n_tokens), state=state(n_tokens, False),
                           checkpoints=(state(n_tokens // 2, True),), namespace=namespace)


def test_the_disk_tier_forgets_one_namespace_and_counts_corrupt_files(tmp_path: Path) -> None:
    (tmp_path / "garbage.ckpt").write_bytes(b"CKPTSLOT" + b"\0" * 300)   # refused by the start-up scan
    tier = DiskTier(tmp_path, 1 << 30)
    assert tier.corrupt_files == 1 and (tmp_path / "garbage.corrupt").exists()
    for first in (100, 300):
        assert tier.store(entry("tenant-a", first)) and tier.store(entry("tenant-b", first + 1000))
    # a file of tenant A that another process wrote after the scan, and one of A's moved aside as corrupt
    other = DiskTier(tmp_path, 1 << 30)
    assert other.store(entry("tenant-a", 500))
    victim = tmp_path / DiskTier.file_name(entry("tenant-a", 700))
    DiskTier(tmp_path, 1 << 30).store(entry("tenant-a", 700))
    os.truncate(victim, victim.stat().st_size - 10)
    assert not any(n for _, n in tier.lookup("tenant-a", FP, np.arange(500, 570, dtype=np.int32)))  # unknown here
    rescanned = DiskTier(tmp_path, 1 << 30)   # the truncated file is refused at this scan (header ok, trailer gone)
    assert rescanned.corrupt_files == 1 and victim.with_suffix(".corrupt").exists()

    assert tier.clear("tenant-a") == 3        # two indexed by this tier, one written by the other
    names = {read_header(p).namespace for p in tmp_path.glob("*.ckpt")}
    assert names == {"tenant-b"} and len(list(tmp_path.glob("*.ckpt"))) == 2
    # A's moved-aside file (its header still names A) went; the unattributable garbage stays
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == ["garbage.corrupt"]
    assert not any(n for _, n in tier.lookup("tenant-a", FP, np.arange(100, 170, dtype=np.int32)))
    assert any(n for _, n in tier.lookup("tenant-b", FP, np.arange(1100, 1170, dtype=np.int32)))
    assert tier.clear() == 2 and list(tmp_path.iterdir()) == []

    # a file that fails validation when read: dropped, moved aside, counted
    tier.store(entry("tenant-c", 900))
    path = tmp_path / DiskTier.file_name(entry("tenant-c", 900))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    (record, _), = tier.lookup("tenant-c", FP, np.arange(900, 970, dtype=np.int32))
    assert tier.load(record) is None and tier.corrupt_files == 2 and path.with_suffix(".corrupt").exists()


def partition_keys(server: RedisServer, prefix: str, namespace: str, fingerprint: str = FP) -> list[bytes]:
    return server.keys(Partition(prefix, fingerprint, namespace).base + "*")


def test_the_shared_tier_forgets_one_partition_and_the_writes_queued_before(redis_server: RedisServer) -> None:
    tier = SharedTier(redis_server.url, prefix="forget", timeout=2.0)
    try:
        for first in (100, 300):
            for namespace in ("tenant-a", "tenant-b"):
                assert tier.submit(entry(namespace, first + (namespace == "tenant-b")), lambda: None)
        assert tier.drain(20)
        other_model = entry("tenant-a", 100, fingerprint="model-y")
        assert tier.submit(other_model, lambda: None) and tier.drain(20)
        assert len(partition_keys(redis_server, "forget", "tenant-a")) > 4
        # a write queued just before the forget writes nothing (the tenant asked to forget that state)
        assert tier.submit(entry("tenant-a", 500), lambda: None)
        assert tier.forget("tenant-a", FP) == 2
        assert tier.drain(20)
        assert partition_keys(redis_server, "forget", "tenant-a") == []
        assert len(partition_keys(redis_server, "forget", "tenant-b")) > 4
        assert partition_keys(redis_server, "forget", "tenant-a", "model-y"), "another model's partition stays"
        # the same state offered again after the forget is new state: written
        assert tier.submit(entry("tenant-a", 100), lambda: None) and tier.drain(20)
        assert partition_keys(redis_server, "forget", "tenant-a")
        # without a namespace: every namespace of the model, and no other model
        assert tier.forget(None, FP) == 3
        assert partition_keys(redis_server, "forget", "tenant-a") == partition_keys(redis_server, "forget",
                                                                                    "tenant-b") == []
        assert partition_keys(redis_server, "forget", "tenant-a", "model-y")
        assert tier.stats()["errors"] == 0
    finally:
        tier.close()


def test_cleared_adds_up_entries_per_tier() -> None:
    one = Cleared({"ram": 2, "disk": 1, "shared": 3, "slot": 1})
    assert one == 6 and isinstance(one, int) and sum([one, 1]) == 7
    both = Cleared.combine([one, Cleared({"ram": 1, "shared": None, "slot": 0}), 4])
    assert both.tiers == {"ram": 7, "disk": 1, "shared": None, "slot": 1} and both == 8
    assert both.as_json() == {"cleared": 8, "tiers": both.tiers}


# ---------------------------------------------------------------------------------------------------------------------
# M2 and L3 over HTTP: real ckpt-serve processes

SYSTEM = "the cat and the dog went to the house " * 12
OPERATOR = "operator-secret"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(server: Server, key: str, user: str = "hello") -> int:
    """Send a turn; return its ``cached_tokens``."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    return reply.usage.prompt_tokens_details.cached_tokens


def model_view(server: Server, key: str) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/checkpoints", headers=bearer(key), timeout=60)
    assert response.status_code == 200
    return next(iter(response.json()["models"].values()))


def namespace_of(server: Server, key: str) -> str:
    view = model_view(server, key)
    return next(iter({e["namespace"] for e in view["cache"]} | {s["namespace"] for s in view["slots"]}))


def forget(server: Server, key: str) -> dict[str, Any]:
    response = httpx.delete(f"{server.url}/checkpoints", headers=bearer(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def disk_namespaces(directory: Path) -> list[str]:
    return sorted(read_header(p).namespace for p in directory.glob("*.ckpt"))


def stats_of(server: Server) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/checkpoints/stats", headers=bearer(OPERATOR), timeout=60)
    assert response.status_code == 200
    return next(iter(response.json()["models"].values()))


def test_delete_forgets_the_tenant_in_ram_disk_and_slot_and_counts_corrupt_files(tiny_model: Any,
                                                                                tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "planted.ckpt").write_bytes(b"not an entry at all" * 20)
    args = model_args(tiny_model("llama")) + [
        "--checkpoint-namespaces", "api_key", "--checkpoint-admin", "true", "--checkpoint-admin-key", OPERATOR,
        "--checkpoint-disk-dir", str(disk),
    ]
    with run_server(args) as server:
        # L3: the file refused by the start-up scan is counted, in the stats and in Prometheus
        assert stats_of(server)["corrupt_files"] == 1
        assert server.metric("corrupt_files_total", OPERATOR) == 1
        assert chat(server, "key-a") == 0 and chat(server, "key-b") == 0
        assert chat(server, "key-a") > 50          # B's turn parked A's state: RAM and disk hold it
        a, b = namespace_of(server, "key-a"), namespace_of(server, "key-b")
        assert a in disk_namespaces(disk) and b in disk_namespaces(disk)
        # the slot holds A's state now: A's DELETE empties it too
        body = forget(server, "key-a")
        assert body["cleared"] >= 2, body        # A's RAM entry and A's file at least
        if "tiers" in body:                      # once the route passes on the per-tier counts
            assert body["tiers"]["ram"] >= 1 and body["tiers"]["disk"] >= 1 and body["tiers"]["slot"] == 1, body
        assert a not in disk_namespaces(disk) and b in disk_namespaces(disk)
        view = model_view(server, "key-a")
        assert view["cache"] == [] and all(s["n_tokens"] == 0 and not s["checkpoints"] for s in view["slots"])
        assert chat(server, "key-b") > 50           # B's entries survived A's DELETE
        assert chat(server, "key-a") == 0           # A is forgotten everywhere: nothing served from the disk tier
        assert stats_of(server)["disk_hits"] == 0


def test_delete_forgets_the_tenants_partition_in_the_shared_tier(tiny_model: Any, tmp_path: Path,
                                                                 redis_server: RedisServer) -> None:
    prefix = "http-forget"
    args = model_args(tiny_model("llama")) + [
        "--checkpoint-namespaces", "api_key", "--checkpoint-admin", "true", "--checkpoint-admin-key", OPERATOR,
        "--checkpoint-disk-dir", str(tmp_path / "disk"), "--checkpoint-redis-url", redis_server.url,
        "--checkpoint-redis-prefix", prefix, "--checkpoint-redis-retry", "0.2",
    ]

    def wait_for_writes(server: Server, count: float) -> None:
        deadline = time.monotonic() + 20
        while server.metric("shared_writes_total", OPERATOR) < count:
            assert time.monotonic() < deadline, "the shared tier was not written"
            time.sleep(0.05)

    with run_server(args) as server:
        chat(server, "key-a")
        chat(server, "key-b")
        wait_for_writes(server, 2)
        fingerprint = model_view(server, OPERATOR)["fingerprint"]
        a, b = namespace_of(server, "key-a"), namespace_of(server, "key-b")
        assert partition_keys(redis_server, prefix, a, fingerprint)
        assert partition_keys(redis_server, prefix, b, fingerprint)
        body = forget(server, "key-a")
        if "tiers" in body:
            assert body["tiers"]["shared"] >= 1, body
        assert partition_keys(redis_server, prefix, a, fingerprint) == []
        assert partition_keys(redis_server, prefix, b, fingerprint), "another tenant's partition stays"
        assert chat(server, "key-a") == 0
        assert chat(server, "key-b") > 50
        assert server.metric("shared_errors_total", OPERATOR) == 0
