"""attach/detach on real contexts, the host's save_state/load_state/set_cache paths, and copy counters."""

from __future__ import annotations

import tracemalloc
from typing import Any

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_cache import LlamaRAMCache

import ckpt_plugin
from ckpt_plugin import IncompatibleStateError, SharedLlamaState, UnsupportedHostError

PROMPT_A = [1, *range(3, 120)]
PROMPT_B = [1, *range(150, 260)]
SLACK = 64 * 1024  # bookkeeping objects; state buffers are tens of kilobytes and larger


def text(llama: Any, prompt: list[int], n: int = 6) -> str:
    return llama.create_completion(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]


def test_attach_refuses_what_it_cannot_serve(make_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedHostError, match="needs a llama_cpp.Llama"):
        ckpt_plugin.attach(object())  # type: ignore[arg-type]
    llama = make_llama("llama")
    monkeypatch.setattr(llama_cpp, "__version__", "0.2.90")
    with pytest.raises(UnsupportedHostError, match="outside the tested range"):
        ckpt_plugin.attach(llama)
    assert "eval" not in llama.__dict__ and "generate" not in llama.__dict__
    monkeypatch.undo()
    ckpt_plugin.attach(llama, load_entrypoints=False)
    with pytest.raises(UnsupportedHostError, match="already attached"):
        ckpt_plugin.attach(llama)


def test_bad_settings_are_refused_before_patching(make_llama: Any) -> None:
    llama = make_llama("llama")
    with pytest.raises(ValueError, match="no_such_setting"):
        ckpt_plugin.attach(llama, no_such_setting=1)
    with pytest.raises(ValueError, match="physical memory"):
        ckpt_plugin.attach(llama, cache_max_bytes=1 << 60)
    assert "eval" not in llama.__dict__


def test_detach_restores_the_host(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    original_cache = LlamaRAMCache(1 << 20)
    llama.set_cache(original_cache)
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    assert isinstance(llama.cache, ckpt_plugin.HostPromptCache)
    text(llama, PROMPT_A)
    assert ckpt_plugin.detach(llama) is manager
    assert llama.cache is original_cache
    assert not any(name in llama.__dict__ for name in ("eval", "generate", "save_state", "load_state", "set_cache"))
    assert manager.primary.slot.checkpoints == []
    assert ckpt_plugin.manager_of(llama) is None
    with pytest.raises(UnsupportedHostError):
        ckpt_plugin.detach(llama)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba", "hybrid"])
def test_save_restore_share_copy_no_state_bytes(make_llama: Any, kind: str) -> None:
    llama = make_llama(kind)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    text(llama, PROMPT_A)
    size = manager.primary.backend.state_size(partial=False)

    captured = manager.counters.bytes_captured
    tracemalloc.start()
    state = llama.save_state()
    _, peak_save = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert manager.counters.bytes_captured - captured == size  # one get call, into one buffer
    assert peak_save <= size + SLACK
    if state.entry.state.paged:  # the host sees the pages' bytes, assembled when it reads them
        assert np.array_equal(np.frombuffer(state.llama_state, dtype=np.uint8), state.entry.state.target_bytes())
    else:
        assert np.shares_memory(np.frombuffer(state.llama_state, dtype=np.uint8), state.entry.state.target)

    text(llama, PROMPT_B)
    restored = manager.counters.bytes_restored
    tracemalloc.start()
    llama.load_state(state)
    _, peak_restore = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert manager.counters.bytes_restored - restored == size  # one set call, from the shared buffer
    assert peak_restore <= SLACK

    captured = manager.counters.bytes_captured
    tracemalloc.start()
    again = llama.save_state()  # nothing changed: the same capture is shared, not taken again
    assert manager.admit(again.entry)
    other = ckpt_plugin.CheckpointManager(manager.primary.backend, cache=manager.cache, load_entrypoints=False)
    other.controllers[0].memory.adopt(again.entry.tokens, again.entry.checkpoints, again.entry.n_tokens)
    _, peak_share = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert manager.counters.bytes_captured == captured
    assert again.entry.state is state.entry.state
    assert peak_share <= SLACK
    stats = manager.stats()
    assert stats["resident_bytes"] <= stats["referenced_bytes"]


def test_checkpoint_buffers_are_read_only_and_shared(make_llama: Any) -> None:
    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    text(llama, PROMPT_A)
    text(llama, PROMPT_B)  # PROMPT_A goes into the cache with its checkpoints
    (entry,) = manager.cache.entries()
    assert entry.checkpoints and all(not b.flags.writeable for c in entry.checkpoints for b in c.buffers())
    with pytest.raises(ValueError):
        next(entry.checkpoints[0].buffers())[0] = 1
    text(llama, PROMPT_A + [5, 6])  # restored from the cache: the slot shares the entry's checkpoints
    assert {id(c) for c in entry.checkpoints} <= {id(c) for c in manager.primary.slot.checkpoints}
    stats = manager.stats()
    assert stats["resident_bytes"] < stats["referenced_bytes"]


def test_host_cache_path_uses_shared_states(make_llama: Any) -> None:
    """A host that enables its own cache (llama_cpp.server --cache) gets the manager's cache with no change."""
    llama = make_llama("gemma3")
    reference = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    llama.set_cache(LlamaRAMCache(capacity_bytes=1 << 30))
    assert isinstance(llama.cache, ckpt_plugin.HostPromptCache)
    assert manager.cache.max_bytes == 1 << 30
    for prompt in (PROMPT_A, PROMPT_B, PROMPT_A + [9, 10, 11], PROMPT_B[:60] + [4]):
        reference.reset()
        assert text(llama, prompt) == text(reference, prompt)
    assert manager.counters.cache_hits >= 1
    assert all(isinstance(e.state, ckpt_plugin.Checkpoint) for e in manager.cache.entries())


def test_foreign_state_is_refused_and_slot_unchanged(make_llama: Any) -> None:
    llama = make_llama("llama")
    other = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    other_manager = ckpt_plugin.attach(other, load_entrypoints=False)
    text(llama, PROMPT_A)
    text(other, PROMPT_B)
    before = manager.primary.slot.tokens.copy()
    with pytest.raises(IncompatibleStateError, match="belongs to model/context"):
        llama.load_state(other.save_state())
    assert np.array_equal(manager.primary.slot.tokens, before)
    assert manager.primary.backend.pos_max() + 1 == len(before)
    assert isinstance(other.save_state(), SharedLlamaState)
    assert other_manager.fingerprint != manager.fingerprint


def test_plain_llama_state_still_loads(make_llama: Any) -> None:
    """A state saved before attach (a copying LlamaState) loads through the host's own path."""
    llama = make_llama("llama")
    reference = make_llama("llama")
    text(llama, PROMPT_A)
    plain_state = llama.save_state()
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    text(llama, PROMPT_B)
    llama.load_state(plain_state)
    assert manager.primary.slot.n_tokens == plain_state.n_tokens
    assert text(llama, PROMPT_A + [7]) == text(reference, PROMPT_A + [7])


def test_stats_count_reuse(make_llama: Any) -> None:
    llama = make_llama("mamba")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=16, load_entrypoints=False)
    text(llama, PROMPT_A, 3)
    first = manager.stats()["tokens_evaluated"]
    text(llama, PROMPT_A[:100] + [5, 6], 3)
    stats = manager.stats()
    assert stats["tokens_evaluated"] - first <= 2 + 4 + 3  # from the checkpoint at 96 (spacing 16)
    assert stats["checkpoints_restored"] == 1 and stats["tokens_reused"] >= 96
    for key in ("cache_hits", "cache_misses", "checkpoints_created", "forced_reprocess", "resident_bytes",
                "bytes_copied"):
        assert key in stats
