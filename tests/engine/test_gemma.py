"""Integration on the real Gemma-3-270M (sliding window 512, ``swa_full=False``): a branching conversation.

Gemma-3-270M Q4_K_M's CPU kernels give slightly batch-size-dependent logits (a fresh context evaluating the same
prompt in one 512-token batch or in 256-token batches differs by up to ~0.5 in a logit), so answers are compared on
logits with a tolerance well above that noise and far below what a lost sliding window produces.
"""

from __future__ import annotations

import pathlib
from typing import Any

import llama_cpp
import numpy as np
import pytest
from llama_cpp import Llama

import ckpt_plugin

pytestmark = pytest.mark.gemma
TOLERANCE = 1.5
RNG = np.random.default_rng(7)
BASE = [2, *RNG.integers(1000, 20000, 1399).tolist()]
REQUESTS = [
    BASE,
    BASE[:1100] + [1500, 1600, 1700],
    BASE,
    BASE[:600] + [1800, 1900, 2000],
    BASE,
]


def load(path: pathlib.Path) -> Llama:
    return Llama(str(path), n_ctx=4096, n_batch=512, n_threads=2, swa_full=False, verbose=False, seed=0)


def last_logits(llama: Llama, prompt: list[int]) -> np.ndarray:
    llama.create_completion(prompt, max_tokens=1, temperature=0)
    logits = llama_cpp.llama_get_logits_ith(llama.ctx, -1)
    return np.ctypeslib.as_array(logits, shape=(llama.n_vocab(),)).copy()


def fresh_logits(reference: Llama, prompt: list[int]) -> np.ndarray:
    reference.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(reference.ctx), True)
    return last_logits(reference, prompt)


@pytest.fixture(scope="module")
def gemma_pair(gemma_path: pathlib.Path) -> Any:
    attached, reference = load(gemma_path), load(gemma_path)
    yield attached, reference
    attached.close()
    reference.close()


def test_branching_conversation_matches_fresh_context_and_evaluates_near_ideal(gemma_pair: Any) -> None:
    attached, reference = gemma_pair
    manager = ckpt_plugin.attach(attached, load_entrypoints=False)
    held: list[list[int]] = []
    total, ideal_total = 0, 0
    try:
        for prompt in REQUESTS:
            before = manager.counters.tokens_evaluated
            got = last_logits(attached, prompt)
            evaluated = manager.counters.tokens_evaluated - before
            want = fresh_logits(reference, prompt)
            assert np.abs(got - want).max() < TOLERANCE
            assert got.argmax() == want.argmax()
            shared = max((_common(h, prompt) for h in held), default=0)
            ideal = len(prompt) - min(shared, len(prompt) - 1)
            total, ideal_total = total + evaluated, ideal_total + ideal
            held.append(prompt)
        # the requests that return to the full prompt are served from the cache, the diverging ones from
        # checkpoints spaced checkpoint_min_step (256) apart
        assert total <= ideal_total + 2 * 256
        assert manager.counters.cache_hits >= 2
    finally:
        ckpt_plugin.detach(attached)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_without_the_plugin_the_sliding_window_loses_the_prefix(gemma_pair: Any) -> None:
    """The failure the plugin fixes, shown with the same tolerance: proof that the comparison above can fail."""
    attached, reference = gemma_pair
    attached.reset()
    last_logits(attached, BASE)
    wrong = last_logits(attached, REQUESTS[3])  # llama-cpp-python truncates a window that lost [88, 600)
    want = fresh_logits(reference, REQUESTS[3])
    assert np.abs(wrong - want).max() > TOLERANCE
