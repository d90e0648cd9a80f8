"""Speculative decoding with the draft model's and the speculative decoder's state stored in every checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.speculative.drafts import DraftModel, NgramDraft, NgramStatePlugin, enable_speculative
from ckpt_plugin.testing import assert_same_answer, fresh_greedy_tokens, greedy_tokens

N = 8
A = [1, *range(30, 150)]
B = [1, *range(200, 300)]
REQUESTS = [A, B, A + [5, 6, 7], A[:70] + [9, 9, 8], B + [4, 4], A + [5, 6, 7, 11]]


def speculative_pair(make_llama: Any, kind: str, draft_kind: str | None = None) -> tuple[Any, Any, DraftModel]:
    target = make_llama(kind, logits_all=True)
    # Token counts are asserted: every checkpoint is taken and the plan keeping the most tokens is chosen. By cost, a
    # tiny model evaluates so fast that whether a copy pays depends on the machine's timing at that moment.
    manager = ckpt_plugin.attach(target, checkpoint_min_step=32, load_entrypoints=False, plan_by_cost=False)
    draft = enable_speculative(target, manager, make_llama(draft_kind or kind), n_draft=4)
    return target, manager, draft


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_speculation_gives_the_answers_of_plain_greedy(make_llama: Any, kind: str) -> None:
    target, manager, draft = speculative_pair(make_llama, kind)
    reference = make_llama(kind)
    for prompt in REQUESTS:
        gaps: list[float] = []
        want = fresh_greedy_tokens(reference, prompt, N, gaps)
        assert_same_answer(greedy_tokens(target, prompt, N), want, gaps, f"{kind} {len(prompt)}")
    assert draft.drafted > 0 and manager.counters.checkpoints_restored + manager.counters.cache_hits > 0


def test_after_a_restore_the_draft_evaluates_only_past_the_checkpoint(make_llama: Any) -> None:
    target, manager, draft = speculative_pair(make_llama, "gemma3")
    plugin = manager.plugins.get_plugin("ckpt_plugin.draft")
    greedy_tokens(target, A, N)
    greedy_tokens(target, B, N)                         # A (and the draft's state) go into the cache
    before = draft.manager.counters.tokens_evaluated
    greedy_tokens(target, A + [5, 6, 7], N)             # the target restores A's entry, the draft its state
    assert plugin.restored >= 1
    evaluated = draft.manager.counters.tokens_evaluated - before
    assert evaluated <= 3 + 2 * N + 8, evaluated        # not the whole prompt again (len(A) = 121)


def test_mismatched_draft_data_is_dropped_and_counted(make_llama: Any, tiny_model: Any, tmp_path: Any) -> None:
    from llama_cpp import Llama

    from support.llamas import TINY_LLAMA_KWARGS
    from ckpt_plugin.testing.tiny_models import build_tiny_model

    target, manager, draft = speculative_pair(make_llama, "llama")
    reference = make_llama("llama")
    greedy_tokens(target, A, N)
    greedy_tokens(target, B, N)
    # Same vocabulary, other weights: a different fingerprint. Its data is not this draft's.
    other = Llama(str(build_tiny_model("llama", tmp_path / "other.gguf", seed=5)), **TINY_LLAMA_KWARGS)
    plugin = manager.plugins.get_plugin("ckpt_plugin.draft")
    plugin.draft = DraftModel(other, target, 4)
    target.draft_model = plugin.draft
    gaps: list[float] = []
    want = fresh_greedy_tokens(reference, A + [5, 6, 7], N, gaps)
    assert_same_answer(greedy_tokens(target, A + [5, 6, 7], N), want, gaps, "after a dropped draft state")
    assert manager.counters.draft_dropped >= 1 and plugin.dropped >= 1
    other.close()


def test_speculative_state_rides_in_checkpoints(make_llama: Any) -> None:
    target = make_llama("gemma3")
    # Token counts are asserted: every checkpoint is taken and the plan keeping the most tokens is chosen. By cost, a
    # tiny model evaluates so fast that whether a copy pays depends on the machine's timing at that moment.
    manager = ckpt_plugin.attach(target, checkpoint_min_step=32, load_entrypoints=False, plan_by_cost=False)
    ngram = NgramDraft(n=2, n_draft=4)
    manager.plugins.register(NgramStatePlugin(ngram))
    greedy_tokens(target, A, 4)
    checkpoint = manager.primary.slot.checkpoints[-1]
    assert checkpoint.speculative is not None and not checkpoint.speculative.flags.writeable
    greedy_tokens(target, B, 4)
    (entry,) = [e for e in manager.cache.entries() if e.tokens[1] == A[1]]
    assert entry.state.speculative is not None
    ngram.update(B)                                    # the index now describes B
    loaded: list[list[int]] = []
    real_load = ngram.load
    ngram.load = lambda data: (real_load(data), loaded.append(list(ngram.tokens)))  # type: ignore[method-assign]
    greedy_tokens(target, A[:100] + [3, 3], 4)         # restored from A's checkpoint at 96
    assert loaded == [A[:96]]                          # ... and so was the index, with it
    assert ngram.index[tuple(A[40:42])] == 42          # the restored index finds A's n-grams


def test_other_vocabulary_is_refused(make_llama: Any, gemma_path: Any) -> None:
    from llama_cpp import Llama

    target = make_llama("llama", logits_all=True)
    manager = ckpt_plugin.attach(target, load_entrypoints=False)
    gemma_vocab = Llama(str(gemma_path), vocab_only=True, verbose=False)
    with pytest.raises(ckpt_plugin.IncompatibleStateError, match="vocabulary"):
        enable_speculative(target, manager, gemma_vocab)
    assert target.draft_model is None and manager.plugins.get_plugin("ckpt_plugin.draft") is None


def test_recurrent_targets_are_refused(make_llama: Any) -> None:
    target = make_llama("mamba", logits_all=True)
    manager = ckpt_plugin.attach(target, load_entrypoints=False)
    with pytest.raises(ckpt_plugin.UnsupportedHostError, match="rolled back"):
        enable_speculative(target, manager, make_llama("mamba"))


GEMMA_NOISE = 0.3
"""Gemma-3-270M Q4_K_M's top-2 logit gap moves by up to 0.26 when the same 201-token prompt is decoded in other
batches (one batch against 150 + 51, 199 + 1 or 120 + 81; measured on AVX2 and AVX-512 builds alike), far more than
on the tiny test models: near-ties below this may go either way."""


@pytest.mark.gemma
def test_gemma_is_its_own_draft(gemma_path: Any) -> None:
    """Gemma-3-270M drafting for itself gives the answers of plain greedy decoding, across a cache switch."""
    from llama_cpp import Llama

    options = dict(n_ctx=1024, n_batch=256, n_threads=2, swa_full=False, verbose=False, seed=0)
    target = Llama(str(gemma_path), logits_all=True, **options)
    reference = Llama(str(gemma_path), **options)
    manager = ckpt_plugin.attach(target, load_entrypoints=False)
    draft = enable_speculative(target, manager, Llama(str(gemma_path), **options), n_draft=4)
    rng = np.random.default_rng(3)
    body = [2, *rng.integers(1000, 20000, 150).tolist()]
    first, other = body + body[1:], [2, *rng.integers(1000, 20000, 200).tolist()]
    for prompt in (first, other, first + body[1:9]):
        gaps: list[float] = []
        want = fresh_greedy_tokens(reference, prompt, 12, gaps)
        assert_same_answer(greedy_tokens(target, prompt, 12), want, gaps, f"gemma {len(prompt)}", GEMMA_NOISE)
    assert draft.acceptance > 0.3 and manager.counters.cache_hits >= 1
    for llama in (target, reference, draft.llama):
        llama.close()
