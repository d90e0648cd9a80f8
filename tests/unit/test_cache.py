"""The prompt cache without a model: radix index against brute force, budgets, shared-byte accounting."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers import radix
from ckpt_plugin.tiers.radix import RadixIndex
from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.checkpoint import Checkpoint, StateBufferPool, freeze
from ckpt_plugin.core.memory import common_prefix
from ckpt_plugin.core.buffers import SPARE_MAPPER

from support import factories
from support.factories import zeros


def checkpoint(n_tokens: int, n_bytes: int = 100, partial: bool = True) -> Checkpoint:
    return factories.checkpoint(n_tokens, partial=partial, n_bytes=n_bytes)


def entry(tokens: list[int], n_bytes: int = 1000, checkpoints: tuple[Checkpoint, ...] = (),
          namespace: str = "default") -> CacheEntry:
    return factories.entry(tokens, n_bytes=n_bytes, checkpoints=checkpoints, namespace=namespace)


# Small ids branch often; the large ones differ from each other in one byte only, so that a mismatch inside a token's
# bytes is found at that token.
token_lists = st.lists(st.sampled_from([0, 1, 2, 3, 4, 256, 257, 1 << 24, (1 << 24) + 1, 2**31 - 1]),
                       min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=25, unique_by=tuple), token_lists,
       st.lists(st.integers(0, 24), max_size=10))
def test_radix_lookup_finds_the_longest_common_prefix(keys: list[list[int]], prompt: list[int],
                                                      removals: list[int]) -> None:
    index = RadixIndex()
    entries = [entry(k) for k in keys]
    for e in entries:
        index.insert(e)
    for r in removals:
        if r < len(entries):
            index.remove(entries[r])
    alive = [e for e in entries if e._node is not None]
    assert index.size == len(alive)
    query = np.asarray(prompt, dtype=np.int32)
    found = index.lookup(query, max_candidates=len(entries))
    # A host's key is a Python list: the same answer as for the array.
    assert [(id(e), n) for e, n in index.lookup(prompt, max_candidates=len(entries))] == [(id(e), n) for e, n in found]
    best = max((common_prefix(e.tokens, query) for e in alive), default=None)
    if best is None or best == 0 and not any(len(e.tokens) == 0 for e in alive):
        assert all(n == 0 for _, n in found)
        return
    assert found, "a shared prefix exists but lookup found nothing"
    assert max(n for _, n in found) == best
    for e, n in found:
        assert common_prefix(e.tokens, query) == n


def test_lookup_cost_does_not_scan_entries() -> None:
    rng = np.random.default_rng(0)
    index = RadixIndex()
    shared = rng.integers(0, 1000, 1500).astype(np.int32)
    for _ in range(2000):
        tail = rng.integers(0, 1000, 500).astype(np.int32)
        index.insert(entry(np.concatenate((shared, tail)).tolist()))
    calls = 0
    real = radix.common_tokens

    def counting(edge: bytes, key: bytes, offset: int) -> int:
        nonlocal calls
        calls += 1
        return real(edge, key, offset)

    radix.common_tokens = counting
    try:
        index.lookup(np.concatenate((shared, rng.integers(0, 1000, 500).astype(np.int32))))
    finally:
        radix.common_tokens = real
    assert calls <= 3, f"lookup compared {calls} edges"


def test_budget_evicts_least_recently_used_and_counts_shared_buffers_once() -> None:
    cache = PromptCache(max_bytes=3000)
    shared = checkpoint(5, 500)
    a = entry([1, 2, 3], 1000, (shared,))
    b = entry([1, 2, 4], 1000, (shared,))
    assert cache.insert(a)[0] and cache.insert(b)[0]
    assert cache.resident_bytes == 2500  # the shared checkpoint counted once
    cache.touch(a)
    c = entry([7, 8], 1000)
    admitted, removed = cache.insert(c)
    assert admitted and [r for r, _ in removed] == [b]
    assert cache.resident_bytes == 2500
    assert {id(e) for e in cache.entries()} == {id(a), id(c)}


def test_entry_larger_than_budget_is_refused_and_nothing_is_evicted() -> None:
    cache = PromptCache(max_bytes=1500)
    assert cache.insert(entry([1], 1000))[0]
    admitted, removed = cache.insert(entry([2], 2000))
    assert not admitted and removed == [] and len(cache) == 1


def test_token_budget() -> None:
    cache = PromptCache(max_tokens=5)
    cache.insert(entry([1, 2, 3]))
    cache.insert(entry([4, 5, 6]))
    assert len(cache) == 1 and cache.n_tokens == 3


def test_veto_keeps_entry_out() -> None:
    cache = PromptCache()
    admitted, _ = cache.insert(entry([1, 2]), admit=lambda n: False)
    assert not admitted and len(cache) == 0 and cache.resident_bytes == 0


def test_longer_entry_of_same_lineage_replaces_its_prefix() -> None:
    cache = PromptCache()
    c1 = checkpoint(2)
    short = entry([1, 2, 3], checkpoints=(c1,))
    long = entry([1, 2, 3, 4, 5], checkpoints=(c1, checkpoint(4)))
    other = entry([1, 2], checkpoints=(checkpoint(1),))
    for e in (other, short, long):
        cache.insert(e)
    assert {id(e) for e in cache.entries()} == {id(other), id(long)}


def test_a_turn_that_went_on_from_an_entrys_last_checkpoint_supersedes_it() -> None:
    # Turn 1 ends with a generated reply (5, 6); turn 2 sent another reply back (7) after the checkpoint at 4.
    cache = PromptCache()
    shared, at_prompt_end = checkpoint(2), checkpoint(4)
    turn1 = entry([1, 2, 3, 4, 5, 6], checkpoints=(shared, at_prompt_end))
    branch = entry([1, 2, 3, 9, 9, 9], checkpoints=(shared, checkpoint(3)))  # left before turn 1's last checkpoint
    plain = entry([1, 2, 3, 4, 8, 8])  # no checkpoints: a full state that serves any of its prefixes
    foreign = entry([1, 2, 3, 4, 5, 6, 1], checkpoints=(shared, at_prompt_end), namespace="other")
    for e in (turn1, branch, plain, foreign):
        cache.insert(e)
    turn2 = entry([1, 2, 3, 4, 7, 7, 7], checkpoints=(shared, at_prompt_end, checkpoint(6)))
    cache.insert(turn2)
    assert {id(e) for e in cache.entries()} == {id(branch), id(plain), id(foreign), id(turn2)}
    # Without turn 1's own checkpoints, turn 2 would serve less than it: both stay.
    cache = PromptCache()
    cache.insert(turn1)
    cache.insert(entry([1, 2, 3, 4, 7, 7, 7], checkpoints=(shared, checkpoint(4))))
    assert len(cache) == 2


def test_namespaces_are_partitions() -> None:
    cache = PromptCache()
    cache.insert(entry([1, 2, 3], namespace="tenant-a"))
    prompt = np.asarray([1, 2, 3, 4], dtype=np.int32)
    assert cache.lookup("tenant-b", "fp", prompt) == []
    assert cache.lookup("tenant-a", "fp", prompt)[0][1] == 3


def test_invalid_budgets_are_refused() -> None:
    with pytest.raises(ValueError):
        PromptCache(max_bytes=-1)
    with pytest.raises(ValueError):
        PromptCache(max_tokens=-5)


def test_pinned_buffers_count_against_the_budget_once_and_evict_entries() -> None:
    cache = PromptCache(max_bytes=3200)  # 200 bytes of it are the pool's allowance: 3000 for entries and pins
    a, b = entry([1, 2], 1000), entry([3, 4], 1000)
    assert cache.insert(a)[0] and cache.insert(b)[0]
    held = checkpoint(9, 1500)
    removed = cache.pin("slot", [held.target])
    assert [r for r, _ in removed] == [a] and cache.resident_bytes == 2500
    assert cache.pinned_only_bytes() == 1500
    # an entry referencing the pinned buffer pays nothing for it
    c = entry([5, 6], 400, (held,))
    assert cache.new_bytes(c) == 400 and cache.unshared_bytes(c) == 1900
    assert cache.insert(c)[0] and cache.resident_bytes == 2900 and cache.pinned_only_bytes() == 0
    # releasing the pin keeps the buffer for the entry that references it
    assert cache.pin("slot", []) == [] and cache.resident_bytes == 2900
    cache.remove(c)
    assert cache.resident_bytes == 1000


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.lists(st.integers(0, 5), max_size=3)),
                max_size=12))
def test_pin_changes_count_as_pinning_the_whole_list(steps: list[tuple[list[int], list[int]]]) -> None:
    """A holder's references after every add/release step are counted exactly as ``pin`` of its whole list."""
    pool = [zeros(100 * (i + 1)) for i in range(6)]  # buffer i is 100 * (i + 1) bytes
    incremental, whole = PromptCache(max_bytes=1 << 20), PromptCache(max_bytes=1 << 20)
    references: list[int] = []
    for added, released in steps:
        references += added
        held = []  # release only what is held
        for i in released:
            if i in references:
                references.remove(i)
                held.append(i)
        released = held
        incremental.pin_changes("slot", [pool[i] for i in added], [pool[i] for i in released])
        whole.pin("slot", [pool[i] for i in references])
        assert incremental.resident_bytes == whole.resident_bytes == sum(100 * (i + 1) for i in set(references))
    # Releasing what the holder does not pin changes nothing; re-pinning the whole list agrees.
    incremental.pin_changes("slot", [], [zeros(50)])
    incremental.pin("slot", [pool[i] for i in references])
    assert incremental.resident_bytes == whole.resident_bytes


def test_pins_larger_than_the_budget_empty_the_cache_and_stay_counted() -> None:
    cache = PromptCache(max_bytes=1600)
    assert cache.insert(entry([1], 1000))[0]
    removed = cache.pin("slot", [zeros(2000)])
    assert len(removed) == 1 and len(cache) == 0 and cache.resident_bytes == 2000
    assert not cache.insert(entry([2], 10))[0]


def test_resize_goes_through_the_victim_selector() -> None:
    cache = PromptCache(max_bytes=4000)
    entries = [entry([i], 1000) for i in range(3)]
    for e in entries:
        cache.insert(e)
    asked: list[int] = []

    def newest_first(candidates: list[CacheEntry], n_bytes: int) -> list[CacheEntry]:
        asked.append(n_bytes)
        return list(reversed(candidates))

    evicted = cache.resize(1500, newest_first)  # room for one entry
    assert asked and evicted == [entries[2], entries[1]]


def test_recycled_mappings_stay_within_the_budget() -> None:
    budget = 8 << 20
    cache = PromptCache(max_bytes=budget)
    rng = np.random.default_rng(0)
    for i in range(60):
        size = int(rng.integers(200_000, 700_000))
        data = cache.pool.allocate(size)
        data[:] = 1
        state = factories.checkpoint(1, partial=False, target=freeze(data))
        cache.insert(factories.entry([i], state=state))
        del data, state
        assert cache.state_bytes <= budget
    assert cache.pool.reused > 0  # evicted entries' mappings serve later captures


def test_a_new_mapping_leaves_a_spare_for_the_next_capture_within_the_free_allowance() -> None:
    mib = 1 << 20
    pool = StateBufferPool(max_free_bytes=8 * mib)
    held = [pool.allocate(3 * mib)]  # nothing to recycle: mapped on the caller's thread, a spare is queued
    assert pool.mapped == 1 and SPARE_MAPPER.wait_idle(10) and pool.spares_mapped == 1
    assert 3 * mib < pool.free_bytes <= 4 * mib
    held.append(pool.allocate(3 * mib + 4096))  # a little larger, as a growing conversation's next state
    assert (pool.mapped, pool.reused, pool.free_bytes) == (1, 1, 0)
    held.append(pool.allocate(7 * mib))  # mapped; its spare (7.9 MiB) still fits the allowance
    assert SPARE_MAPPER.wait_idle(10) and pool.spares_mapped == 2
    held.append(pool.allocate(mib))  # mapped; a spare for it would exceed the allowance
    assert pool.mapped == 3
    assert SPARE_MAPPER.wait_idle(10)
    assert pool.spares_mapped == 2 and pool.free_bytes <= 8 * mib
    plain = StateBufferPool(spares=False)
    held.append(plain.allocate(mib))
    assert SPARE_MAPPER.wait_idle(10)
    assert plain.spares_mapped == 0 and plain.free_bytes == 0


def test_a_buffer_released_inside_the_pools_own_lock_never_waits_for_it() -> None:
    """A buffer can die anywhere: in a garbage collection that an allocation inside the pool's locked code sets
    off, too. Its release then runs inside the pool's lock (held here directly, to make that moment certain) and
    must not wait for it; the mapping is taken in by the next call."""
    mib = 1 << 20
    pool = StateBufferPool(max_free_bytes=64 * mib, spares=False)
    held = [pool.allocate(5 * mib)]

    def release_under_the_lock() -> None:
        with pool._lock:
            held.clear()

    worker = threading.Thread(target=release_under_the_lock, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a buffer released inside the pool's lock deadlocked"
    assert pool.free_bytes == 5 * mib  # taken in by the next call
    reused = pool.allocate(5 * mib)
    assert pool.reused == 1 and reused.nbytes == 5 * mib
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # and with collections at every container allocation, the pool keeps working
    try:
        for _ in range(100):
            cycle: list[object] = [pool.allocate(5 * mib)]
            cycle.append(cycle)
            del cycle
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert pool.free_bytes <= 64 * mib and pool.mapped <= 3
