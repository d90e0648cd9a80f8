"""One registry builds and shares the tiers: one disk tier per directory (one index and one budget over its files),
RAM caches by key, private caches by default."""

from __future__ import annotations

import gc
import pathlib
import weakref

from ckpt_plugin.testing import fake_manager, run_prompt
from ckpt_plugin.tiers.registry import TierRegistry


def test_managers_naming_one_directory_share_its_disk_tier(tmp_path: pathlib.Path) -> None:
    a = fake_manager("swa", disk_dir=str(tmp_path), checkpoint_min_step=64)
    b = fake_manager("recurrent", disk_dir=str(tmp_path / "." / ""), checkpoint_min_step=64)
    assert a.disk is b.disk  # not two indexes and two budgets racing over the same files
    assert a.cache is not b.cache  # RAM caches are private unless shared on purpose
    run_prompt(a, list(range(10, 300)))
    a.primary.save_to_cache()
    assert len(b.disk) == 1


def test_the_registry_forgets_tiers_nobody_uses(tmp_path: pathlib.Path) -> None:
    registry = TierRegistry()
    first = registry.disk(tmp_path, 1 << 20)
    assert registry.disk(tmp_path, 1 << 20) is first
    held = weakref.ref(first)
    del first
    gc.collect()
    # The registry does not keep a tier alive: one nobody holds is built again (and scans its directory afresh).
    assert held() is None
    assert registry.disk(tmp_path, 1 << 20) is not None
    shared = registry.ram("model-a", 1 << 20)
    assert registry.ram("model-a", 1 << 20) is shared and registry.ram("model-b", 1 << 20) is not shared
    assert registry.ram(None, 1 << 20) is not registry.ram(None, 1 << 20)
