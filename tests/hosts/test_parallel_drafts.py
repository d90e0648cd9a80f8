"""Speculative decoding with parallel slots: a draft sequence per slot, drafting steps batched across slots, the draft's
state stored with each slot's checkpoints and restored into whichever slot resumes the conversation."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama
from ckpt_plugin.hosts.llama_cpp.parallel.slot_drafts import DraftLength
from ckpt_plugin.hosts.llama_cpp.speculative.drafts import NgramDraft

from test_parallel_slots import prompts

PROMPTS = prompts(8)


def complete(llama: Any, prompt: str) -> str:
    return llama.create_completion(prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]


def answers(parallel: ParallelLlama, prompts: list[str]) -> list[str]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda prompt: complete(parallel.view(), prompt), prompts))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_four_concurrent_slots_with_a_draft_answer_as_without_one(make_llama: Callable[..., Any], kind: str) -> None:
    plain = make_llama(kind)
    want = [complete(plain, prompt) for prompt in PROMPTS]
    # The draft is the target's own model: every drafted token is the target's, so a draft out of step with its
    # slot (another slot's sequence, a stale state) shows as rejected tokens.
    parallel = ParallelLlama(make_llama(kind), 4, draft=make_llama(kind), n_draft=4, load_entrypoints=False,
                             checkpoint_min_step=16, plan_by_cost=False)
    try:
        assert answers(parallel, PROMPTS) == want
        drafts = parallel.drafts
        assert drafts is not None and drafts.drafted > 0
        assert drafts.acceptance > 0.9, (drafts.drafted, drafts.accepted)
        assert drafts.lane.shared_steps > 0, vars(drafts.lane)  # drafting steps of several slots at once

        # Again, in another order: conversations land on other slots, restored from the cache with their draft state.
        states = parallel.manager.plugins.get_plugin("ckpt_plugin.draft")
        evaluated = drafts.engine.counters.tokens_evaluated
        assert answers(parallel, PROMPTS[::-1]) == want[::-1]
        assert states.restored > 0
        prompt_tokens = sum(len(plain.tokenize(prompt.encode())) for prompt in PROMPTS)
        assert drafts.engine.counters.tokens_evaluated - evaluated < prompt_tokens
        assert drafts.acceptance > 0.9
    finally:
        parallel.close()


def test_prompt_lookup_decoding_gets_a_decoder_per_slot(make_llama: Callable[..., Any]) -> None:
    plain = make_llama("llama")
    want = [complete(plain, prompt) for prompt in PROMPTS[:4]]
    host = make_llama("llama", draft_model=LlamaPromptLookupDecoding(num_pred_tokens=3))
    parallel = ParallelLlama(host, 2, load_entrypoints=False)
    try:
        assert parallel.lookups is not None and parallel.lookups[0] is not parallel.lookups[1]
        assert answers(parallel, PROMPTS[:4]) == want
    finally:
        parallel.close()


def test_a_stateful_draft_model_of_the_host_is_refused(make_llama: Callable[..., Any]) -> None:
    host = make_llama("llama", draft_model=NgramDraft())
    with pytest.raises(UnsupportedHostError, match="draft="):
        ParallelLlama(host, 2, load_entrypoints=False)


def test_one_drafting_round_drafts_for_every_slot_in_n_draft_steps(make_llama: Callable[..., Any]) -> None:
    """Four slots that ask for drafts together are drafted in one loop: each drafting step carries all four, the
    slots' threads are not woken in between, and each slot's draft is the draft model's own greedy continuation."""
    plain = make_llama("llama")
    starts = [plain.tokenize(prompt.encode())[:12] for prompt in PROMPTS[:4]]  # one step holds all four
    want = []
    for tokens in starts:
        plain.reset()
        generated = plain.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0)
        want.append([next(generated) for _ in range(3)])
    parallel = ParallelLlama(make_llama("llama"), 4, draft=make_llama("llama"), n_draft=3, load_entrypoints=False)
    try:
        drafts = parallel.drafts
        assert drafts is not None
        got: dict[int, list[int]] = {}
        for sequence in drafts.sequences:
            assert sequence.pos_max() == -1  # known from now on without the context's lock
        with drafts.context.lock:  # no drafting step starts until all four are queued
            threads = [threading.Thread(target=lambda i=i: got.__setitem__(
                i, drafts.sequences[i].draft(np.asarray(starts[i], dtype=np.int32), 3))) for i in range(4)]
            for thread in threads:
                thread.start()
            while len(drafts.lane._pending) < 4:
                time.sleep(0.001)
            steps, shared = drafts.lane.steps, drafts.lane.shared_steps
        for thread in threads:
            thread.join(timeout=60)
        assert [got[i] for i in range(4)] == want
        assert drafts.lane.steps - steps == 3 and drafts.lane.shared_steps - shared == 3
        assert parallel.scheduler.steps == 0  # no target step was involved
        # Each sequence holds its prompt and the drafted tokens but the last, which the engine records next.
        for i, sequence in enumerate(drafts.sequences):
            assert sequence.pos_max() == len(starts[i]) + 1
            assert list(sequence.ahead) == list(starts[i]) + want[i][:2]
    finally:
        parallel.close()


def test_a_draft_the_target_rejects_changes_nothing_in_the_answers(make_llama: Callable[..., Any]) -> None:
    """Another model as draft (same vocabulary, other weights): most drafts are rejected and cut from the draft
    sequences, the drafts shorten, and the answers are the target's alone."""
    plain = make_llama("llama")
    want = [complete(plain, prompt) for prompt in PROMPTS[:4]]
    parallel = ParallelLlama(make_llama("llama"), 4, draft=make_llama("gemma3"), n_draft=4, load_entrypoints=False)
    try:
        assert answers(parallel, PROMPTS[:4]) == want
        drafts = parallel.drafts
        assert drafts is not None and drafts.scored > 0 and drafts.acceptance < 0.9
        assert drafts.drafted < 4 * drafts.lane.steps  # shorter drafts than n_draft after rejections
    finally:
        parallel.close()


def test_draft_length_follows_what_the_target_keeps() -> None:
    length = DraftLength(4)
    assert length.current == 4
    length.update(drafted=4, accepted=1)
    assert length.current == 2  # what was kept, and one more
    length.update(drafted=2, accepted=0)
    assert length.current == 1
    length.update(drafted=1, accepted=0)
    assert length.current == 1  # never below the minimum
    for expected in (2, 3, 4, 4):
        length.update(drafted=length.current, accepted=length.current)
        assert length.current == expected
    length.update(drafted=0, accepted=0)  # nothing verified: nothing learnt
    assert length.current == 4
    length.update(drafted=4, accepted=2)
    length.reset()
    assert length.current == 4
