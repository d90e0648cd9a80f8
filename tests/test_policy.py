"""Pure checkpoint policy, without a model."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ckpt_plugin.checkpoint import Checkpoint, freeze
from ckpt_plugin.policy import SLOT_BUDGET_SHARE, checkpoints_to_erase, slot_checkpoint_limit


def checkpoint(n_tokens: int) -> Checkpoint:
    return Checkpoint(n_tokens, 0, n_tokens - 1, True, freeze(np.zeros(1, dtype=np.uint8)), "fp")


@given(st.integers(0, 64), st.integers(0, 1 << 30), st.integers(0, 1 << 26))
def test_slot_limit_keeps_the_slot_within_its_share_of_the_budget(max_checkpoints: int, budget: int,
                                                                  size: int) -> None:
    limit = slot_checkpoint_limit(max_checkpoints, budget, size)
    if budget == 0 or size == 0:
        assert limit == max_checkpoints
        return
    assert 1 <= limit <= max(1, max_checkpoints)
    # within the slot's share, unless one checkpoint alone is more (the newest is always kept)
    assert limit * size <= budget // SLOT_BUDGET_SHARE or limit == 1


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40, unique=True), st.integers(0, 40))
def test_erasing_keeps_the_newest_and_at_most_limit(positions: list[int], limit: int) -> None:
    checkpoints = [checkpoint(n) for n in sorted(positions)]
    erased = checkpoints_to_erase(checkpoints, limit)
    kept = [c for c in checkpoints if c not in erased]
    assert len(kept) == min(len(checkpoints), limit)
    if limit:
        assert kept[-1] is checkpoints[-1]
