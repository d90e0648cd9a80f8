"""Slot ownership at hook level: generations the host abandons, interrupts or that raise part-way never block the
next request, and leave the slot, its checkpoints and the cache consistent (answers equal a fresh context)."""

from __future__ import annotations

import gc
import threading
from typing import Any, Callable

import numpy as np
import pytest

import ckpt_plugin
import llama_cpp
from ckpt_plugin.testing import assert_same_answer, fresh_greedy_tokens, greedy_tokens

KINDS = ["llama", "gemma3", "mamba", "hybrid"]
BOUND_SECONDS = 60  # generous for a loaded 2-core machine; a regression hangs forever instead


def bounded(call: Callable[[], Any]) -> Any:
    """Run ``call`` in a daemon thread and fail (instead of hanging the suite) if it does not return in time."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_SECONDS)
    if thread.is_alive():
        pytest.fail(f"the request did not finish within {BOUND_SECONDS} s: the slot is blocked")
    if errors:
        raise errors[0]
    return result[0]


def prompt_of(rng: np.random.Generator, n: int) -> list[int]:
    return [1, *rng.integers(3, 300, size=n - 1).tolist()]


def check_fresh(llama: Any, reference: Any, prompt: list[int], what: str) -> None:
    got = bounded(lambda: greedy_tokens(llama, prompt, 4))
    gaps: list[float] = []
    want = fresh_greedy_tokens(reference, prompt, 4, gaps)
    assert_same_answer(got, want, gaps, what)


@pytest.mark.parametrize("kind", KINDS)
def test_abandoned_streams_never_block_the_next_request(make_llama: Any, kind: str) -> None:
    rng = np.random.default_rng(7)
    llama, reference = make_llama(kind), make_llama(kind)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    base = prompt_of(rng, 150)
    abandoned: list[Any] = []

    def abandon_streams() -> None:
        for i in range(6):
            # The host stops iterating a stream (client gone, or interrupted by a new request) without closing it.
            stream = llama.create_completion(base + [10 + i], max_tokens=12, temperature=0, stream=True)
            for _ in range(int(rng.integers(1, 5))):
                next(stream)
            abandoned.append(stream)

    bounded(abandon_streams)
    check_fresh(llama, reference, base + [40, 41, 42], "after abandoned streams")
    # The garbage collector closes them later, from whatever thread: nothing the slot's owner reads changes.
    closer = threading.Thread(target=lambda: [s.close() for s in abandoned])
    closer.start()
    closer.join()
    abandoned.clear()
    gc.collect()
    check_fresh(llama, reference, base + [40, 41, 42, 43], "after the abandoned streams were closed")
    edited = base[:70] + prompt_of(rng, 40)
    check_fresh(llama, reference, edited, "an edit after abandoned streams")
    stats = manager.stats()
    assert stats["slot_tokens"] <= stats["lineage_tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_that_raises_part_way_leaves_the_slot_consistent(make_llama: Any, kind: str) -> None:
    rng = np.random.default_rng(11)
    llama, reference = make_llama(kind), make_llama(kind)
    ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    prompt = prompt_of(rng, 140)
    calls = [0]

    def failing_criterion(tokens: Any, logits: Any) -> bool:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("stopping criterion failed")
        return False

    with pytest.raises(RuntimeError, match="stopping criterion failed"):
        llama.create_completion(prompt, max_tokens=10, temperature=0, stopping_criteria=llama_cpp.StoppingCriteriaList([failing_criterion]))
    check_fresh(llama, reference, prompt + [5], "after a generation that raised")
    check_fresh(llama, reference, prompt[:60] + prompt_of(rng, 30), "an edit after a generation that raised")


def test_a_decode_that_raises_leaves_the_slot_consistent(make_llama: Any) -> None:
    """A plugin failing while a prompt is processed (after llama.cpp decoded part of it) costs only reuse."""
    rng = np.random.default_rng(3)
    llama, reference = make_llama("gemma3"), make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)

    class Failing:
        armed = True

        @ckpt_plugin.hookimpl
        def on_checkpoint_created(self, manager: Any, slot: Any, checkpoint: Any) -> None:
            if self.armed:
                self.armed = False
                raise ValueError("plugin bug")

    manager.plugins.register(Failing(), name="failing")
    prompt = prompt_of(rng, 160)
    with pytest.raises(ckpt_plugin.PluginError):
        llama.create_completion(prompt, max_tokens=4, temperature=0)
    check_fresh(llama, reference, prompt, "after a plugin failed mid-prompt")
