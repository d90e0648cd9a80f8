"""The state budget bounds every state byte the plugin holds, on real contexts."""

from __future__ import annotations

from typing import Any

import numpy as np

import ckpt_plugin


def test_state_bytes_stay_within_the_budget_under_many_conversations(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    probe = ckpt_plugin.attach(llama, load_entrypoints=False)
    rng = np.random.default_rng(3)
    llama.create_completion([1, *rng.integers(3, 200, 300).tolist()], max_tokens=1, temperature=0)
    checkpoint_bytes = max(c.nbytes for c in probe.primary.slot.checkpoints)
    ckpt_plugin.detach(llama)
    budget = 12 * checkpoint_bytes
    manager = ckpt_plugin.attach(llama, cache_max_bytes=budget, load_entrypoints=False)
    systems = [[1, *rng.integers(3, 200, 200).tolist()] for _ in range(4)]
    peak = 0
    for turn in range(24):
        prompt = systems[turn % 4] + rng.integers(3, 200, 40 + 10 * turn).tolist()
        llama.create_completion(prompt, max_tokens=2, temperature=0)
        stats = manager.stats()
        peak = max(peak, stats["state_bytes"])
        assert stats["state_bytes"] <= stats["state_budget_bytes"] == budget
        assert stats["slot_only_bytes"] <= budget // 2 + checkpoint_bytes
    assert manager.counters.cache_evictions > 0 and peak > budget // 2  # the budget was what limited it
