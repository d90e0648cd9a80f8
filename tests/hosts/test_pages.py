"""Paged states on real contexts: byte-exact assembly, equal page ids over equal bytes, pages shared by the
checkpoints, entries and conversations that hold the same cells, restores from pages equal to fresh contexts."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.core.counters import Counters
from ckpt_plugin.core.pages import PagedState, PageStore
from ckpt_plugin.engine.paging import StatePager

KINDS = ["llama", "gemma3", "gemma3-flash", "mamba", "hybrid"]


def capture(manager: Any, partial: bool) -> np.ndarray:
    """Sequence 0's state now, read by hand (not through the engine's store)."""
    backend = manager.primary.backend
    buffer = np.empty(backend.state_size(partial), dtype=np.uint8)
    assert backend.read_state(buffer, partial) == buffer.nbytes
    buffer.flags.writeable = False
    return buffer


def fresh_pager(manager: Any, page_positions: int = 8) -> StatePager:
    """A pager over a store of its own: every page it gives was cut from the state it was handed."""
    return StatePager(manager.kind, manager.primary.backend.fingerprint, page_positions, Counters(), PageStore())


def evaluate(llama: Any, tokens: list[int]) -> None:
    llama.create_completion(tokens, max_tokens=1, temperature=0)


@pytest.mark.parametrize("kind", KINDS)
def test_equal_ids_hold_equal_bytes_and_assembly_is_byte_exact(make_llama: Any, kind: str) -> None:
    """Random conversations with edits and branches: every state assembled from its pages is the captured state,
    byte for byte, and wherever two captures cut a page with one id, they cut the same bytes."""
    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    rng = random.Random(f"pages-{kind}")
    seen: dict[bytes, bytes] = {}
    paged_any = False
    history: list[list[int]] = [[1, *range(3, 40)]]
    for _ in range(10):
        base = rng.choice(history)
        cut = rng.randrange(1, len(base) + 1)
        prompt = base[:cut] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))]
        evaluate(llama, prompt)
        history.append(list(llama._input_ids))
        for partial in (False, True):
            state = capture(manager, partial)
            paged = fresh_pager(manager).page(state, manager.primary.slot.tokens, "default", partial)
            if not isinstance(paged, PagedState):
                assert kind == "mamba" or (kind == "hybrid" and partial)  # no cells by position
                continue
            paged_any = True
            assert np.array_equal(paged.materialize(), state)
            for page_id, page in paged.pages_by_id().items():
                assert seen.setdefault(page_id, page.tobytes()) == page.tobytes()
    assert paged_any == (kind != "mamba")


@pytest.mark.parametrize("kind", ["gemma3", "gemma3-flash"])
def test_checkpoints_and_entries_share_pages(make_llama: Any, kind: str) -> None:
    """A conversation's checkpoints share the window cells they have in common, a cache entry shares the cells of its
    checkpoints, and the cache's budget counts every page once."""
    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    system = [1, *range(3, 100)]
    for turn in range(3):
        evaluate(llama, system + list(range(120, 130 + 10 * turn)))
    evaluate(llama, [1, *range(200, 240)])  # the conversation goes into the cache
    counters = manager.counters
    assert counters.pages_shared > 0 and counters.page_bytes_shared > 0
    assert counters.states_kept_whole == 0
    (entry,) = [e for e in manager.cache.entries() if e.n_tokens > 100]
    assert entry.state.paged
    logical = entry.state.nbytes + sum(c.nbytes for c in entry.checkpoints)
    assert entry.nbytes < logical  # unique buffers: pages shared by its records counted once
    stats = manager.stats()
    assert stats["resident_bytes"] <= stats["referenced_bytes"]


@pytest.mark.parametrize("kind", ["gemma3", "gemma3-flash", "llama", "hybrid"])
def test_conversations_sharing_a_prompt_share_its_pages(make_llama: Any, kind: str) -> None:
    """Two conversations on one system prompt: the second entry adds only the pages past the prompt."""
    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    system = [1, *range(3, 131)]
    evaluate(llama, system + list(range(140, 150)))
    evaluate(llama, [1, *range(200, 240)])
    first = manager.cache.resident_bytes
    evaluate(llama, system + list(range(160, 170)))
    evaluate(llama, [1, *range(200, 240)])
    added = manager.cache.resident_bytes - first
    entries = sorted((e for e in manager.cache.entries() if e.n_tokens > 100), key=lambda e: e.n_tokens)
    assert len(entries) == 2
    assert added < entries[-1].nbytes / 2  # the prompt's pages are the first conversation's


@pytest.mark.parametrize("kind", ["gemma3", "gemma3-flash", "llama", "hybrid"])
def test_restores_from_pages_answer_as_fresh_contexts(make_llama: Any, kind: str) -> None:
    llama = make_llama(kind)
    ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    fresh = make_llama(kind)
    rng = random.Random(f"restore-{kind}")
    prompts = [[1, *range(3, 90)], [1, *range(3, 60), 7, 8, 9], [1, *range(3, 90), 11, 12], [1, *range(3, 30)]]
    for _ in range(6):
        prompt = rng.choice(prompts) + [rng.randrange(3, 250) for _ in range(rng.randrange(0, 5))]
        fresh.reset()
        want = fresh.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        got = llama.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        assert got == want, prompt
    manager = ckpt_plugin.manager_of(llama)
    assert manager.counters.bytes_restored > 0


def test_an_unknown_layout_is_kept_whole_counted_and_logged_once(make_llama: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    evaluate(llama, [1, *range(3, 40)])
    pager = StatePager(manager.kind, "fp", 8, manager.counters, PageStore())
    state = capture(manager, False).copy()
    state[8:12] = 0xFF  # the first cache's stream count: no layout llama.cpp writes
    state.flags.writeable = False
    before = manager.counters.states_kept_whole
    with caplog.at_level(logging.WARNING, logger="ckpt_plugin"):
        assert pager.page(state, manager.primary.slot.tokens, "default", False) is state
        assert pager.page(state, manager.primary.slot.tokens, "default", False) is state
    assert manager.counters.states_kept_whole - before == 2
    assert sum("kept whole" in record.message for record in caplog.records) == 1


def test_paging_off_keeps_states_whole(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, page_positions=0, checkpoint_min_step=16, load_entrypoints=False)
    evaluate(llama, [1, *range(3, 90)])
    assert manager.primary.slot.checkpoints
    assert not any(c.paged for c in manager.primary.slot.checkpoints)
    assert manager.counters.pages_stored == 0


def test_pages_of_other_tenants_are_never_shared(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    evaluate(llama, [1, *range(3, 90)])
    state = capture(manager, False)
    store = PageStore()
    pager = StatePager(manager.kind, manager.primary.backend.fingerprint, 8, Counters(), store)
    mine = pager.page(state, manager.primary.slot.tokens, "alice", False)
    theirs = pager.page(state, manager.primary.slot.tokens, "bob", False)
    assert isinstance(mine, PagedState) and isinstance(theirs, PagedState)
    assert not set(mine.page_ids) & set(theirs.page_ids)
    assert not {id(p) for p in mine.parts()} & {id(p) for p in theirs.parts()}


@pytest.mark.gemma
def test_gemma_pages_equal_ids_equal_bytes(gemma_path: Any) -> None:
    """The same on Gemma-3-270M (an iSWA model: a base cache and a 512-position window cache)."""
    from llama_cpp import Llama

    llama = Llama(model_path=str(gemma_path), n_ctx=2048, n_batch=256, n_threads=2, verbose=False, flash_attn=True)
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    rng = random.Random("gemma-pages")
    seen: dict[bytes, bytes] = {}
    base = [2, *[rng.randrange(100, 20000) for _ in range(700)]]
    shared = 0
    for turn in range(4):
        prompt = base[: rng.randrange(400, len(base))] + [rng.randrange(100, 20000) for _ in range(40)]
        evaluate(llama, prompt)
        for partial in (False, True):
            state = capture(manager, partial)
            paged = fresh_pager(manager, 32).page(state, manager.primary.slot.tokens, "default", partial)
            assert isinstance(paged, PagedState)
            assert np.array_equal(paged.materialize(), state)
            for page_id, page in paged.pages_by_id().items():
                if page_id in seen:
                    shared += 1
                assert seen.setdefault(page_id, page.tobytes()) == page.tobytes()
    assert shared > 0
