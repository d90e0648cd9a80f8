"""One module decides every victim: a plugin's ``select_cache_victims`` governs the RAM cache and the disk tier
alike, and the default rule is least recently used in both."""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_plugin.policy.eviction import evict_until, lru_victims
from ckpt_plugin.plugins.hookspecs import hookimpl
from ckpt_plugin.core.request import RequestScope, current_request
from ckpt_plugin.testing import fake_manager, run_prompt


class KeepNamespace:
    """Never evicts the ``keep`` tenant's entries, in any tier; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    @hookimpl
    def select_cache_victims(self, entries: Sequence[Any], n_bytes: int, tier: str) -> list[Any]:
        self.asked.append(tier)
        return lru_victims([e for e in entries if e.namespace != "keep"], n_bytes)


def conversation(seed: int) -> list[int]:
    return list(np.random.default_rng(seed).integers(10, 500, 300))


def serve_and_park(manager: Any, namespace: str, seed: int) -> None:
    token = current_request.set(RequestScope(namespace=namespace))
    try:
        run_prompt(manager, conversation(seed))
        manager.primary.save_to_cache()
    finally:
        current_request.reset(token)


def test_a_plugin_picks_the_victims_of_ram_and_disk(tmp_path: pathlib.Path) -> None:
    manager = fake_manager("swa", disk_dir=str(tmp_path), checkpoint_min_step=64)
    plugin = KeepNamespace()
    manager.plugins.register(plugin)
    serve_and_park(manager, "keep", 0)
    entry_bytes = manager.cache.entries()[0].nbytes
    disk_file = next(tmp_path.glob("*.ckpt")).stat().st_size
    # Room for about two entries in each tier: every later entry forces an eviction in both.
    manager.resize_cache(int(entry_bytes * 2.6) * 2)  # the slot's pins take up to half of the budget
    manager.disk.max_bytes = int(disk_file * 2.5)
    for seed in range(1, 6):
        serve_and_park(manager, "other", seed)
    assert {"ram", "disk"} <= set(plugin.asked)
    assert [e for e in manager.cache.entries() if e.namespace == "keep"]  # RAM kept the protected entry
    on_disk = {record.namespace for record in manager.disk._records.values()}
    assert "keep" in on_disk and len(manager.disk) <= 2  # so did the disk tier, within its budget


def test_without_plugins_both_tiers_evict_the_least_recently_used(tmp_path: pathlib.Path) -> None:
    manager = fake_manager("swa", disk_dir=str(tmp_path), checkpoint_min_step=64)
    serve_and_park(manager, "first", 0)
    disk_file = next(tmp_path.glob("*.ckpt")).stat().st_size
    manager.disk.max_bytes = int(disk_file * 2.5)
    for seed in range(1, 4):
        serve_and_park(manager, f"tenant-{seed}", seed)
    assert "first" not in {record.namespace for record in manager.disk._records.values()}
    assert len(manager.disk) == 2


class Item:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=20), st.integers(0, 2000), st.booleans())
def test_evict_until_frees_the_shortfall_or_says_it_cannot(sizes: list[int], budget: int, stale: bool) -> None:
    items = [Item(n) for n in sizes]
    held = list(items)

    def chooser(candidates: Sequence[Item], n_bytes: int) -> list[Item]:
        # A chooser may name objects the tier no longer holds; they are skipped.
        return ([Item(1)] if stale else []) + lru_victims(candidates, n_bytes)

    fitted, victims = evict_until(lambda: sum(i.nbytes for i in held) <= budget,
                                  lambda: sum(i.nbytes for i in held) - budget, lambda: list(held), held.remove,
                                  chooser)
    assert fitted == (sum(i.nbytes for i in held) <= budget)
    assert fitted or not held
    assert victims == items[: len(victims)]  # least recently used first, nothing else
    if fitted and victims:
        assert sum(i.nbytes for i in held) + victims[-1].nbytes > budget  # no more than needed
