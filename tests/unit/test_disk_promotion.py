"""A disk-tier entry promoted back to RAM goes through the same admission as any entry, and one prompt counts one
disk hit (both were bugs: promotion skipped ``on_cache_alloc`` and ``select_cache_victims``, and every better disk
candidate counted a hit)."""

from __future__ import annotations

from typing import Any

import ckpt_plugin
from ckpt_plugin.testing import fake_manager, run_prompt


class Recorder:
    def __init__(self) -> None:
        self.allocs: list[int] = []
        self.evicted: list[Any] = []

    @ckpt_plugin.hookimpl
    def on_cache_alloc(self, manager: Any, namespace: str, n_tokens: int, n_bytes: int) -> bool | None:
        self.allocs.append(n_tokens)
        return None

    @ckpt_plugin.hookimpl
    def on_cache_evict(self, manager: Any, entry: Any, reason: str) -> None:
        self.evicted.append((entry.n_tokens, reason))


def test_disk_promotion_is_admitted_and_counted_once(tmp_path: Any) -> None:
    base = list(range(1, 200))
    writer = fake_manager("swa", disk_dir=str(tmp_path), load_entrypoints=False)
    for extra in ([500], [500, 501, 502], [500, 501, 502, 503, 504]):
        run_prompt(writer, base + extra, 2)
        writer.flush()
    # a new process on the same directory: three nested candidates on disk, none in RAM
    reader = fake_manager("swa", disk_dir=str(tmp_path), load_entrypoints=False)
    recorder = Recorder()
    reader.plugins.register(recorder)
    assert len(reader.cache) == 0 and len(reader.disk) >= 2
    run_prompt(reader, base + [500, 501, 502, 503, 504, 505, 506], 1)
    assert reader.counters.disk_hits == 1
    assert recorder.allocs, "the promoted entry skipped on_cache_alloc"
    assert len(reader.cache) >= 1
