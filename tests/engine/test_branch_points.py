"""A prompt that leaves a stored prefix the restore could not serve whole leaves a checkpoint there, so that the next
prompt leaving at the same point (a shared system prompt, a repeated edit) restores all of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.seam.context import clear_memory

rng = np.random.default_rng(21)
SYSTEM = [1, *rng.integers(3, 300, 149).tolist()]  # 150 tokens, not on the 32-token checkpoint grid
CONVERSATIONS = [SYSTEM + rng.integers(3, 300, 40).tolist() for _ in range(3)]


def evaluated_for(llama: Any, manager: Any, prompt: list[int]) -> tuple[int, list[int]]:
    before = manager.counters.tokens_evaluated
    out = llama.create_completion(prompt, max_tokens=3, temperature=0.0, top_k=1)
    return manager.counters.tokens_evaluated - before, out["choices"][0]["text"]


@pytest.mark.parametrize("kind", ["gemma3", "mamba"])
def test_the_third_conversation_on_a_system_prompt_restores_all_of_it(make_llama: Any, kind: str) -> None:
    llama = make_llama(kind)
    reference = make_llama(kind)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    other = [1, *rng.integers(3, 300, 99).tolist()]  # another user's turn in between: each conversation is parked
    evaluated = []
    for prompt in CONVERSATIONS:
        n, text = evaluated_for(llama, manager, prompt)
        evaluated.append(n)
        reference.reset()
        clear_memory(reference)
        assert text == reference.create_completion(prompt, max_tokens=3, temperature=0.0, top_k=1)["choices"][0]["text"]
        evaluated_for(llama, manager, other)
    generated = 2  # of the 3 tokens generated, the first 2 are evaluated
    new_tokens = len(CONVERSATIONS[0]) - len(SYSTEM) + generated
    # A parked conversation restores only its window (or recurrent state) and its checkpoints: the second
    # restores the first's checkpoint at 128 and leaves one at 150, where the third restores.
    assert evaluated[1] == new_tokens + len(SYSTEM) - 128
    assert evaluated[2] == new_tokens
    assert manager.counters.cache_hits >= 2


def test_a_short_shared_prefix_leaves_no_checkpoint(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    short = [SYSTEM[:20] + rng.integers(3, 300, 60).tolist() for _ in range(2)]
    for prompt in short:
        evaluated_for(llama, manager, prompt)
    assert manager.controllers[0].branch_point == 0
    assert not any(c.n_tokens == 20 for c in manager.primary.slot.checkpoints)
