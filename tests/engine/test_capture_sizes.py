"""Partial captures are sized by llama.cpp once per window length, and a wrong learned size costs nothing but a
second capture."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.core.memory import partial_cells
from ckpt_plugin.testing import FAKE_KINDS, FakeBackend

rng = np.random.default_rng(5)
PROMPT = [1, *rng.integers(3, 300, 159).tolist()]


@pytest.mark.parametrize("kind", ["gemma3", "mamba"])
def test_partial_captures_past_a_full_window_need_no_size_query(make_llama: Any, kind: str) -> None:
    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    llama.eval(PROMPT[:100])  # past gemma3's 32-token window: every window from here on holds the same cells
    before = manager.counters.state_size_queries
    taken = []
    for end in range(104, len(PROMPT) + 1, 4):
        llama.eval(PROMPT[llama.n_tokens : end])
        checkpoint = manager.primary.checkpoint()
        assert checkpoint is not None
        taken.append(checkpoint)
    queries = manager.counters.state_size_queries - before
    assert queries <= 1 and len(taken) == 15
    # The learned size is the one llama.cpp measures now (restores of such checkpoints:
    # tests/engine/test_equivalence.py).
    assert all(c.target.nbytes == manager.primary.backend.state_size(True) for c in taken)


def test_a_learned_size_that_no_longer_holds_is_measured_again() -> None:
    # The fake serializes its whole memory, so captures of the same window length grow: the learned size fails.
    backend = FakeBackend(FAKE_KINDS["swa"])
    manager = ckpt_plugin.CheckpointManager(backend, load_entrypoints=False)
    manager.primary.process(list(range(3, 80)))
    cells = partial_cells(backend.kind, backend.pos_min(), backend.pos_max())
    first = manager.primary.checkpoint()
    manager.primary.process(list(range(80, 90)))
    assert partial_cells(backend.kind, backend.pos_min(), backend.pos_max()) == cells
    second = manager.primary.checkpoint()
    assert first is not None and second is not None
    assert second.target.nbytes == backend.state_size(True) > first.target.nbytes
    assert manager.counters.capture_failures == 0 and not manager.captures.partial_sizes.trusted
